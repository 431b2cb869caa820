#!/usr/bin/env bash
# Real SGLang servers on the offline GPU machine (issue 29):
#   bash tools/gpu_server.sh MODE[:SECONDS][,MODE[:SECONDS]...] [main.py args]
# MODE is smoke, matrix, ttft, realsize (issue 36: the real-size models' TTFT and TPOT, one engine at a
# time; one model per call, e.g. realsize --only mha-8b) or cp2; several run one after the other (e.g. matrix:300,ttft: the matrix
# gets 300 s, ttft the rest). MODE-dry (e.g. cp2-dry) starts no engine: it builds each cell's server
# arguments (issue 28's two-rank cells, on one GPU). MODE pytest runs tests/test_sglang_server_gpu.py (the
# smoke through pytest, its summary under $OUT/pytest/); a skipped test fails there, as nothing was shown.
# Needs the carry of one release in ./.srvcarry (written here by
# `python3 tools/sglang_carry.py --server 0.5.17 -o .srvcarry`; name .srvcarry in the call's carry).
# tools/sglang_server/install.py checks every file of the carry against carry.json's sha256 and every tar
# member (no links, no absolute or '..' names), then installs it into a fresh /tmp/srv/site.XXXXXX (never
# over an earlier carry's files); this package goes in editable (so SGLang finds its entry point); every
# server module must import (seconds, all failures at once); this package's kernel is built; then
# tools/sglang_server/main.py runs per mode, which leaves <mode>-summary.md, <mode>-summary.json and
# <mode>-cells.tar.gz in $OUT (with imports.json and gpu-clocks.csv: 8 files for two modes, the most a call
# returns).
# Extra arguments go to main.py (--budget-s, --parallel, --only A,B, --skip A,B, --rounds N, --lengths N,M, --order A,B,
# --modes A,B for realsize, --dry-run).
# carry.json's env (e.g. SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 for a cross-pinned carry, whose results are
# labelled unofficial, or SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python for 0.5.23) is exported as data:
# install.py checks each name and writes NAME=value items that are exported as they are, never evaluated.
# Any refusal or failed step before the modes stops the script (set -e).
set -euo pipefail
MODES=${1:?usage: gpu_server.sh MODE[:SECONDS][,MODE[:SECONDS]...] [main.py args]}; shift
OUT=${OUT:-$PWD/gpu-out}; CARRY=${SRV_CARRY:-.srvcarry}; SRV=${SRV_DIR:-/tmp/srv}
mkdir -p "$OUT" "$SRV/cache"
T0=$SECONDS
rm -rf "$SRV"/site "$SRV"/site.*  # an earlier carry's files never mix with this one's
SITE=$(mktemp -d "$SRV/site.XXXXXX")
if ! python3 tools/sglang_server/install.py "$CARRY" "$SITE" "$SRV/carry.env" "$SRV/carry.facts"; then
  echo "carry install failed"; exit 1
fi
{ IFS= read -r RELEASE; IFS= read -r LABEL; } < "$SRV/carry.facts"
while IFS= read -r -d '' item; do export "$item"; done < "$SRV/carry.env"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -1
export PYTHONPATH=$SITE:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export SGLANG_HICACHE_JIT_CACHE_DIR=$SRV/cache/hicache TRITON_CACHE_DIR=$SRV/cache/triton \
  TVM_FFI_CACHE_DIR=$SRV/cache/tvm-ffi FLASHINFER_WORKSPACE_BASE=$SRV/cache/flashinfer
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
echo "== sglang $RELEASE ($LABEL): carry installed in $((SECONDS - T0)) s into $SITE"
if ! python3 tools/sglang_server/server_imports.py > "$OUT/imports.json" 2> "$SRV/imports.err"; then
  echo "server modules do not import:"; head -c 3000 "$OUT/imports.json"; tail -20 "$SRV/imports.err"; exit 1
fi
echo "== server modules import ($((SECONDS - T0)) s)"
python3 -m sglang_hicache_jit prewarm > "$SRV/prewarm.log" 2>&1 &
# The GPU's clocks, power, heat and throttle reasons every second, so that a call tells a mode's cost from the
# machine's drift over the call (engines run one after another); the runner prints when each engine ended.
CLOCKS=""
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -l 1 > "$OUT/gpu-clocks.csv" 2> /dev/null & CLOCKS=$!
fi
END=$(( T0 + ${SRV_WALL_S:-540} - 30 ))  # leave time to write and return
rc=0
for item in ${MODES//,/ }; do
  mode=${item%%:*}; secs=${item#*:}; [ "$secs" = "$item" ] && secs=$(( END - SECONDS ))
  dry=""; [ "${mode%-dry}" != "$mode" ] && { mode=${mode%-dry}; dry=--dry-run; }  # e.g. cp2-dry: no engine
  [ "$secs" -gt $(( END - SECONDS )) ] && secs=$(( END - SECONDS ))
  echo "== $mode: $secs s"
  if [ "$mode" = pytest ]; then
    # -rs names a skip; a skip (or no test) is not a pass: the test fails when asked to run and unable to
    SGLANG_SERVER_TESTS=1 SGLANG_SERVER_MODES=smoke SGLANG_SERVER_OUT="$OUT/pytest" \
      SGLANG_SERVER_BUDGET_S=$(( secs - 60 )) timeout "$secs" \
      python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_sglang_server_gpu.py || rc=1
    continue
  fi
  python3 tools/sglang_server/main.py "$mode" --release "$RELEASE" --label "$LABEL" --out "$OUT" --work "$SRV/work" \
    --budget-s "$(( secs - 15 ))" $dry "$@" || rc=1
done
tail -2 "$SRV/prewarm.log" || true
if [ -n "$CLOCKS" ]; then kill "$CLOCKS" 2> /dev/null || true; fi
echo "== done in $((SECONDS - T0)) s (rc $rc)"
exit $rc
