#!/usr/bin/env python3
"""Times the README's test command from a clean state and checks that it leaves the checkout clean.

The tracked and untracked-but-not-ignored files of this checkout are copied
into a temporary directory (so no build output, cache or bytecode of earlier
runs is there), `python3 -m pytest -q` runs in the copy (PYTHONPATH pointing
at it, so the copy's package is the one tested), and the tool reports:

    * the wall time, against a budget (default 180 s, the README's promise
      for a 2-core machine without a GPU);
    * any file the run left in the copy (``__pycache__`` aside, which every
      Python import writes).

Exit status: pytest's own when it failed (5: no tests collected), else 1 when
over budget or when files were left behind, else 0.

Usage: python3 tools/time_tests.py [--budget SECONDS] [--keep] [-- extra pytest arguments]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_COMMAND = [sys.executable, "-m", "pytest", "-q"]


_JUNK = {".git", "build", "dist", "__pycache__", ".hypothesis", ".pytest_cache", ".venv", ".whl"}


def checkout_files(root: Path) -> list[str]:
    """Tracked files plus untracked ones git does not ignore (a work in progress is timed as it is);
    outside git (an unpacked sdist) every file but build output and caches."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, check=True).stdout
        names = listed.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        names = []
        for dirpath, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in _JUNK and not d.endswith(".egg-info")]
            names += [str((Path(dirpath) / f).relative_to(root)) for f in files]
    return [name for name in names if name and (root / name).is_file()]


def tree(root: Path) -> set[str]:
    found = set()
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found.update(str((Path(dirpath) / f).relative_to(root)) for f in files)
        found.update(str((Path(dirpath) / d).relative_to(root)) + "/" for d in dirs)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=float(os.environ.get("HICACHE_TEST_BUDGET_S", 180)),
                        help="seconds the run may take (default 180, or $HICACHE_TEST_BUDGET_S)")
    parser.add_argument("--keep", action="store_true", help="keep the copy (its path is printed)")
    parser.add_argument("pytest_args", nargs="*", help="appended to the README command (after --)")
    args = parser.parse_args()

    copy = Path(tempfile.mkdtemp(prefix="hicache-time-tests-"))
    os.chmod(copy, 0o755)  # as readable as a checkout: some tests run the package as another user
    try:
        for name in checkout_files(ROOT):
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
        before = tree(copy)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(copy), os.environ.get("PYTHONPATH")])))
        command = README_COMMAND + args.pytest_args
        print(f"time_tests: running `{' '.join(['python3'] + command[1:])}` in a clean copy at {copy}", flush=True)
        load_before = os.getloadavg()[0]
        started = time.monotonic()
        code = subprocess.run(command, cwd=copy, env=env).returncode
        seconds = time.monotonic() - started
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        left = sorted(tree(copy) - before)
        verdict = "within" if seconds <= args.budget else "OVER"
        # Other work on the machine stretches the wall time; the CPU time and the load say how much.
        print(f"time_tests: README test command took {seconds:.1f} s wall ({verdict} the {args.budget:.0f} s budget), "
              f"{usage.ru_utime + usage.ru_stime:.0f} s CPU, on {os.cpu_count()} CPUs with a load average of "
              f"{load_before:.1f} before and {os.getloadavg()[0]:.1f} after; pytest exit {code}")
        if left:
            print("time_tests: the run left files in the checkout: " + ", ".join(left[:20]))
        if args.keep:
            print(f"time_tests: copy kept at {copy}")
        if code != 0:
            return code
        return 1 if seconds > args.budget or left else 0
    finally:
        if not args.keep:
            shutil.rmtree(copy, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
