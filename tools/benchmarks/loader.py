"""``loader`` and ``warm-ab``: the kernels' loader timed on the CPU (no GPU needed, the arch is named).

``loader``:

    cold build        wall of `prewarm --arch A` on an empty cache (one process; best of --cold-runs)
    cold breakdown    the same build in an instrumented process (best of --cold-runs by wall): interpreter
                      start, imports, ensure_built before the compiler, the compile child (each ninja step
                      from build.log, the child's own overhead), after the compiler (verify, publish);
                      then load_kernels(A) cold in a process that imported torch first
    8 cold starts     8 `prewarm --arch A` processes at once on an empty cache: total wall
    warm load         fresh process, after `import torch`: `import sglang_hicache_jit` through
                      `load_kernels(A)` (median and best of --runs), split into import and load_kernels;
                      also lists filelock / torch.utils.cpp_extension if the warm path imported them
    bundle import     wall of `import FILE` into an empty cache, then the first load in a fresh process
    prebuilt load     load_kernels(A) from a read-only prebuilt layer, empty user cache (median of --runs)

The package's bytecode is compiled first (as pip does at install): under PYTHONDONTWRITEBYTECODE a
checkout would otherwise compile every module from source in every process, which is not what an
installed package costs.

``warm-ab``: warm load of two installations, interleaved: which one loads faster from its own warm cache.
Each side is an interpreter (e.g. a venv's python with one wheel installed) and a cache directory it has
prewarmed (`sglang-hicache-jit prewarm --arch A` with SGLANG_HICACHE_JIT_CACHE_DIR set). Every round
starts one fresh process per side, in turn, and times what ``loader``'s warm load times. Taking the sides
in turn puts any drift of the machine on both alike, and the order flips every round (A B, B A, ...): on
the 2-core dev box the same installation timed 1 ms apart in medians by its place in the round alone.

    python3 tools/bench.py loader [--arch 9.0] [--runs 7] [--cold-runs 3] [--quick]
    python3 tools/bench.py warm-ab --side before=/tmp/venv-before/bin/python:/tmp/cache-before \\
                                   --side after=/tmp/venv-after/bin/python:/tmp/cache-after --rounds 21
"""

from __future__ import annotations

import compileall
import json
import re
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
# The warm load's budget, from `import sglang_hicache_jit` through load_kernels() after `import torch`, with
# numpy and with SGLang installed (the median of fresh processes). docs/BENCHMARKS.md and
# tests/test_warm_path.py state the same number; tests/test_docs.py checks that they do.
WARM_TARGET_MS = 4.5

LOAD = (
    "import json, sys, time, torch\n"
    "t0 = time.perf_counter()\n"
    "import sglang_hicache_jit\n"
    "from sglang_hicache_jit import load_kernels\n"
    "t1 = time.perf_counter(); lib = load_kernels({arch!r}); t2 = time.perf_counter()\n"
    "heavy = [m for m in ('filelock', 'torch.utils.cpp_extension') if m in sys.modules]\n"
    "print(json.dumps({{'seconds': t2 - t0, 'import': t1 - t0, 'load': t2 - t1, 'heavy': heavy,\n"
    "                  'path': str(lib.path)}}))\n"
)

# A cold build in one process, with the time stamps the breakdown needs. argv: start time (the bench's
# clock just before it spawned this process), arch, and 'load' to call load_kernels after import torch.
COLD = r"""
import json, sys, time
t_main = time.time()
if sys.argv[3] == "load":
    import torch
t_torch = time.time()
from sglang_hicache_jit.buildcache import build, loader
from sglang_hicache_jit.buildcache.arch import parse_arch_list
marks = {}
real = build.compile_entry
def timed(*args, **kwargs):
    marks["compile_start"] = time.time()
    try:
        return real(*args, **kwargs)
    finally:
        marks["compile_end"] = time.time()
build.compile_entry = loader.compile_entry = timed  # loader.compile_entry: before imports became lazy
t_imported = time.time()
if sys.argv[3] == "load":
    entry = loader.load_kernels(sys.argv[2]).entry
else:
    entry = loader.ensure_built(parse_arch_list(sys.argv[2])).entry
t_done = time.time()
print(json.dumps({"start": float(sys.argv[1]), "main": t_main, "torch": t_torch, "imported": t_imported,
                  "done": t_done, "log": str(entry.log), **marks}))
"""


