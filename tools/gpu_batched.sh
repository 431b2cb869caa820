#!/usr/bin/env bash
# The batched copy engines against the kernel and the older submissions, one device call (issue 19):
# SGLang's page_first_direct layout (a 64-token page of one layer is one contiguous 72 KiB run at
# 1152-B rows), one layer per call, each direction, alone (page 64 and 16, 1K-64K tokens) and beside
# back-to-back bf16 8192^3 matmuls and decode-like steps (16K tokens, page 64), the contiguous copy
# (ceiling) measured in the same run. Needs the package importable (PYTHONPATH or installed).
# Records go to $OUT/batched-*.json (with TAG: batched-$TAG-*.json). Usage: tools/gpu_batched.sh [providers...]
# LOADS picks the loads to run beside (default: matmul decode).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
P=${*:-"jit jit-q2 jit-resident direct direct-batch3d direct-2d"}
T=${TAG:+$TAG-}
B="python3 -m sglang_hicache_jit bench --host-layout page_first_direct --workloads mla-bf16 --host-slots 262144 -q"
echo "== alone"
timeout 240 $B --scopes one --page-sizes ${PAGES:-64 16} --tokens 1024 4096 16384 65536 --providers $P \
  --json "$OUT/batched-${T}alone.json" 2>&1 | tail -3
python3 - "$OUT/batched-${T}alone.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
rows = rows["records"] if isinstance(rows, dict) else rows
for r in rows:
    print(f"{r['direction']} p{r['page_size']:<3} {r['tokens']:>6} {r['provider']:<16} {r['gbps']:6.1f} GB/s  x{r['ratio'] or 0:.2f}")
PY
for load in ${LOADS:-matmul decode}; do
  echo "== beside $load"
  timeout 200 $B --mode interference --load $load --priorities normal --tokens 16384 --page-sizes 64 \
    --gemm-seconds 0.2 --providers $P --json "$OUT/batched-${T}$load.json" 2>&1 | grep -v "^$" | tail -20
done
