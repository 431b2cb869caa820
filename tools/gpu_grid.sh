#!/usr/bin/env bash
# GPU run of the same-run comparison with upstream SGLang's kernels on the full
# grid (5 workloads x one/all layers x both directions x page 64/1 x 1K-64K
# tokens) on an offline machine: installs the carry from ./.devwhl
# (tools/sglang_carry.py: sglang 0.5.23, apache-tvm-ffi and what their import needs), checks the
# upstream providers bit for bit, then runs the grid. Logs go to $OUT.
# Usage: tools/gpu_grid.sh [extra bench args...]
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SGLANG_HICACHE_JIT_CACHE_DIR=${SGLANG_HICACHE_JIT_CACHE_DIR:-/tmp/hicache-cache}
source tools/gpu_carry.sh
date -u | tee "$OUT/env.txt"
python3 -c 'import torch, sglang; print("torch", torch.__version__, torch.cuda.get_device_name(), "sglang", sglang.__version__)' \
  | tee -a "$OUT/env.txt"
echo "== upstream providers, bit for bit"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_bench_upstream_gpu.py 2>&1 | tee "$OUT/pytest-upstream.txt" | tail -4
echo "== grid"
timeout ${GRID_TIMEOUT:-420} python3 tools/bench_transfer.py --providers jit upstream upstream-reg upstream-tma \
  --json "$OUT/grid.json" "$@" > "$OUT/grid.txt" 2>&1
echo "grid rc=$?"; tail -60 "$OUT/grid.txt"
