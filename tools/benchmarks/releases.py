"""``releases``: SGLang's own pools through the plugin, every layout and operation, for every carried release.

For each release (an unpacked tree at ``TREES/sglang-X`` and an sgl_kernel stand-in with the signatures of
the sglang-kernel it pins at ``TREES/standin-X``, as tools/gpu_carry.sh lays them out from the carry that
tools/sglang_carry.py writes), tests/sglang_cells.py runs in a fresh process with the JIT kernel and with
SGLANG_HICACHE_JIT_DISABLE=1, several at a time. One row per release and switch: the exit status, the
cells' summary and the cells that failed; each process's output goes to ``--logs``.

    source tools/gpu_carry.sh && python3 tools/bench.py releases --out $OUT/releases.jsonl
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def _version_key(version: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"[.]|(?<=\d)(?=post)", version)]


def add_arguments(p, name: str) -> None:
    p.add_argument("--releases", nargs="*", help="default: $RELEASES, else every TREES/sglang-X")
    p.add_argument("--trees", default="/tmp", help="where sglang-X and standin-X are (tools/gpu_carry.sh: /tmp)")
    p.add_argument("--site", default="/tmp/site", help="the carried wheels, installed (tools/gpu_carry.sh)")
    p.add_argument("--mode", choices=("transfer", "construct"), default="transfer",
                   help="transfer: move and check every cell (GPU); construct: build every pool only (CPU)")
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--timeout", type=int, default=300, help="seconds per process")
    p.add_argument("--logs", default="/tmp/gpu-logs")
    p.add_argument("--cells", default=str(ROOT / "tests" / "sglang_cells.py"), help=argparse_hide())


def argparse_hide():
    import argparse

    return argparse.SUPPRESS


def releases(args) -> list[str]:
    if args.releases:
        return args.releases
    if os.environ.get("RELEASES", "").split():
        return os.environ["RELEASES"].split()
    found = [p.name[len("sglang-"):] for p in Path(args.trees).glob("sglang-*") if p.is_dir()]
    return sorted(found, key=_version_key)


def one(args, release: str, disable: int) -> dict:
    trees = Path(args.trees)
    path = [str(trees / f"standin-{release}"), str(trees / f"sglang-{release}"), str(ROOT), args.site]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), SGLANG_HICACHE_JIT_DISABLE=str(disable))
    logs = Path(args.logs)
    stem = logs / f"cells-{release}-{disable}"
    try:
        done = subprocess.run([sys.executable, args.cells, args.mode], env=env, capture_output=True, text=True,
                              timeout=args.timeout, cwd=ROOT)
        rc, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    Path(f"{stem}.jsonl").write_text(stdout)
    Path(f"{stem}.err").write_text(stderr)
    records = []
    for line in stdout.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    summary = next((r["summary"] for r in reversed(records) if "summary" in r), None)
    failed = [{"cell": r["cell"], "error": r.get("error", "")[:300]} for r in records
              if "cell" in r and not r.get("ok", True)]
    return {"release": release, "disable": disable, "mode": args.mode, "rc": rc, "summary": summary,
            "failed": failed, "stderr_tail": stderr[-500:] if rc else ""}


def run(args, out, name: str) -> int:
    wanted = releases(args)
    if not wanted:
        print(f"no SGLang release trees in {args.trees} (source tools/gpu_carry.sh first, or name --releases)")
        return 2
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    jobs = [(release, disable) for release in wanted for disable in (0, 1)]
    bad = 0
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        for row in pool.map(lambda job: one(args, *job), jobs):
            out.row(**row)
            bad += row["rc"] != 0
            cells = row["summary"] or {}
            print(f"sglang {row['release']} DISABLE={row['disable']} rc={row['rc']}: {cells.get('cells', '?')} cells, "
                  f"{cells.get('failed', '?')} failed" + "".join(f"\n  {f['cell']}: {f['error']}" for f in row["failed"]),
                  flush=True)
    return 1 if bad else 0
