#!/usr/bin/env python3
"""Warm load of two installations, interleaved: which one loads faster from its own warm cache.

Each side is an interpreter (e.g. a venv's python with one wheel installed) and a cache directory it
has prewarmed (`sglang-hicache-jit prewarm --arch A` with SGLANG_HICACHE_JIT_CACHE_DIR set). Every
round starts one fresh process per side, in turn, and times what tools/bench_loader.py's warm mode
times: after `import torch`, `import sglang_hicache_jit` through `load_kernels(A)`. Taking the sides
in turn puts any drift of the machine on both alike, and the order flips every round (A B, B A, ...):
on the 2-core dev box the same installation timed 1 ms apart in medians by its place in the round
alone. The medians are compared.

Usage:
    python tools/bench_warm_ab.py --side before=/tmp/venv-before/bin/python:/tmp/cache-before \\
                                  --side after=/tmp/venv-after/bin/python:/tmp/cache-after --rounds 21
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loader import LOAD  # noqa: E402  (the same measured snippet as bench_loader's warm load)


def _side(text: str) -> tuple[str, str, str]:
    name, _, rest = text.partition("=")
    python, _, cache = rest.rpartition(":")
    if not (name and python and cache):
        raise argparse.ArgumentTypeError(f"expected NAME=PYTHON:CACHE_DIR, got {text!r}")
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", action="append", type=_side, required=True, help="NAME=PYTHON:CACHE_DIR (twice)")
    parser.add_argument("--arch", default="9.0")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--json-out", help="write every sample here as JSON")
    args = parser.parse_args()
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
        print(f"  {name:<10} total {row['seconds'][0]:6.2f} / {row['seconds'][1]:6.2f}   import "
              f"{row['import'][0]:6.2f} / {row['import'][1]:6.2f}   load_kernels {row['load'][0]:6.2f} / "
              f"{row['load'][1]:6.2f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"samples": samples, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
