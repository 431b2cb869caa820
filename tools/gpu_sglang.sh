#!/usr/bin/env bash
# GPU run of the SGLang integration on an offline machine: installs the carried
# wheels (sglang 0.5.23 and the modules its pool_host import chain needs, in
# ./.devwhl), installs this package so its sglang.srt.plugins entry point is
# registered, then runs the integration and routed-op GPU tests, then (unless
# SKIP_SUITE=1) the whole GPU suite. Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SGLANG_HICACHE_JIT_CACHE_DIR=${SGLANG_HICACHE_JIT_CACHE_DIR:-/tmp/hicache-cache}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devwhl/*.whl \
  || { echo "carry install failed"; exit 1; }
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())' | tee "$OUT/env.txt"
python3 -c 'from importlib.metadata import entry_points as e; print(e(group="sglang.srt.plugins"))' | tee -a "$OUT/env.txt"
echo "== integration + routed ops"
SGLANG_HICACHE_JIT_REQUIRE_SGLANG=1 python3 -m pytest -q -p no:cacheprovider tests/test_sglang_integration.py \
  tests/test_routed_ops_gpu.py tests/test_compat.py ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest-sglang.txt" | tail -30
for d in 0 1; do
  SGLANG_HICACHE_JIT_DISABLE=$d PYTHONPATH=tests/sglang_stubs:$PYTHONPATH python3 tests/sglang_cells.py transfer \
    > "$OUT/cells-disable$d.jsonl" 2> "$OUT/cells-disable$d.err"
  echo "cells DISABLE=$d rc=$?: $(tail -1 "$OUT/cells-disable$d.jsonl")"
done
if [ -z "${SKIP_SUITE:-}" ]; then
  echo "== GPU suite"; python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest-gpu.txt" | tail -15
fi