def _env(cache: Path, **extra) -> dict:
    env = dict(os.environ, SGLANG_HICACHE_JIT_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    for name in ("SGLANG_HICACHE_JIT_ARCH", "SGLANG_HICACHE_JIT_PREBUILT_DIRS", "SGLANG_HICACHE_JIT_CACHE_MAX_SIZE"):
        env.pop(name, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _cli(args: list[str], env: dict) -> float:
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "sglang_hicache_jit", "-q", *args], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    wall = time.perf_counter() - started
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
    return wall


def _load(arch: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", LOAD.format(arch=arch)], env=env, cwd=ROOT, capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise SystemExit(f"load failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median_load(arch: str, env: dict, runs: int) -> tuple[float, list[float], str]:
    results = [_load(arch, env) for _ in range(runs)]
    times = [r["seconds"] for r in results]
    return statistics.median(times), times, results[-1]["path"]


# The compile child prints one line per ninja step ("step <output> <seconds> s") and the ninja wall.
_STEP = re.compile(r"^step (\S+) ([0-9.]+) s$", re.MULTILINE)
_NINJA = re.compile(r"^ninja ([0-9.]+) s$", re.MULTILINE)


def _cold(arch: str, cache: Path, mode: str) -> dict:
    """One instrumented cold build (mode 'build': ensure_built; 'load': load_kernels after import torch)."""
    started = time.time()
    out = subprocess.run([sys.executable, "-c", COLD, repr(started), arch, mode], env=_env(cache), cwd=ROOT,
                         capture_output=True, text=True)
    ended = time.time()
    if out.returncode != 0:
        raise SystemExit(f"cold {mode} failed:\n{out.stdout}\n{out.stderr}")
    m = json.loads(out.stdout.strip().splitlines()[-1])
    log = Path(m["log"]).read_text(errors="replace")
    ninja = _NINJA.search(log)
    child = m["compile_end"] - m["compile_start"]
    return {
        "wall": ended - started,
        "interpreter": m["main"] - m["start"],
        "import_torch": m["torch"] - m["main"],
        "imports": m["imported"] - m["torch"],
        "before_compiler": m["compile_start"] - m["imported"],
        "compile_child": child,
        "ninja": float(ninja.group(1)) if ninja else None,
        "steps": {name: float(seconds) for name, seconds in _STEP.findall(log)},
        "after_compiler": m["done"] - m["compile_end"],
        "exit": ended - m["done"],
    }


def _best_cold(arch: str, tmp: Path, mode: str, runs: int) -> dict:
    results = [_cold(arch, tmp / f"cold-{mode}-{i}", mode) for i in range(runs)]
    best = min(results, key=lambda r: r["wall"])
    best["all_walls"] = [round(r["wall"], 3) for r in results]
    return best


def _format_cold(c: dict) -> str:
    steps = ", ".join(f"{name} {seconds:.2f}" for name, seconds in c["steps"].items()) or "not in build.log"
    ninja = f"{c['ninja']:.2f}" if c["ninja"] is not None else "?"
    torch_part = f"import torch {c['import_torch']:.2f} + " if c["import_torch"] > 0.05 else ""
    return (f"{c['wall']:.2f} s = interpreter {c['interpreter']:.2f} + {torch_part}imports {c['imports']:.2f} + "
            f"before compiler {c['before_compiler']:.2f} + compile child {c['compile_child']:.2f} "
            f"(ninja {ninja}: {steps}) + after {c['after_compiler']:.2f} + exit {c['exit']:.2f}")


def loader(args, out) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="bench-loader-"))
    results: dict = {"arch": args.arch, "runs": args.runs, "machine": {
        "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}}
    compileall.compile_dir(str(ROOT / "sglang_hicache_jit"), quiet=1)
    try:
        walls = [_cli(["prewarm", "--arch", args.arch], _env(tmp / f"cold{i}")) for i in range(args.cold_runs)]
        cold = tmp / "cold0"
        results["cold_build_s"] = min(walls)
        results["cold_build_all_s"] = [round(w, 3) for w in walls]
        results["cold_breakdown"] = _best_cold(args.arch, tmp, "build", args.cold_runs)
        results["cold_load_breakdown"] = _best_cold(args.arch, tmp, "load", args.cold_runs)

        median, times, _ = _median_load(args.arch, _env(cold), args.runs)
        results["warm_load_ms"] = median * 1e3
        results["warm_load_best_ms"] = min(times) * 1e3
        results["warm_load_all_ms"] = [round(t * 1e3, 3) for t in times]
        split = [_load(args.arch, _env(cold)) for _ in range(args.runs)]
        results["warm_import_ms"] = statistics.median(r["import"] for r in split) * 1e3
        results["warm_load_kernels_ms"] = statistics.median(r["load"] for r in split) * 1e3
        results["warm_heavy_modules"] = sorted({m for r in split for m in r["heavy"]})
        if args.quick:
            return _report(args, results, out)

        many = tmp / "many"
        started = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-m", "sglang_hicache_jit", "-q", "prewarm", "--arch", args.arch,
                                   "--json"], env=_env(many), cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(args.concurrent)]
        outs = [p.communicate() for p in procs]
        results["concurrent_cold_s"] = time.perf_counter() - started
        if any(p.returncode for p in procs):
            raise SystemExit("a concurrent prewarm failed:\n" + "\n".join(err for _, err in outs))
        actions = [json.loads(out)["results"][0]["action"] for out, _ in outs]
        results["concurrent_builds"] = actions.count("built")

        bundle = tmp / "bundle.tar.gz"
        _cli(["export", "--arch", args.arch, "-o", str(bundle)], _env(cold))
        results["bundle_bytes"] = bundle.stat().st_size
        fresh = tmp / "fresh"
        results["bundle_import_s"] = _cli(["import", str(bundle)], _env(fresh))
        results["first_load_after_import_ms"] = _load(args.arch, _env(fresh))["seconds"] * 1e3
        results["import_plus_first_load_s"] = results["bundle_import_s"] + results["first_load_after_import_ms"] / 1e3

        layer = tmp / "layer"
        _cli(["import", str(bundle), "--into", str(layer)], _env(tmp / "unused"))
        for dirpath, _, files in os.walk(layer):
            for name in files:
                os.chmod(os.path.join(dirpath, name), 0o444)
            os.chmod(dirpath, 0o555)
        median, times, path = _median_load(args.arch, _env(tmp / "empty", SGLANG_HICACHE_JIT_PREBUILT_DIRS=layer),
                                           args.runs)
        assert path.startswith(str(layer)), path
        results["prebuilt_load_ms"] = median * 1e3
        results["prebuilt_load_all_ms"] = [round(t * 1e3, 3) for t in times]
    finally:
        for dirpath, _, _ in os.walk(tmp):
            os.chmod(dirpath, 0o755)
        shutil.rmtree(tmp, ignore_errors=True)
    return _report(args, results, out)


