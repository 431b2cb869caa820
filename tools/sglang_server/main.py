"""The server tests on the GPU machine: plan the engines of a mode, run them side by side within a time box,
judge, and leave at most a handful of files under ``--out``.

    python3 tools/sglang_server/main.py smoke|matrix|ttft|cp2 --release 0.5.17 --out $OUT [--budget-s 480]

(``tools/gpu_server.sh`` installs the carry and calls this.) Under ``--out``: ``<mode>-summary.md`` (the
verdicts, and the plugin's lines from one engine's log as a user sees them), ``<mode>-summary.json``
(``summary.py``) and ``<mode>-cells.tar.gz`` (every engine's JSON, log and trace): three files a mode, so
two modes and the import check fit the eight files a device call returns. A cell that did not finish in
time is listed as such; what finished is judged.

``--dry-run`` starts no engine: it writes the models and the specs, and builds each cell's server
arguments in this process (so a configuration SGLang refuses shows without a GPU to spare).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from sglang_server import harness_plugin, models, plan, runner, summary  # noqa: E402

# SGLang logs without the level by default; with it, an error line is found by its level.
LOGGING = {"version": 1, "disable_existing_loggers": False,
           "formatters": {"f": {"format": "[%(asctime)s] %(levelname)s %(name)s: %(message)s",
                                "datefmt": "%H:%M:%S"}},
           "handlers": {"h": {"class": "logging.StreamHandler", "formatter": "f", "stream": "ext://sys.stderr"}},
           "root": {"level": "INFO", "handlers": ["h"]}}
TIMEOUT = {"correctness": 330.0, "ttft": 480.0, "realsize": 420.0}
# Not started with less left: a real-size engine starts in 35-100 s and then writes what it measured by its
# deadline (a TPOT-only engine needs about 30 s more), so a minute left is still worth a start.
EXPECT = {"correctness": 100.0, "ttft": 110.0, "realsize": 60.0}
REALSIZE_MAX_S = 300.0  # one real-size engine's own deadline, from its start: the next mode gets its turn


def configure(cells: list, workloads: str, rounds=None, order: str = "", lengths: str = "") -> list:
    """The cells with ``--rounds``, ``--lengths`` and ``--workloads`` applied, in the order they run: ``--order``'s modes
    (comma-separated) first, in that order, so that a second call can swap which engine runs first and tell
    the modes from the machine's drift (clocks, heat) over a call."""
    chosen = tuple(w for w in workloads.split(",") if w)
    if not chosen or set(chosen) - {"ttft", "tpot"}:
        raise ValueError(f"--workloads takes ttft, tpot or ttft,tpot, not {workloads!r}")
    try:
        prefixes = [int(n) for n in lengths.split(",") if n]
    except ValueError:
        prefixes = None
    if prefixes is None or any(n < 1024 for n in prefixes):
        raise ValueError(f"--lengths takes prefix lengths of 1024 tokens or more, comma-separated, not {lengths!r}")
    for cell in cells:
        if rounds is not None and cell.workload in ("ttft", "realsize"):
            cell.extra["rounds"] = rounds
        if prefixes and cell.workload in ("ttft", "realsize"):
            cell.extra["lengths"] = prefixes
        if cell.workload == "realsize":
            cell.extra["workloads"] = list(chosen)
    if "ttft" not in chosen:  # TPOT alone: its baseline (HiCache off), then the plugin, so a short call has both
        cells = sorted(cells, key=lambda c: {"hicache-off": 0, "plugin": 1}.get(c.mode, 2))
    first = [m for m in order.split(",") if m]
    if set(first) - set(plan.ALL_MODES):
        raise ValueError(f"--order takes modes of {', '.join(plan.ALL_MODES)}, not {order!r}")
    return sorted(cells, key=lambda c: first.index(c.mode) if c.mode in first else len(first))


