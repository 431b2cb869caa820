#!/usr/bin/env bash
# GPU run for the resident method: build, its tests and the ordinary transfer
# tests (the copy loops are shared), then the interference benchmark beside a
# saturating matmul and a decode-like load. Each stage has a time limit, so a
# hang shows up as a timeout instead of eating the session. Logs go to $OUT.
# Usage: tools/gpu_resident.sh [quick|full]
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SGLANG_HICACHE_JIT_CACHE_DIR=${SGLANG_HICACHE_JIT_CACHE_DIR:-/tmp/hicache-cache}
if [ -d .devwhl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .devwhl/platformdirs*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
echo "== build"; timeout 120 python3 -m sglang_hicache_jit prewarm 2>&1 | tail -2 | tee "$OUT/prewarm.txt"
echo "== resident tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_resident_gpu.py -x 2>&1 | tee "$OUT/pytest-resident.txt" | tail -15
echo "== transfer tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_transfer_gpu.py 2>&1 | tee "$OUT/pytest-transfer.txt" | tail -4
B="timeout 150 python3 tools/bench_transfer.py --mode interference --workloads mla-bf16 --tokens 16384 --page-sizes 64 --priorities normal --gemm-seconds 0.2"
P="jit jit-q2 jit-q8 jit-resident-r2 jit-resident-r4 jit-resident-r8 jit-resident-r16"
echo "== interference, matmul"; $B --load matmul --providers $P --json "$OUT/interf-matmul.json" 2>&1 | tee "$OUT/interf-matmul.txt" | grep -v "^$"
if [ "${1:-quick}" = full ]; then
  echo "== interference, decode"; $B --load decode --providers $P --json "$OUT/interf-decode.json" 2>&1 | tee "$OUT/interf-decode.txt"
fi
