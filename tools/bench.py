#!/usr/bin/env python3
"""The one entry point for this project's benchmarks: ``python3 tools/bench.py WORKLOAD [options]``.

Each workload answers one question (``--list`` prints them; docs/BENCHMARKS.md, "How to run", gives the
command behind each recorded figure). They share one setup (sglang_hicache_jit/bench/workloads.py: pools,
random bytes, random whole-page indices, the CUDA-event timer, the ceiling copy, the bf16 matmul run
beside) and one result format: ``--out FILE`` appends JSON lines, a header with the command, date, GPU,
driver and versions, then one line per row as it is measured (tools/benchmarks/harness.py).
``report FILE...`` prints the tables of result files again.

The code of each workload lives in tools/benchmarks/; the CLI's ``sglang-hicache-jit bench`` (grid,
beside, overhead here) ships in the package, so that a user can run it from an installed wheel.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


class Workload(NamedTuple):
    module: str      # in tools/benchmarks/: add_arguments(parser, name) and run(args, out, name) -> exit code
    needs: str       # 'GPU', 'CPU' (no GPU needed), 'GPU + carry' (tools/gpu_carry.sh installed SGLang)
    question: str


WORKLOADS = {
    "layouts": Workload("layouts", "GPU", "How fast do SGLang's per-layer load loop and all-layer backup run through "
                        "the host pools, per layout, page size, call size and io_backend, alone and beside "
                        "back-to-back bf16 matmuls, against the contiguous copy measured the same two ways?"),
    "cta": Workload("layouts", "GPU", "What does the kernel's CTA budget (block_quota 1, 2, 4, default) give and "
                    "cost beside the matmul: rate, matmul slowdown, rate per point of slowdown?"),
    "grid": Workload("transfer", "GPU", "The transfer grid (= sglang-hicache-jit bench): GB/s per provider (ours, "
                     "upstream SGLang's kernels, PyTorch baselines) per workload shape, one/all layers, direction, "
                     "page size and call size, against the ceiling."),
    "beside": Workload("transfer", "GPU", "One call of each provider (= bench --mode interference) beside a "
                       "saturating matmul or decode-like steps: rate and the load's slowdown."),
    "overhead": Workload("transfer", "GPU", "Host cost per transfer call on a GPU (= bench --mode overhead), and "
                         "where it goes."),
    "host-cost": Workload("host_cost", "CPU", "Host cost of the ops' Python layer per call, without a GPU (fake "
                          "device, no-op launcher); with --baseline REV against an older tree."),
    "plan-cost": Workload("copy_engine", "CPU", "Host time of each planning stage of the direct (copy-engine) path "
                          "for one call."),
    "layered": Workload("layered", "GPU", "How much later than a device hit does a forward pass that uses each "
                        "layer as soon as its load ends finish, per copy method (a host hit as SGLang runs it, "
                        "without a server), alone or beside decode steps, against the PCIe floor?"),
    "copy-sizes": Workload("copy_engine", "GPU", "What copy size do the batched copy engines need to reach the "
                           "link, each direction and both at once, beside the contiguous copy and the kernel?"),
    "copy-queue": Workload("copy_queue", "GPU", "How long does a small copy on another stream (a step's sampled "
                           "tokens) wait behind a transfer's large copies, per size those are cut into?"),
    "small-copies": Workload("small_copies", "GPU", "Below what copy size does a copy kernel with 1-2 CTAs beat "
                             "the copy engines' batched call, each direction?"),
    "loader": Workload("loader", "CPU", "Cold build, its breakdown, concurrent cold starts, warm load, bundle "
                       "import and prebuilt load of the kernels, named arch (no GPU)."),
    "warm-ab": Workload("loader", "CPU", "Which of two installations loads faster from its warm cache (fresh "
                        "processes, interleaved)?"),
    "sglang-pool": Workload("sglang_pool", "GPU + carry", "SGLang's own MLA host pool, through the plugin or "
                            "unpatched (run once each, separate processes): host time per pool call, or "
                            "(--part rates, sglang 0.5.23+) GB/s per call size."),
    "releases": Workload("releases", "GPU + carry", "Does every carried SGLang release move every cell of its own "
                         "pools bit-exactly through the plugin, with the kernel and with it disabled?"),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/bench.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="--list: every workload and the question it answers")
    p.add_argument("--list", action="store_true", help="list the workloads and the question each answers")
    sub = p.add_subparsers(dest="workload", metavar="WORKLOAD")
    for name, w in WORKLOADS.items():
        sp = sub.add_parser(name, help=w.question, description=f"{w.question} (needs: {w.needs})")
        sp.add_argument("--out", help="append the run's JSON lines (header, then one line per row) to this file")
        importlib.import_module(f"benchmarks.{w.module}").add_arguments(sp, name)
    rp = sub.add_parser("report", help="print the tables of result files again",
                        description="Print the tables of tools/bench.py result files (JSON lines), or of the CLI "
                                    "bench's --json file (--vs-upstream: ours against upstream per cell).")
    rp.add_argument("files", nargs="+")
    rp.add_argument("--vs-upstream", action="store_true", help="grid: the best of ours against the best of upstream")
    rp.add_argument("--providers", nargs="*", help="grid: only these columns")
    return p


def list_lines() -> list[str]:
    width = max(map(len, WORKLOADS))
    return [f"{name:<{width}}  [{w.needs}] {w.question}" for name, w in WORKLOADS.items()] + [
        f"{'report':<{width}}  print the tables of result files again"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.list or not args.workload:
        print("\n".join(list_lines()))
        return 0 if args.list else 2
    if args.workload == "report":
        from benchmarks import report

        return report.main(args)
    workload = WORKLOADS[args.workload]
    logging.basicConfig(level=logging.WARNING if getattr(args, "quiet", False) else logging.INFO,
                        format="%(message)s", stream=sys.stderr)
    from benchmarks.harness import Results

    module = importlib.import_module(f"benchmarks.{workload.module}")
    settings = {k: v for k, v in vars(args).items() if k not in ("list", "out")}
    out = Results(args.out, args.workload, gpu=workload.needs.startswith("GPU") and not getattr(args, "smoke", False),
                  command=shlex.join(["tools/bench.py", *argv]), args=settings)
    # A run stopped by `timeout` (SIGTERM) or Ctrl-C keeps the rows written so far.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if main_thread else None
    try:
        return module.run(args, out, args.workload)
    except KeyboardInterrupt:
        print(f"interrupted: {len(out.rows)} rows kept" + (f" in {args.out}" if args.out else ""), file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        out.close()


if __name__ == "__main__":
    sys.exit(main())