def _report(args, results: dict, out) -> int:
    results["load_average"] = os.getloadavg()
    rows = [
        ("cold build (prewarm, empty cache)", f"{results['cold_build_s']:.2f} s",
         f"best of {args.cold_runs} {results['cold_build_all_s']}; target < 6 s"),
        ("warm load, fresh process, after import torch", f"{results['warm_load_ms']:.2f} ms",
         f"median of {args.runs} (best {results['warm_load_best_ms']:.2f}): import "
         f"{results['warm_import_ms']:.2f} + load_kernels {results['warm_load_kernels_ms']:.2f}; target < {WARM_TARGET_MS} ms"),
        ("  heavy modules the warm path imported", ", ".join(results["warm_heavy_modules"]) or "none", ""),
    ]
    if "concurrent_cold_s" in results:
        rows += [
            (f"{args.concurrent} concurrent cold prewarms", f"{results['concurrent_cold_s']:.2f} s",
             f"{results['concurrent_builds']} compile(s); "
             f"{results['concurrent_cold_s'] / results['cold_build_s']:.2f}x one cold build"),
            ("bundle import (CLI process wall)", f"{results['bundle_import_s']:.3f} s",
             f"bundle {results['bundle_bytes'] / 1e3:.0f} kB"),
            ("first load after import", f"{results['first_load_after_import_ms']:.2f} ms", ""),
            ("import + first load", f"{results['import_plus_first_load_s']:.3f} s", "target < 0.5 s"),
            ("warm load from a read-only prebuilt layer", f"{results['prebuilt_load_ms']:.2f} ms",
             f"median of {args.runs}; target < {WARM_TARGET_MS} ms"),
        ]
    width = max(len(r[0]) for r in rows)
    print(f"loader, arch {args.arch}, {os.cpu_count()} CPUs, load average {results['load_average'][0]:.2f}")
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:>10}  {note}")
    print(f"  cold build breakdown (best of {args.cold_runs}): {_format_cold(results['cold_breakdown'])}")
    print(f"  cold load_kernels breakdown (best of {args.cold_runs}): {_format_cold(results['cold_load_breakdown'])}")
    out.row(**results)
    return 0


