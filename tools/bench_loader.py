#!/usr/bin/env python3
"""Loader timings (issues 2 and 5), on CPU: no GPU needed, the arch is named.

    cold build        wall of `prewarm --arch A` on an empty cache (one process)
    8 cold starts     8 `prewarm --arch A` processes at once on an empty cache: total wall
    warm load         load_kernels(A) in a fresh process after `import torch` (median of --runs)
    bundle import     wall of `import FILE` into an empty cache, then the first load in a fresh process
    prebuilt load     load_kernels(A) from a read-only prebuilt layer, empty user cache (median of --runs)

Usage: python tools/bench_loader.py [--arch 9.0] [--runs 7] [--json-out loader.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LOAD = (
    "import json, time, torch\n"
    "from sglang_hicache_jit.loader import load_kernels\n"
    "t = time.perf_counter(); lib = load_kernels({arch!r}); dt = time.perf_counter() - t\n"
    "print(json.dumps({{'seconds': dt, 'path': str(lib.path)}}))\n"
)


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="9.0")
    parser.add_argument("--runs", type=int, default=7, help="fresh processes per load measurement")
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--json-out", help="write the results here as JSON")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-loader-"))
    results: dict = {"arch": args.arch, "runs": args.runs, "machine": {
        "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}}
    try:
        cold = tmp / "cold"
        results["cold_build_s"] = _cli(["prewarm", "--arch", args.arch], _env(cold))

        many = tmp / "many"
        started = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-m", "sglang_hicache_jit", "-q", "prewarm", "--arch", args.arch,
                                   "--json"], env=_env(many), cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(args.concurrent)]
        outs = [p.communicate() for p in procs]
        results["concurrent_cold_s"] = time.perf_counter() - started
        if any(p.returncode for p in procs):
            raise SystemExit("a concurrent prewarm failed:\n" + "\n".join(err for _, err in outs))
        actions = [json.loads(out)[0]["action"] for out, _ in outs]
        results["concurrent_builds"] = actions.count("built")

        median, times, _ = _median_load(args.arch, _env(cold), args.runs)
        results["warm_load_ms"] = median * 1e3
        results["warm_load_all_ms"] = [round(t * 1e3, 3) for t in times]

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

    rows = [
        ("cold build (prewarm, empty cache)", f"{results['cold_build_s']:.2f} s", ""),
        (f"{args.concurrent} concurrent cold prewarms", f"{results['concurrent_cold_s']:.2f} s",
         f"{results['concurrent_builds']} compile(s); {results['concurrent_cold_s'] / results['cold_build_s']:.2f}x "
         "one cold build"),
        ("warm load, fresh process, after import torch", f"{results['warm_load_ms']:.2f} ms",
         f"median of {args.runs}; target < 5 ms"),
        ("bundle import (CLI process wall)", f"{results['bundle_import_s']:.3f} s",
         f"bundle {results['bundle_bytes'] / 1e3:.0f} kB"),
        ("first load after import", f"{results['first_load_after_import_ms']:.2f} ms", ""),
        ("import + first load", f"{results['import_plus_first_load_s']:.3f} s", "target < 0.5 s"),
        ("warm load from a read-only prebuilt layer", f"{results['prebuilt_load_ms']:.2f} ms",
         f"median of {args.runs}; target < 5 ms"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"loader, arch {args.arch}, {os.cpu_count()} CPUs")
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:>10}  {note}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
