#!/usr/bin/env bash
# Real SGLang servers on the offline GPU machine (issue 29):
#   bash tools/gpu_server.sh MODE[:SECONDS][,MODE[:SECONDS]...] [main.py args]
# MODE is smoke, matrix, ttft or cp2; several run one after the other (e.g. matrix:300,ttft: the matrix
# gets 300 s, ttft the rest). MODE-dry (e.g. cp2-dry) starts no engine: it builds each cell's server
# arguments (issue 28's two-rank cells, on one GPU).
# Needs the carry of one release in ./.srvcarry (written here by
# `python3 tools/sglang_carry.py --server 0.5.17 -o .srvcarry`; name .srvcarry in the call's carry).
# Installs it into /tmp/srv/site, this package (editable, so SGLang finds its entry point), checks that
# every server module imports (seconds, all failures at once), builds this package's kernel, then runs
# tools/sglang_server/main.py per mode, which leaves <mode>-summary.md, <mode>-summary.json and
# <mode>-cells.tar.gz in $OUT (with imports.json: 7 files for two modes, within the 8 a call returns).
# Extra arguments go to main.py (--budget-s, --parallel, --only A,B, --skip A,B, --rounds N, --dry-run). A cross-pinned carry's
# carry.json sets SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1, and its results are labelled unofficial.
set -uo pipefail
MODES=${1:?usage: gpu_server.sh MODE[:SECONDS][,MODE[:SECONDS]...] [main.py args]}; shift
OUT=${OUT:-$PWD/gpu-out}; CARRY=${SRV_CARRY:-.srvcarry}; SRV=/tmp/srv
mkdir -p "$OUT" $SRV/cache
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SRV/site "$CARRY"/*.whl \
  || { echo "carry install failed"; exit 1; }
for t in "$CARRY"/*.tar.gz; do tar -xzf "$t" -C $SRV/site; done
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -1
RELEASE=$(python3 -c "import json,sys; print(json.load(open('$CARRY/carry.json'))['release'])")
LABEL=$(python3 -c "import json; c=json.load(open('$CARRY/carry.json')); print('official' if c['official'] else 'unofficial, cross-pinned on sglang-kernel '+c['kernel'])")
eval "$(python3 -c "import json; [print(f'export {k}={v}') for k, v in json.load(open('$CARRY/carry.json'))['env'].items()]")"
export PYTHONPATH=$SRV/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export SGLANG_HICACHE_JIT_CACHE_DIR=$SRV/cache/hicache TRITON_CACHE_DIR=$SRV/cache/triton \
  TVM_FFI_CACHE_DIR=$SRV/cache/tvm-ffi FLASHINFER_WORKSPACE_BASE=$SRV/cache/flashinfer
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
echo "== sglang $RELEASE ($LABEL): carry installed in $((SECONDS - T0)) s"
python3 tools/sglang_server/server_imports.py > "$OUT/imports.json" 2> $SRV/imports.err
if [ $? -ne 0 ]; then echo "server modules do not import:"; head -c 3000 "$OUT/imports.json"; tail -20 $SRV/imports.err; exit 1; fi
echo "== server modules import ($((SECONDS - T0)) s)"
python3 -m sglang_hicache_jit prewarm > $SRV/prewarm.log 2>&1 &
END=$(( T0 + ${SRV_WALL_S:-540} - 30 ))  # leave time to write and return
rc=0
for item in ${MODES//,/ }; do
  mode=${item%%:*}; secs=${item#*:}; [ "$secs" = "$item" ] && secs=$(( END - SECONDS ))
  dry=""; [ "${mode%-dry}" != "$mode" ] && { mode=${mode%-dry}; dry=--dry-run; }  # e.g. cp2-dry: no engine
  [ "$secs" -gt $(( END - SECONDS )) ] && secs=$(( END - SECONDS ))
  echo "== $mode: $secs s"
  python3 tools/sglang_server/main.py "$mode" --release "$RELEASE" --label "$LABEL" --out "$OUT" --work $SRV/work \
    --budget-s "$(( secs - 15 ))" $dry "$@" || rc=1
done
tail -2 $SRV/prewarm.log
echo "== done in $((SECONDS - T0)) s (rc $rc)"
exit $rc
