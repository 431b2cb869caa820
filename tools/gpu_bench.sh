#!/usr/bin/env bash
# One device call: the GPU tests, then benchmarks of tools/bench.py, each step time-boxed so that a slow
# step cannot eat the call; results under $OUT (default ./gpu-out), at most 8 files for the default steps.
#
#   bash tools/gpu_bench.sh                       # STEPS="build tests layouts cta", within BUDGET=570 s
#   STEPS="build layouts" BUDGET=480 bash tools/gpu_bench.sh
#   DRY=1 bash tools/gpu_bench.sh                 # print the commands only (tests/test_bench_harness.py)
#
# Steps (in this order, those named in STEPS):
#   build     prewarm the kernels into the benchmarks' cache (the tests build their own)  -> build.txt
#   soak      tools/soak_direct.py, two threads, every row size SGLang uses, in the background while the
#             tests run (T_SOAK seconds, default 300)                                     -> soak.{json,txt}
#   tests     python3 -m pytest -q -m gpu tests                                          -> pytest-gpu.txt
#   layouts   tools/bench.py layouts (loads and backups, every layout and io_backend)     -> layouts.{jsonl,txt}
#   cta       tools/bench.py cta (the kernel's CTA budget beside the matmul)              -> cta.{jsonl,txt}
#   layered   tools/bench.py layered, alone, beside decode steps and beside matmuls (a host hit's per-layer
#             loads under a forward pass that waits for each layer; with upstream's kernel where SGLang
#             imports, and the staged group loads)
#                                                                                       -> layered.{jsonl,txt}
#   grid      tools/bench.py grid against upstream SGLang's kernels (needs the carry)     -> grid.{jsonl,txt}
#   sglang    every carried SGLang release's cells, the integration tests, host time per pool call
#             (needs the carry: tools/gpu_carry.sh)                                       -> sglang-logs.tar.gz
# Each step's time box is T_<STEP> seconds (T_TESTS, T_LAYOUTS, ...), cut to what BUDGET leaves after
# the steps still to come have their minimum. The last lines printed are the tables of every result file.
# A platformdirs wheel (or any other) in ./.whl is installed to /tmp/site first when it is missing here.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
STEPS=${STEPS:-build tests layouts cta}
BUDGET=${BUDGET:-570}
T_BUILD=${T_BUILD:-150} T_TESTS=${T_TESTS:-230} T_LAYOUTS=${T_LAYOUTS:-260} T_CTA=${T_CTA:-100}
T_GRID=${T_GRID:-300} T_SGLANG=${T_SGLANG:-400} T_SOAK=${T_SOAK:-300} T_LAYERED=${T_LAYERED:-180}
MIN_LAYOUTS=120 MIN_CTA=60  # what a later step needs at least; earlier steps leave it
DRY=${DRY:-}
export PYTHONUNBUFFERED=1 SGLANG_HICACHE_JIT_CACHE_DIR=${SGLANG_HICACHE_JIT_CACHE_DIR:-/tmp/hicache-cache}
[ -z "$DRY" ] && mkdir -p "$OUT"
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
# box CAP: the time box for a step: CAP, or less where BUDGET must still hold the later steps' minimum.
box() {
  local reserve=5
  for later in "${@:2}"; do has "$later" && reserve=$((reserve + $(eval echo \$MIN_${later^^}))); done
  local left=$((BUDGET - SECONDS - reserve))
  echo $(( $1 < left ? $1 : (left > 10 ? left : 10) ))
}
run() {  # name, seconds, log file, command...: prints the command (DRY) or runs it under timeout into the log
  local name=$1 seconds=$2 log=$3; shift 3
  echo "== $name (${seconds} s box, ${SECONDS} s so far)"
  if [ -n "$DRY" ]; then echo "$*"; return 0; fi
  timeout --signal=TERM --kill-after=15 "$seconds" "$@" > "$log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "$name: stopped by its time box (${seconds} s)"
  echo "$name rc=$rc: $(tail -1 "$log")"
}

if [ -z "$DRY" ]; then
  if [ -d .whl ] && ! python3 -c 'import platformdirs' 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  {
    date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
    python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'
    nvcc --version | tail -2; git log --oneline -1 2>/dev/null; echo "STEPS=$STEPS BUDGET=$BUDGET"
  } > "$OUT/env.txt" 2>&1
  head -3 "$OUT/env.txt"
fi

