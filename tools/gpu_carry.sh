#!/usr/bin/env bash
# Sourced by tools/gpu_bench.sh (steps grid and sglang) on an offline GPU machine: installs the carry in ./.devwhl
# (written by tools/sglang_carry.py) and this package, so its sglang.srt.plugins entry point is
# registered. Afterwards /tmp/site holds the carried wheels, /tmp/sglang-<X> each carried SGLang release
# and /tmp/standin-<X> an sgl_kernel stand-in for it; $RELEASES lists the releases, oldest first,
# $NEWEST the newest, and PYTHONPATH is set for the newest (override it per release as
# tools/bench.py releases does).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devwhl/*.whl \
  || { echo "carry install failed"; exit 1; }
RELEASES=$(ls .devwhl/sglang-*.tar.gz 2>/dev/null | sed 's#.*/sglang-\(.*\)\.tar\.gz#\1#' | sort -V)
for v in $RELEASES; do
  mkdir -p /tmp/sglang-$v && tar -xzf .devwhl/sglang-$v.tar.gz -C /tmp/sglang-$v
  python3 tests/release_kit.py standin "$v" /tmp/standin-$v > /dev/null
done
NEWEST=$(echo "$RELEASES" | tail -1)
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2
export PYTHONPATH=/tmp/sglang-$NEWEST:$PWD:/tmp/site
