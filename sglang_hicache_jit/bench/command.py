"""Transfer benchmark: this package's kernels beside upstream SGLang's, PyTorch baselines and the link's ceiling.

Workloads and pool shapes are those of docs/BENCHMARKS.md ("Workloads"): a
``page_first`` host pool of 512K token slots x 8 layers, a 256K-slot device
pool, random whole pages (host side sorted), one layer per call or all layers
at once. Every figure is a median of CUDA-event timings over several calls on
random bytes; the ceiling (one contiguous pinned copy of the same bytes, same
direction) is measured in the same run, and every ratio is against it. Upstream SGLang's own kernels
run as the ``upstream*`` providers (upstream.py) when SGLang is importable; a transfer run ends
with a summary of the best of ours against the best of upstream per cell.

Run with ``sglang-hicache-jit bench``, or ``python3 tools/bench.py grid|beside|overhead`` (the same
options, and the result rows of every tools/bench.py workload).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time

from .. import safeio, settings
from ..errors import BadSettingError
from .modes import MODES
from .providers import PROVIDER_NAMES, check_provider
from .report import plot, summarize, summary_lines
from .workloads import WORKLOADS

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by `sglang-hicache-jit bench` and tools/bench.py grid, beside, overhead)."""
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--scopes", nargs="+", default=["one", "all"], choices=["one", "all"])
    p.add_argument("--directions", nargs="+", default=["h2d", "d2h"], choices=["h2d", "d2h"])
    p.add_argument("--page-sizes", nargs="+", type=settings.whole_number_option, default=[64, 1])
    p.add_argument("--tokens", nargs="+", type=settings.whole_number_option, default=[1024, 4096, 16384, 65536])
    p.add_argument("--quotas", nargs="+", type=settings.whole_number_option, default=[1, 2, 4, 8], help="SM budgets (CTAs) to measure")
    p.add_argument("--methods", nargs="*", default=[], choices=["plain", "bulk"],
                   help="also measure these copy methods explicitly at each quota")
    p.add_argument("--providers", nargs="*", default=None,
                   help=f"only these providers (ceiling always runs): {PROVIDER_NAMES}")
    p.add_argument("--host-layout", default="page_first", choices=["page_first", "page_first_direct"],
                   help="host pool layout: page_first (a layer's rows strided), or page_first_direct (a page of a "
                        "layer contiguous: the copy engines move it as one copy; one layer only)")
    p.add_argument("--host-slots", type=settings.whole_number_option, default=512 * 1024)
    p.add_argument("--device-slots", type=settings.whole_number_option, default=256 * 1024)
    p.add_argument("--max-baseline-tokens", type=settings.whole_number_option, default=16384,
                   help="skip the slow PyTorch baselines above this many tokens")
    p.add_argument("--max-all-layer-tokens", type=settings.whole_number_option, default=65536)
    p.add_argument("--mode", default="transfer", choices=["transfer", "interference", "overhead"],
                   help="transfer: GB/s per provider; interference: beside a saturating matmul; "
                        "overhead: host cost per call")
    p.add_argument("--gemm-size", type=settings.whole_number_option, default=8192, help="interference: square bf16 matmul size")
    p.add_argument("--gemm-seconds", type=settings.decimal_option, default=0.05, help="interference: matmul time per measurement")
    p.add_argument("--priorities", nargs="+", default=["normal", "high"], choices=["normal", "high"],
                   help="interference: side-stream priorities to measure")
    p.add_argument("--load", default="matmul", choices=["matmul", "decode"],
                   help="interference: back-to-back saturating matmuls, or decode-like steps of small "
                        "matmuls with gaps")
    p.add_argument("--json", help="write the records to this JSON file")
    p.add_argument("--plot", help="draw GB/s against tokens per call into this PNG (needs matplotlib)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("-q", "--quiet", action="store_true", help="print no row per measurement")
    return p.parse_args(argv)


def run_parsed(args, records: list | None = None) -> int:
    """Runs the benchmark for parsed arguments; torch is imported only here, after parsing. ``records``
    receives each record as it is measured (tools/bench.py passes a list that writes them out at once)."""
    try:
        for name in args.providers or []:
            check_provider(name)
        for option, path in (("--json", args.json), ("--plot", args.plot)):
            if path:  # before the benchmark runs, not after: a FIFO or device there is never replaced
                safeio.check_output(settings.user_path(option, path), option)
    except BadSettingError as exc:
        print(f"error: [{exc.code}] {exc.reason} (fix: {exc.fix})", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: [bad_setting] {exc} (fix: see `bench --help` and docs/cli.md for provider names)",
              file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("error: bench needs a CUDA GPU (the transfers run between GPU memory and pinned host memory)",
              file=sys.stderr)
        return 2
    records = [] if records is None else records
    interrupted = False
    # A run stopped by Ctrl-C or SIGTERM (e.g. `timeout`) still writes what it measured.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if main_thread else None
    try:
        MODES[args.mode](args, records)
    except KeyboardInterrupt:
        interrupted = True
        print(f"interrupted: keeping the {len(records)} records measured so far", file=sys.stderr, flush=True)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        ops = sys.modules.get(f"{__package__.rpartition('.')[0]}.transfer.ops")  # bench/ -> transfer/ops
        if ops is not None:  # providers leave their bulk tuning set; give the caller the defaults back
            ops.set_tuning(bulk_warps=0, read_align=0)
    summary = summarize(records) if args.mode == "transfer" else []
    if any(row["upstream"] for row in summary):
        print("\n".join([""] + summary_lines(summary)), flush=True)
    if args.json:
        document = {"schema": 1, "date": time.strftime("%Y-%m-%d"), "argv": sys.argv, "records": records,
                    "summary": summary}
        safeio.write_output(settings.user_path("--json", args.json), json.dumps(document, indent=1).encode(),
                            "--json")
    if args.plot and args.mode == "transfer":
        try:
            plot(records, args.plot)
        except ImportError:
            print("matplotlib is not installed (pip install 'sglang-hicache-jit[bench]'); no plot drawn",
                  file=sys.stderr)
    return 130 if interrupted else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s", stream=sys.stderr)
    return run_parsed(args)


if __name__ == "__main__":
    sys.exit(main())