if has build; then
  run build "$(box "$T_BUILD" layouts cta)" "$OUT/build.txt" python3 -m sglang_hicache_jit prewarm
fi
soak_pid=""
if has soak; then
  echo "== soak (${T_SOAK} s, in the background, ${SECONDS} s so far)"
  if [ -n "$DRY" ]; then
    echo "python3 tools/soak_direct.py --seconds $T_SOAK --threads 2 --out $OUT/soak.json"
  else
    timeout --signal=TERM --kill-after=30 $((T_SOAK + 60)) python3 tools/soak_direct.py --seconds "$T_SOAK" \
      --threads 2 --out "$OUT/soak.json" > "$OUT/soak.txt" 2>&1 &
    soak_pid=$!
  fi
fi
if has tests; then
  run tests "$(box "$T_TESTS" layouts cta)" "$OUT/pytest-gpu.txt" python3 -m pytest -q -m gpu -p no:cacheprovider tests
  [ -z "$DRY" ] && grep -E "^(FAILED|ERROR)" "$OUT/pytest-gpu.txt" | head -20
fi
if [ -n "$soak_pid" ]; then
  wait "$soak_pid"
  echo "soak rc=$?: $(tail -1 "$OUT/soak.txt")"
fi
if has layouts; then
  t=$(box "$T_LAYOUTS" cta)
  run layouts "$t" "$OUT/layouts.txt" python3 tools/bench.py layouts --budget-s $((t > 80 ? t - 40 : 40)) \
    --out "$OUT/layouts.jsonl"
fi
if has cta; then
  t=$(box "$T_CTA")
  run cta "$t" "$OUT/cta.txt" python3 tools/bench.py cta --budget-s $((t > 40 ? t - 20 : 20)) --out "$OUT/cta.jsonl"
fi
if has layered; then
  for beside in none decode matmul; do
    run "layered, beside $beside" "$(box $((T_LAYERED / 3)))" "$OUT/layered-$beside.txt" python3 tools/bench.py layered \
      --beside "$beside" --reps 11 --out "$OUT/layered.jsonl"
  done
fi
if has grid; then
  [ -z "$DRY" ] && [ -d .devwhl ] && source tools/gpu_carry.sh
  run grid "$(box "$T_GRID")" "$OUT/grid.txt" python3 tools/bench.py grid -q --providers jit upstream upstream-reg \
    upstream-tma --out "$OUT/grid.jsonl"
fi
if has sglang; then
  # tools/gpu_carry.sh installs the carry (./.devwhl) and this package, and sets RELEASES and NEWEST.
  LOGS=/tmp/gpu-logs
  if [ -z "$DRY" ]; then mkdir -p "$LOGS"; source tools/gpu_carry.sh; else NEWEST=X; fi
  t=$(box "$T_SGLANG")
  run releases "$t" "$LOGS/releases.txt" python3 tools/bench.py releases --logs "$LOGS" --out "$LOGS/releases.jsonl"
  [ -z "$DRY" ] && grep "^sglang" "$LOGS/releases.txt"
  run sglang-tests 240 "$LOGS/pytest-sglang.txt" env SGLANG_HICACHE_JIT_REQUIRE_SGLANG=1 python3 -m pytest -q \
    -p no:cacheprovider tests/test_sglang_integration.py tests/test_routed_ops_gpu.py
  for v in ${BENCH_RELEASES:-0.5.19 $NEWEST}; do
    for label in plugin unpatched; do
      switch=$([ $label = plugin ] && echo 1 || echo 0)
      run "sglang-pool $v $label" 240 "$LOGS/sglang-pool-$v-$label.txt" env PYTHONPATH=/tmp/standin-$v:/tmp/sglang-$v:$PWD:/tmp/site \
        SGLANG_HICACHE_JIT_SGLANG_PLUGIN=$switch python3 tools/bench.py sglang-pool --label $label \
        --out "$LOGS/sglang-pool.jsonl"
    done
  done
  [ -z "$DRY" ] && tar -czf "$OUT/sglang-logs.tar.gz" -C "$LOGS" .
fi

echo "== tables (${SECONDS} s)"
if [ -z "$DRY" ]; then
  for f in "$OUT"/layouts.jsonl "$OUT"/cta.jsonl "$OUT"/grid.jsonl; do
    [ -s "$f" ] && python3 tools/bench.py report "$f" | grep -v '^{'
  done
fi