def _side(text: str) -> tuple[str, str, str]:
    name, _, rest = text.partition("=")
    python, _, cache = rest.rpartition(":")
    if not (name and python and cache):
        raise ValueError(f"expected NAME=PYTHON:CACHE_DIR, got {text!r}")
    return name, python, cache


def load_once(python: str, cache: str, arch: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    env["SGLANG_HICACHE_JIT_CACHE_DIR"] = cache
    # From an empty directory, so no checkout on the path shadows the installed package.
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run([python, "-c", LOAD.format(arch=arch)], env=env, cwd=cwd, capture_output=True,
                             text=True, timeout=300)
    if out.returncode:
        raise SystemExit(f"{python} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def warm_ab(args, out) -> int:
    samples = {name: [] for name, _, _ in args.side}
    for name, python, cache in args.side:  # one unmeasured load each: the page cache warm for both
        load_once(python, cache, args.arch)
    for round_ in range(args.rounds):
        for name, python, cache in (args.side if round_ % 2 == 0 else args.side[::-1]):
            result = load_once(python, cache, args.arch)
            if result["heavy"]:
                raise SystemExit(f"{name}: the warm path imported {result['heavy']}")
            samples[name].append(result)
    print(f"warm load, {args.rounds} interleaved rounds, arch {args.arch} (ms: median / best)")
    summary = {}
    for name, runs in samples.items():
        row = {part: (statistics.median(r[part] for r in runs) * 1e3, min(r[part] for r in runs) * 1e3)
               for part in ("seconds", "import", "load")}
        summary[name] = row
        out.row(side=name, rounds=args.rounds, arch=args.arch,
                **{f"{part}_ms_{stat}": row[part][i] for part in row for i, stat in enumerate(("median", "best"))},
                samples=runs)
        print(f"  {name:<10} total {row['seconds'][0]:6.2f} / {row['seconds'][1]:6.2f}   import "
              f"{row['import'][0]:6.2f} / {row['import'][1]:6.2f}   load_kernels {row['load'][0]:6.2f} / "
              f"{row['load'][1]:6.2f}")
    return 0


def add_arguments(p, name: str) -> None:
    p.add_argument("--arch", default="9.0")
    if name == "loader":
        p.add_argument("--runs", type=int, default=7, help="fresh processes per load measurement")
        p.add_argument("--cold-runs", type=int, default=3, help="cold builds per cold measurement (best is kept)")
        p.add_argument("--concurrent", type=int, default=8)
        p.add_argument("--quick", action="store_true", help="cold build, breakdown and warm load only")
    else:
        p.add_argument("--side", action="append", type=_side, required=True, help="NAME=PYTHON:CACHE_DIR (twice)")
        p.add_argument("--rounds", type=int, default=21)


def run(args, out, name: str) -> int:
    return loader(args, out) if name == "loader" else warm_ab(args, out)
