#!/usr/bin/env bash
# The GPU check after a kernel change, as one device call on an offline
# machine: installs the carry (./.devwhl from tools/sglang_carry.py, holding at
# least sglang 0.5.23: the newest release in it is used) and this package (for
# its sglang.srt.plugins entry point), builds, runs the SGLang integration,
# SGLang's own pools through the plugin, the GPU suite, upstream's providers bit
# for bit, then the same-run grid against upstream and the host cost per call
# with what time is left. Logs and JSON go to $OUT.
# Usage: tools/gpu_check.sh [seconds, default 560]
set -uo pipefail
BUDGET=${1:-560}
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SGLANG_HICACHE_JIT_CACHE_DIR=${SGLANG_HICACHE_JIT_CACHE_DIR:-/tmp/hicache-cache}
source tools/gpu_carry.sh
{ date -u; python3 -c 'import torch, sglang; print("torch", torch.__version__, torch.cuda.get_device_name(), "sglang", sglang.__version__)'; } \
  | tee "$OUT/env.txt"
echo "== build"; python3 -m sglang_hicache_jit prewarm 2>&1 | tail -1; python3 -m sglang_hicache_jit check 2>&1 | tail -1
echo "== SGLang integration and routed ops"
SGLANG_HICACHE_JIT_REQUIRE_SGLANG=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_sglang_integration.py \
  tests/test_routed_ops_gpu.py tests/test_compat.py 2>&1 | tee "$OUT/pytest-sglang.txt" | tail -2
echo "== SGLang's pools, every layout and operation"
PYTHONPATH=/tmp/standin-$NEWEST:$PYTHONPATH timeout 90 python3 tests/sglang_cells.py transfer > "$OUT/cells.jsonl" 2> "$OUT/cells.err"
echo "cells rc=$?: $(tail -1 "$OUT/cells.jsonl")"
echo "== GPU suite"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest-gpu.txt" | tail -3
left=$((BUDGET - SECONDS - 40))
echo "== grid against upstream (${left} s)"
timeout $left python3 tools/bench_transfer.py --providers jit upstream upstream-reg upstream-tma --json "$OUT/grid.json" \
  > "$OUT/grid.txt" 2>&1
echo "grid rc=$?"; grep -c "" "$OUT/grid.txt"
echo "== host cost per call"; timeout 35 python3 tools/bench_transfer.py --mode overhead 2>&1 | tee "$OUT/overhead.txt" | tail -11