def prepare(work: Path, kinds, release: str | None = None) -> dict:
    """Models (as SGLang ``release`` serves them), the logging config and the harness plugin under ``work``;
    the environment the engines need."""
    work.mkdir(parents=True, exist_ok=True)
    made = models.make_all(work / "models", tuple(sorted(kinds)), release)
    (work / "logging.json").write_text(json.dumps(LOGGING))
    harness_plugin.install(work / "harness")
    path = os.pathsep.join([str(HERE.parent), str(work / "harness"), os.environ.get("PYTHONPATH", "")])
    return {"models": made, "env": {"PYTHONPATH": path, "SGLANG_LOGGING_CONFIG_PATH": str(work / "logging.json"),
                                    "PYTHONUNBUFFERED": "1"}}


def jobs_for(cells, made: dict, cells_dir: Path, deadline_epoch: float, base_port: int = 30000) -> list:
    jobs = []
    for i, cell in enumerate(cells):
        spec = plan.spec(cell, model_dir=made[cell.model], vocab=models.VOCAB, port=base_port + 20 * i)
        if cell.workload in ("ttft", "realsize"):
            spec["deadline"] = deadline_epoch - 25  # leave time to shut down and write
        if cell.workload == "realsize":
            spec["max_s"] = REALSIZE_MAX_S
        argv = [sys.executable, str(HERE / "engine_cell.py"), "--spec", json.dumps(spec), "--out", str(cells_dir)]
        jobs.append(runner.Job(cell.name, argv, timeout=TIMEOUT[cell.workload], expect=EXPECT[cell.workload],
                               gpus=spec.get("gpus", 1)))
    return jobs


