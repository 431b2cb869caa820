#!/usr/bin/env bash
# GPU run for transfers under compute (the figures in docs/BENCHMARKS.md, "Transfers beside compute"):
# every approach on one workload (mla-bf16, one layer, 16K tokens, page 64) beside back-to-back
# saturating bf16 matmuls and beside decode-like steps, then what resident CTAs cost the compute
# (tools/bench_residency.py). Needs the carry in ./.devwhl (tools/sglang_carry.py) for the upstream providers.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SGLANG_HICACHE_JIT_CACHE_DIR=${SGLANG_HICACHE_JIT_CACHE_DIR:-/tmp/hicache-cache}
if [ -d .devwhl ]; then source tools/gpu_carry.sh; else export PYTHONPATH=$PWD; fi
B="timeout 200 python3 tools/bench_transfer.py --mode interference --workloads mla-bf16 --tokens 16384 --page-sizes 64 --gemm-seconds 0.2"
P="jit jit-q2 jit-resident-r2 jit-resident-r4 jit-resident-r8 jit-resident-bulk-r4 jit-resident-bulk-r8 direct upstream-reg upstream-tma"
echo "== matmul"; $B --load matmul --priorities normal --providers $P --json "$OUT/interf-matmul.json" 2>&1 | grep -v "^$" | tee "$OUT/interf-matmul.txt"
echo "== matmul, high-priority side stream"; $B --load matmul --priorities high --providers jit jit-q2 upstream-reg --json "$OUT/interf-priority.json" 2>&1 | grep -v "^$" | tee "$OUT/interf-priority.txt"
echo "== decode"; $B --load decode --priorities normal --providers $P --json "$OUT/interf-decode.json" 2>&1 | grep -v "^$" | tee "$OUT/interf-decode.txt"
echo "== residency"; timeout 200 python3 tools/bench_residency.py --blocks 1 2 4 8 --json "$OUT/residency.json" 2>&1 | grep -v "^$" | tee "$OUT/residency.txt"
