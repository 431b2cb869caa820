#!/usr/bin/env bash
# One batch of GPU work from a checkout: environment facts, a cold build, the
# GPU tests and a benchmark, with everything written under $OUT (default
# ./gpu-out). Usage: tools/gpu_session.sh [bench args...]
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export SGLANG_HICACHE_JIT_CACHE_DIR=${SGLANG_HICACHE_JIT_CACHE_DIR:-/tmp/hicache-cache}
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'
  nvcc --version | tail -2
} 2>&1 | tee "$OUT/env.txt"
echo "== cold build"; /usr/bin/time -f "prewarm wall %e s" python3 -m sglang_hicache_jit prewarm 2>&1 | tee "$OUT/prewarm.txt"
echo "== check"; python3 -m sglang_hicache_jit check 2>&1 | tee -a "$OUT/prewarm.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== GPU tests"; python3 -m pytest -q -m gpu tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest-gpu.txt" | tail -25
fi
if [ "$#" -gt 0 ]; then
  echo "== bench"; python3 tools/bench_transfer.py --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.txt"
fi
