#!/usr/bin/env bash
# GPU run of the SGLang integration on an offline machine, for every release in the carry
# (./.devwhl, written by tools/sglang_carry.py; tools/gpu_carry.sh installs it and this
# package), builds the kernels, then for each
# release runs SGLang's own pools through the plugin (tests/sglang_cells.py transfer) with the
# JIT kernel and with SGLANG_HICACHE_JIT_DISABLE=1, four releases at a time, against an
# sgl_kernel stand-in with the signatures of the sglang-kernel that release pins.
# Then, with the newest release in the carry: the SGLang integration and routed-op GPU tests
# (SKIP_CELLS=1 skips these and the cells), and unless SKIP_BENCH=1 the host time per pool call through the plugin and unpatched
# (tools/bench_pool_calls.py) for the releases in BENCH_RELEASES (default: 0.5.19 and the newest).
# Logs and JSON go to $LOGS, then into $OUT/sglang-gpu-logs.tar.gz (a device call returns 8 files at most).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; LOGS=${LOGS:-/tmp/gpu-logs}; mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 SGLANG_HICACHE_JIT_CACHE_DIR=${SGLANG_HICACHE_JIT_CACHE_DIR:-/tmp/hicache-cache}
source tools/gpu_carry.sh
{ date -u; python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'; } | tee "$LOGS/env.txt"
python3 -m sglang_hicache_jit prewarm 2>&1 | tail -1
cells() {  # release, disable
  PYTHONPATH=/tmp/standin-$1:/tmp/sglang-$1:$PWD:/tmp/site SGLANG_HICACHE_JIT_DISABLE=$2 \
    timeout 300 python3 tests/sglang_cells.py transfer > "$LOGS/cells-$1-$2.jsonl" 2> "$LOGS/cells-$1-$2.err"
  echo "sglang $1 DISABLE=$2 rc=$?: $(tail -1 "$LOGS/cells-$1-$2.jsonl")"
}
export -f cells; export LOGS
if [ -z "${SKIP_CELLS:-}" ]; then
  echo "== SGLang's pools, every layout and operation, per release"
  for v in $RELEASES; do for d in 0 1; do echo "$v $d"; done; done | xargs -P 4 -n 2 bash -c 'cells "$0" "$1"' | sort -V
  echo "== integration and routed-op GPU tests (sglang $NEWEST)"
  SGLANG_HICACHE_JIT_REQUIRE_SGLANG=1 timeout 240 python3 -m pytest -q \
    -p no:cacheprovider tests/test_sglang_integration.py tests/test_routed_ops_gpu.py ${PYTEST_ARGS:-} 2>&1 \
    | tee "$LOGS/pytest-sglang.txt" | tail -3
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  echo "== host time per pool call, through the plugin and unpatched"
  for v in ${BENCH_RELEASES:-0.5.19 $NEWEST}; do
    for label in plugin unpatched; do
      switch=$([ $label = plugin ] && echo 1 || echo 0)
      PYTHONPATH=/tmp/standin-$v:/tmp/sglang-$v:$PWD:/tmp/site SGLANG_HICACHE_JIT_SGLANG_PLUGIN=$switch \
        timeout ${BENCH_TIMEOUT:-240} python3 tools/bench_pool_calls.py --label $label 2> "$LOGS/bench-$v-$label.err" \
        | tee -a "$LOGS/bench-pool-calls.jsonl"
    done
  done
fi
tar -czf "$OUT/sglang-gpu-logs.tar.gz" -C "$LOGS" .