def dry_run(cells, made: dict, out: Path, mode: str = "dry") -> list:
    """Each cell's ServerArgs, built here without an engine: (cell, effective pair or the error)."""
    from sglang.srt.server_args import ServerArgs
    from sglang_server.engine_cell import engine_kwargs, server_fields

    fields = server_fields(ServerArgs)
    rows = []
    for i, cell in enumerate(cells):
        spec = plan.spec(cell, model_dir=made[cell.model], vocab=models.VOCAB, port=30000 + 20 * i)
        kwargs, dropped = engine_kwargs(spec, fields)
        try:
            args = ServerArgs(**kwargs)
            if hasattr(args, "resolve_once"):  # 0.5.23: the rewrites run at resolution
                args.resolve_once()
            rows.append({"cell": cell.name, "ok": True, "dropped": dropped,
                         "effective": [args.hicache_io_backend, args.hicache_mem_layout]})
        except Exception as exc:  # noqa: BLE001 - a refusal is the answer
            rows.append({"cell": cell.name, "ok": False, "dropped": dropped, "error": f"{type(exc).__name__}: {exc}"})
    (out / f"{mode}-dry-run.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def excerpt(cells_dir: Path) -> str:
    """The plugin's lines (and SGLang's plugin lines) from the first plugin run's log."""
    for log in sorted(cells_dir.glob("*-plugin.log")):
        lines = [line for line in log.read_text(errors="replace").splitlines()
                 if "sglang-hicache-jit" in line or "hicache_jit" in line or "plugin" in line.lower()]
        if lines:
            return f"# {log.name}\n" + "\n".join(lines[:60]) + "\n"
    return "no plugin run's log found\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=sorted(plan.PLANS))
    parser.add_argument("--release", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/srv/work"))
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall time for the engines, from now")
    parser.add_argument("--parallel", type=int, default=None, help="engines at once (default: mode's)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs on this machine (default: torch's count)")
    parser.add_argument("--only", default="", help="cells whose name contains one of these (comma-separated)")
    parser.add_argument("--skip", default="", help="leave out cells whose name contains one of these (comma-separated)")
    parser.add_argument("--rounds", type=int, default=None, help="TTFT rounds per prefix length (default: the plan's 3)")
    parser.add_argument("--workloads", default="ttft,tpot",
                        help="realsize: which workloads each engine runs (ttft, tpot or both)")
    parser.add_argument("--lengths", default="", help="TTFT prefix lengths (default: the plan's, e.g. 8192,32768)")
    parser.add_argument("--order", default="", help="these modes first, in this order (e.g. plugin,upstream)")
    parser.add_argument("--modes", default="", help="realsize: the engines' modes instead of the plan's "
                        "(comma-separated, e.g. plugin,plugin-nostaging,upstream)")
    parser.add_argument("--label", default="", help="put into the summary's title (e.g. 'unofficial')")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    started = time.monotonic()
    deadline = started + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    if args.modes:
        modes = tuple(m for m in args.modes.split(",") if m)
        if args.mode != "realsize" or not modes or set(modes) - set(plan.ALL_MODES):
            parser.error(f"--modes takes modes of {', '.join(plan.ALL_MODES)} for realsize, not {args.modes!r}")
        cells = plan.select(plan.realsize(args.release, modes=modes), only=args.only, skip=args.skip)
    else:
        cells = plan.select(plan.PLANS[args.mode](args.release), only=args.only, skip=args.skip)
    try:
        cells = configure(cells, args.workloads, args.rounds, args.order, args.lengths)
    except ValueError as exc:
        parser.error(str(exc))
    prepared = prepare(args.work, {c.model for c in cells}, args.release)
    os.environ.update(prepared["env"])
    if args.dry_run:
        rows = dry_run(cells, prepared["models"], args.out, args.mode)
        print(json.dumps(rows, indent=1))
        return 0 if all(r["ok"] for r in rows) else 1
    if args.gpus is None:
        import torch

        args.gpus = max(1, torch.cuda.device_count())
    parallel = args.parallel or {"smoke": 4, "matrix": 12, "ttft": 1, "realsize": 1, "cp2": 1}[args.mode]
    pcie = None
    if args.mode == "realsize":  # the floor, in this call, before any engine holds the GPU
        floor = subprocess.run([sys.executable, str(HERE / "pcie.py"), "--out", str(args.out / "pcie.json")],
                               capture_output=True, text=True, timeout=120)
        print(floor.stdout.strip() or floor.stderr[-2000:], flush=True)
        if floor.returncode == 0:
            pcie = json.loads((args.out / "pcie.json").read_text())
    cells_dir = args.work / "cells"
    shutil.rmtree(cells_dir, ignore_errors=True)
    jobs = jobs_for(cells, prepared["models"], cells_dir, time.time() + args.budget_s)

    def done(outcome):
        print(f"[{time.monotonic() - started:6.0f} s] {outcome.name}: {outcome.status} in {outcome.seconds} s",
              flush=True)

    outcomes = runner.run(jobs, parallel=parallel, deadline=deadline, log_dir=cells_dir, hold_after=4,
                          hold_s=100.0, gpus=args.gpus, on_done=done)
    records = summary.load(cells_dir)
    result = summary.judge(records, cells, {o.name: o.status for o in outcomes})
    result["outcomes"] = [vars(o) for o in outcomes]
    ttft = summary.ttft_table(records, models.kv_row_bytes("mla-kv")["token"])
    result["ttft"] = ttft
    label = f"(sglang {args.release}{', ' + args.label if args.label else ''}, {args.mode})"
    text = summary.markdown(result, ttft, label)
    if args.mode == "realsize":
        result["realsize"] = summary.realsize_tables(records, pcie and pcie["h2d_gbps"])
        result["pcie"] = pcie
        text += summary.realsize_markdown(result["realsize"])
    text += "\n" + "\n".join(f"* {o.name}: {o.status} ({o.seconds} s)" for o in outcomes) + "\n"
    text += "\n## What a plugin run's log says\n\n```\n" + excerpt(cells_dir) + "```\n"
    (args.out / f"{args.mode}-summary.md").write_text(text)
    (args.out / f"{args.mode}-summary.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    with tarfile.open(args.out / f"{args.mode}-cells.tar.gz", "w:gz") as tar:
        tar.add(cells_dir, arcname=f"{args.mode}-cells")
    print(text)
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv"], check=False)
    if args.mode == "realsize":
        return 0 if all(o.status == "done" for o in outcomes) else 1
    return 0 if result["passed"] or args.mode == "ttft" else 1


if __name__ == "__main__":
    sys.exit(main())
