#!/usr/bin/env python3
"""Soak of the direct path (copy engines): random heterogeneous batches, bit-exact, with a hang watchdog.

Why it exists: a wrong copy or a hang inside the CUDA driver cannot be caught by any Python code. The driver's
``cuMemcpyBatchAsync`` did both on the lent H200 (driver 580.159.04: wrong rows without an error, and Xid
11/32 crashes; docs/troubleshooting.md), so the package no longer calls it. This soaks what the defaults and
every documented switch still send to the GPU: every copy of a transfer in one ``cudaMemcpy3DBatchAsync``
call (``mode='batch'``, what ``auto`` picks), or one ``cudaMemcpy2DAsync`` per copy (``mode='2d'``, what
``auto`` picks for pageable memory and CUDA graphs); ``--mode mixed`` (the default) picks one per call.

    PYTHONPATH=. python3 tools/soak_direct.py --seconds 300 --threads 2 --out soak.json
    PYTHONPATH=. python3 tools/soak_direct.py --smoke --device cpu --out /tmp/soak.json   # the logic, no GPU

Each thread has its own CUDA stream and its own buffers: a host source and destination (pinned), a device
source and destination, each inside guard bytes. Every call picks at random: the direction (host->GPU or
GPU->host), the host layout (``layer_first``, ``page_first``, ``page_first_direct``; the device side is
layer-first, as SGLang's), the layer count, the row size (``--row-bytes``: by default every row SGLang's
pools use, 132 B of the DSA indexer up to 4096 B), the page size, up to ``--max-pages`` whole pages (default
30,000, log-uniform, so small and huge calls both come), sorted or not, sometimes one long run, sometimes
ragged (not whole pages: single tokens, some pairs skipped with -1), one layer or all. It then goes through
``direct.plan_runs`` and ``direct.copy_runs`` (what the host pools call) and checks:

* every addressed row against the source as plain torch indexing reads it (bit-exact);
* the guard bytes around every destination (a write outside it);
* on audit calls (every device-side call, every ``--audit-every``-th host-side one) the destination is
  zeroed first and every row not addressed must still be zero afterwards (a write to the wrong row).

A watchdog thread reports a hang: when a thread makes no progress for ``--hang-seconds`` it prints which
thread, which call and what that call was, writes the summary with ``hang`` set, and exits 3 (a call stuck
in the driver cannot be interrupted). The summary (``--out``, JSON) is also written every
``--snapshot-seconds`` with ``finished: false``, so a crash leaves the last one: calls, the totals (copies,
bytes, errors), modes, layouts, row sizes, failures, and the driver (from nvidia-smi), runtime, torch and
GPU. Exit 0: every check held; 1: a check failed or a call raised; 2: bad options; 3: a hang.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from sglang_hicache_jit.safeio import check_output, write_output  # noqa: E402
from sglang_hicache_jit.transfer import cuda, direct  # noqa: E402
from sglang_hicache_jit.transfer import layout as host_layout  # noqa: E402

LAYOUTS = host_layout.LAYOUTS
# Every row size SGLang's pools use: the DSA indexer's 132 B, MHA heads, MLA's 576 (FP8) and 1152 (bf16)...
ROW_BYTES = (132, 256, 512, 576, 656, 1152, 2048, 4096)
PAGE_SIZES = (1, 2, 4, 16, 32, 64, 128, 256)
LAYERS = (1, 2, 4, 8)
MODES = direct.MODES  # every submission a user can ask for: 'auto' and what it picks, 'batch' and '2d'
# Pages a call chooses among on each side: small rows would otherwise make hundreds of millions of slots, and
# a random permutation of them costs seconds and gigabytes per call. A million pages keep calls sparse enough.
MAX_CHOICE_PAGES = 1 << 20
GUARD = 4096  # bytes around every region, filled with GUARD_BYTE
GUARD_BYTE = 0xA5
MAX_FAILURES_KEPT = 20
EXIT_FAILED, EXIT_USAGE, EXIT_HANG = 1, 2, 3


# ---------------------------------------------------------------------------
# Buffers and their views.

def pattern(words: int, seed: int, device) -> torch.Tensor:
    """``words`` int32 words of a fixed pattern (no two neighbours equal), as bytes; made in pieces so
    a large region needs no large temporary."""
    out = torch.empty(words * 4, dtype=torch.uint8, device=device)
    step = 1 << 24
    for first in range(0, words, step):
        index = torch.arange(first, min(words, first + step), dtype=torch.int64, device=device)
        values = (index * 2654435761 + seed) & 0xFFFFFFFF
        out[first * 4:(first + index.numel()) * 4] = values.to(torch.int32).view(torch.uint8)
    return out


class Region:
    """``size`` bytes inside guard bytes: ``buffer`` holds both, ``bytes`` is the usable part."""

    def __init__(self, size: int, device, pin: bool):
        self.buffer = torch.full((GUARD + size + GUARD,), GUARD_BYTE, dtype=torch.uint8, device=device,
                                 pin_memory=pin)
        self.bytes = self.buffer[GUARD:GUARD + size]

    def guards_hold(self) -> bool:
        return bool((self.buffer[:GUARD] == GUARD_BYTE).all()) and bool((self.buffer[-GUARD:] == GUARD_BYTE).all())


def slots_of(region_bytes: int, layers: int, row: int, page: int) -> int:
    return region_bytes // (layers * row) // page * page


def layer_view(flat: torch.Tensor, layout: str, layers: int, row: int, page: int, slots: int, layer: int):
    """(rows, to_rows) of one layer of a region laid out as ``layout``: ``rows`` is a 2-D view (slot, row
    bytes) and ``to_rows`` maps slots to its rows (None: the identity), as the host pools view theirs
    (transfer/layout.py)."""
    shape = host_layout.buffer_shape(layout, layers=layers, slots=slots, page_size=page, row_shape=(row,))
    rows = host_layout.layer_rows(flat[:layers * slots * row].view(shape), layout, layer)
    return rows, host_layout.token_rows(layout, layers=layers, page_size=page, slots=slots, name="host slots")


# ---------------------------------------------------------------------------
# One call.

class Call:
    """The random choices of one transfer."""

    def __init__(self, rng: random.Random, gen: torch.Generator, sides: dict, max_pages: int, row_bytes):
        self.direction = rng.choice(("h2d", "d2h"))
        self.layout = rng.choice(LAYOUTS)
        self.layers = rng.choice(LAYERS)
        self.row = rng.choice(row_bytes)
        smallest = min(sides.values())
        fitting = [p for p in PAGE_SIZES if slots_of(smallest, self.layers, self.row, p) >= p]
        if not fitting:  # rows of all these layers do not fit the (--smoke) buffers: the smallest case
            self.layers, self.row, fitting = 1, min(row_bytes), [1]
        self.page = rng.choice(fitting)
        cap = MAX_CHOICE_PAGES * self.page
        self.host_slots = min(cap, slots_of(sides["host"], self.layers, self.row, self.page))
        self.dev_slots = min(cap, slots_of(sides["device"], self.layers, self.row, self.page))
        host_slots, dev_slots = self.host_slots, self.dev_slots
        limit = min(max_pages, host_slots // self.page, dev_slots // self.page)
        self.pages = min(limit, max(1, int(math.exp(rng.uniform(0, math.log(limit + 1))))))
        self.one_run = rng.random() < 0.15
        self.ragged = rng.random() < 0.2
        self.layer = None if rng.random() < 0.5 else rng.randrange(self.layers)
        host = self._pages(rng, gen, host_slots // self.page)
        dev = self._pages(rng, gen, dev_slots // self.page)
        host_idx = (host[:, None] * self.page + torch.arange(self.page)).reshape(-1)
        dev_idx = (dev[:, None] * self.page + torch.arange(self.page)).reshape(-1)
        if self.ragged:  # not whole pages: a random part of the tokens, some pairs skipped on either side
            keep = torch.randperm(host_idx.numel(), generator=gen)[:max(1, host_idx.numel() // 2)].sort().values
            host_idx, dev_idx = host_idx[keep], dev_idx[keep]
            skip = torch.rand(host_idx.numel(), generator=gen) < 0.05
            if rng.random() < 0.5:
                host_idx = torch.where(skip, -1, host_idx)
            else:
                dev_idx = torch.where(skip, -1, dev_idx)
        self.host_idx, self.dev_idx = host_idx, dev_idx

    def _pages(self, rng, gen, available: int) -> torch.Tensor:
        if self.one_run:
            first = rng.randrange(available - self.pages + 1)
            return torch.arange(first, first + self.pages)
        chosen = torch.randperm(available, generator=gen)[:self.pages]
        return chosen.sort().values if rng.random() < 0.5 else chosen

    def describe(self) -> str:
        layers = "all" if self.layer is None else f"layer {self.layer}"
        return (f"{self.direction} {self.layout} layers={self.layers} ({layers}) row={self.row} B page={self.page} "
                f"pages={self.pages}{' one run' if self.one_run else ''}{' ragged' if self.ragged else ''} "
                f"tokens={self.host_idx.numel()}")


class Worker:
    """One thread: its buffers, its stream, its counters."""

    def __init__(self, number: int, args, device: str):
        self.number, self.args, self.device = number, args, device
        self.rng = random.Random(args.seed * 1000 + number)
        self.gen = torch.Generator().manual_seed(args.seed * 1000 + number)
        on_gpu = device == "cuda"
        host_bytes, dev_bytes = args.host_mib << 20, args.device_mib << 20
        host_bytes, dev_bytes = host_bytes - host_bytes % 4, dev_bytes - dev_bytes % 4
        self.stream = torch.cuda.Stream() if on_gpu else None
        self.host_src = Region(host_bytes, "cpu", on_gpu)
        self.host_dst = Region(host_bytes, "cpu", on_gpu)
        self.dev_src = Region(dev_bytes, device, False)
        self.dev_dst = Region(dev_bytes, device, False)
        # The host source's pattern, made on the device: the reference that host->device calls are checked
        # against (torch indexing on it, never the path under test).
        self.host_ref = pattern(host_bytes // 4, 1000 + number, device)
        self.host_src.bytes.copy_(self.host_ref)
        self.dev_src.bytes.copy_(pattern(dev_bytes // 4, 2000 + number, device))
        self.sizes = {"host": host_bytes, "device": dev_bytes}
        self.calls = self.copies = self.bytes = self.host_audits = 0
        self.modes: dict = {}
        self.layouts: dict = {}
        self.rows: dict = {}  # calls per row size
        self.ragged = 0  # calls that were not whole pages
        self.max_pages = self.max_copies = 0
        self.failures: list = []
        self.failed = 0
        self.state = {"call": 0, "phase": "starting", "since": time.monotonic(), "what": ""}
        self.done = False

    def mark(self, phase: str, what: str | None = None) -> None:
        self.state = {"call": self.calls, "phase": phase, "since": time.monotonic(),
                      "what": self.state["what"] if what is None else what}

    def fail(self, call: Call, problem: str) -> None:
        self.failed += 1
        if len(self.failures) < MAX_FAILURES_KEPT:
            self.failures.append({"thread": self.number, "call": self.calls, "what": call.describe(),
                                  "problem": problem})
        print(f"soak: thread {self.number} call {self.calls} FAILED: {problem} ({call.describe()})", file=sys.stderr,
              flush=True)

    def run(self, deadline: float) -> None:
        self.mark("starting")
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else _nothing():
                while time.monotonic() < deadline and not self.done:
                    self.one_call()
        except Exception as exc:  # a raising call ends this thread: a sticky CUDA error would fail every later one
            self.failed += 1
            self.failures.append({"thread": self.number, "call": self.calls, "what": self.state["what"],
                                  "problem": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
            print(f"soak: thread {self.number} call {self.calls} raised {type(exc).__name__}: {exc}", file=sys.stderr,
                  flush=True)
        finally:
            self.mark("finished")

    def one_call(self) -> None:
        self.calls += 1
        self.mark("planning", "")
        call = Call(self.rng, self.gen, self.sizes, self.args.max_pages, self.args.row_bytes)
        to_host = call.direction == "d2h"
        audit = not to_host or self.calls % self.args.audit_every == 0
        dst_region = self.host_dst if to_host else self.dev_dst
        if audit:
            dst_region.bytes.zero_()
            self.host_audits += to_host
        layers = range(call.layers) if call.layer is None else (call.layer,)
        host_region = self.host_dst if to_host else self.host_src
        dev_region = self.dev_src if to_host else self.dev_dst
        host = [layer_view(host_region.bytes, call.layout, call.layers, call.row, call.page, call.host_slots, layer)
                for layer in layers]
        dev = [layer_view(dev_region.bytes, "layer_first", call.layers, call.row, call.page, call.dev_slots, layer)[0]
               for layer in layers]
        host_map = host[0][1]  # the same slot -> row map for every layer
        host = [rows for rows, _ in host]
        if to_host:
            pairs, dst_idx, src_idx = list(zip(host, dev)), call.host_idx, call.dev_idx
            dst_map, src_map = host_map, None
        else:
            pairs, dst_idx, src_idx = list(zip(dev, host)), call.dev_idx, call.host_idx
            dst_map, src_map = None, host_map
        mode = self.args.mode if self.args.mode != "mixed" else self.rng.choice(MODES)
        self.mark("planning", call.describe() + f" mode={mode}")
        runs = direct.plan_runs(dst_idx, src_idx, call.page, dst_rows=dst_map, src_rows=src_map)
        copies = len(runs) * len(pairs)
        self.mark("copying")
        ran = direct.copy_runs(direct.Pairs(pairs), runs, mode=mode)
        self.mark("waiting for the copies")
        if self.stream is not None:
            self.stream.synchronize()
        self.mark("checking")
        self.check(call, pairs, dst_idx, src_idx, dst_map, src_map, layers, to_host, audit)
        self.copies += copies
        self.bytes += int(runs.length.sum()) * call.row * len(pairs)
        self.modes[ran] = self.modes.get(ran, 0) + 1
        key = f"{call.direction} {call.layout}"
        self.layouts[key] = self.layouts.get(key, 0) + 1
        self.rows[call.row] = self.rows.get(call.row, 0) + 1
        self.ragged += call.ragged
        self.max_pages, self.max_copies = max(self.max_pages, call.pages), max(self.max_copies, copies)

    def check(self, call, pairs, dst_idx, src_idx, dst_map, src_map, layers, to_host, audit) -> None:
        keep = (dst_idx >= 0) & (src_idx >= 0)
        dst_rows, src_rows = dst_idx[keep], src_idx[keep]
        dst_rows = dst_rows if dst_map is None else dst_map(dst_rows)
        src_rows = src_rows if src_map is None else src_map(src_rows)
        for i, layer in enumerate(layers):
            if to_host:
                reference = pairs[i][1]  # the device source: read back by torch indexing
            else:
                reference = layer_view(self.host_ref, call.layout, call.layers, call.row, call.page, call.host_slots,
                                       layer)[0]
            expected = reference[src_rows.to(reference.device)]
            written = pairs[i][0]
            got = written[dst_rows.to(written.device)].to(expected.device)
            if not torch.equal(got, expected):
                bad = (got != expected).any(dim=1).nonzero().flatten()
                self.fail(call, f"layer {layer}: {bad.numel()} of {expected.shape[0]} rows differ from the source, "
                                f"the first destination row {int(dst_rows[int(bad[0])])}")
                return
            if audit:
                written[dst_rows.to(written.device)] = 0
        region = self.host_dst if to_host else self.dev_dst
        if not region.guards_hold():
            self.fail(call, "a guard byte around the destination changed (a write outside it)")
        elif audit and bool(region.bytes.any()):
            first = int(region.bytes.nonzero()[0])
            self.fail(call, f"the destination changed outside the addressed rows (first at byte {first})")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------
# The run.

def machine(device: str) -> dict:
    """What the results were measured on; each part None where it cannot be read."""
    info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "device": device}
    if device != "cuda":
        return info
    info["gpu"] = torch.cuda.get_device_name()
    info["runtime"] = cuda.cuda_runtime().version
    info["batch"] = direct.batch_status()[1]
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        info["nvidia_smi"] = f"not available: {exc}"
    return info


def summary(workers, args, started: float, about: dict, *, finished: bool, hang=None) -> dict:
    def total(name):
        return sum(getattr(w, name) for w in workers)

    modes, layouts, rows = {}, {}, {}
    for w in workers:
        for mine, into in ((w.modes, modes), (w.layouts, layouts), (w.rows, rows)):
            for key, value in mine.items():
                into[key] = into.get(key, 0) + value
    failures = [f for w in workers for f in w.failures]
    failed = total("failed")
    return {"tool": "tools/soak_direct.py", "finished": finished, "ok": finished and not failed and hang is None,
            "seconds": round(time.monotonic() - started, 1), "asked_seconds": args.seconds, "threads": args.threads,
            "mode": args.mode, "max_pages": args.max_pages, "seed": args.seed,
            "row_bytes": sorted(args.row_bytes),
            "calls": total("calls"), "copies": total("copies"), "bytes": total("bytes"), "errors": failed,
            "totals": {"copies": total("copies"), "bytes": total("bytes"), "errors": failed},
            "host_audits": total("host_audits"), "ragged_calls": total("ragged"),
            "most_pages_in_a_call": max((w.max_pages for w in workers), default=0),
            "most_copies_in_a_call": max((w.max_copies for w in workers), default=0),
            "modes": modes, "layouts": layouts, "rows": {str(k): rows[k] for k in sorted(rows)},
            "failed": failed, "failures": failures, "hang": hang, "machine": about}


def write(args, document: dict) -> None:
    if args.out:
        write_output(args.out, (json.dumps(document, indent=1) + "\n").encode(), "--out")


def watch(workers, args, started: float, about: dict, stop: threading.Event) -> None:
    """Reports a thread that made no progress for --hang-seconds, then ends the process (exit 3); writes a
    snapshot of the summary every --snapshot-seconds."""
    last_snapshot = time.monotonic()
    while not stop.wait(min(1.0, args.hang_seconds / 4)):
        now = time.monotonic()
        for w in workers:
            state = w.state
            if state["phase"] != "finished" and now - state["since"] > args.hang_seconds:
                hang = {"thread": w.number, "call": state["call"], "phase": state["phase"], "what": state["what"],
                        "seconds": round(now - state["since"], 1)}
                print(f"soak: HANG: thread {w.number} made no progress for {hang['seconds']} s in call {hang['call']} "
                      f"({state['phase']}: {state['what']})", file=sys.stderr, flush=True)
                _faulthandler(faulthandler.dump_traceback)
                write(args, summary(workers, args, started, about, finished=False, hang=hang))
                os._exit(EXIT_HANG)  # a thread stuck in the driver cannot be stopped any other way
        if now - last_snapshot >= args.snapshot_seconds:
            last_snapshot = now
            done = summary(workers, args, started, about, finished=False)
            write(args, done)
            print(f"soak: {done['seconds']} s: {done['calls']} calls, {done['copies']} copies, "
                  f"{done['bytes'] / 1e9:.1f} GB, {done['failed']} failed", file=sys.stderr, flush=True)


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=None, help="how long to run (default 300; --smoke: 2)")
    parser.add_argument("--threads", type=int, default=2, help="threads, each with its own stream and buffers")
    parser.add_argument("--out", type=Path, help="where to write the JSON summary")
    parser.add_argument("--max-pages", type=int, default=None, help="most whole pages in one call (default 30000)")
    parser.add_argument("--host-mib", type=int, default=None, help="each host buffer per thread (default 2040)")
    parser.add_argument("--device-mib", type=int, default=None, help="each device buffer per thread (default 2040)")
    parser.add_argument("--mode", default="mixed", choices=(*MODES, "mixed"),
                        help="the direct path's submission (default mixed: a random one of auto, batch, 2d per call)")
    parser.add_argument("--row-bytes", type=_row_list, default=ROW_BYTES, metavar="B[,B...]",
                        help=f"row sizes a call picks among (default {','.join(map(str, ROW_BYTES))})")
    parser.add_argument("--hang-seconds", type=float, default=120.0, help="no progress for this long is a hang")
    parser.add_argument("--snapshot-seconds", type=float, default=10.0, help="how often the summary is rewritten")
    parser.add_argument("--audit-every", type=int, default=8,
                        help="every N-th host-side call checks the whole destination (device-side: every call)")
    parser.add_argument("--seed", type=int, default=26)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--smoke", action="store_true", help="tiny buffers and few pages: the logic, in seconds")
    parser.add_argument("--simulate-hang", type=int, default=0, metavar="CALL",
                        help="thread 0 stops at this call (a self-test of the watchdog)")
    args = parser.parse_args(argv)
    small = {"seconds": 2.0, "max_pages": 64, "host_mib": 1, "device_mib": 1}
    # 2040 MiB: with its guard bytes a buffer stays under 2 GiB, which torch's pinned allocator rounds up to.
    large = {"seconds": 300.0, "max_pages": 30000, "host_mib": 2040, "device_mib": 2040}
    for name, value in (small if args.smoke else large).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("seconds", "hang_seconds", "snapshot_seconds"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be above 0")
    for name in ("threads", "max_pages", "host_mib", "device_mib", "audit_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.out:
        try:
            check_output(args.out, "--out")
        except ValueError as exc:
            parser.error(str(exc))
    return args


def _row_list(text: str) -> tuple:
    try:
        rows = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of byte counts") from None
    if not rows or any(r < 1 for r in rows):
        raise argparse.ArgumentTypeError(f"{text!r}: every row size must be at least 1 byte")
    return rows


def run(args) -> dict:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("soak: --device cuda, but torch sees no GPU here")
    if device == "cpu" and not args.smoke:
        raise SystemExit("soak: no GPU here (or --device cpu); the soak needs one. --smoke checks its logic on the CPU")
    _faulthandler(faulthandler.enable)  # a crash in the driver still prints every thread's Python stack
    started = time.monotonic()
    workers = [Worker(n, args, device) for n in range(args.threads)]
    if device == "cuda":
        torch.cuda.synchronize()  # the buffers were filled on the default stream; each thread uses its own
    about = machine(device)
    if args.simulate_hang:
        _hang_at(workers[0], args.simulate_hang)
    stop = threading.Event()
    watchdog = threading.Thread(target=watch, args=(workers, args, started, about, stop), daemon=True)
    watchdog.start()
    deadline = time.monotonic() + args.seconds
    threads = [threading.Thread(target=w.run, args=(deadline,), name=f"soak-{w.number}") for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watchdog.join()
    document = summary(workers, args, started, about, finished=True)
    write(args, document)
    return document


def _faulthandler(action) -> None:
    try:
        action(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):  # a stderr without a file descriptor (captured by a test)
        pass


def _hang_at(worker: Worker, call: int) -> None:
    one_call = worker.one_call

    def stopping():
        if worker.calls + 1 == call:
            worker.calls += 1
            worker.mark("copying", "the --simulate-hang call")
            threading.Event().wait()  # never returns: the watchdog must notice
        one_call()

    worker.one_call = stopping


def main(argv=None) -> int:
    args = parse(argv)
    document = run(args)
    line = (f"soak: {document['seconds']} s, {args.threads} threads: {document['calls']} calls, {document['copies']} "
            f"copies, {document['bytes'] / 1e9:.1f} GB, {document['errors']} errors, most pages in a call "
            f"{document['most_pages_in_a_call']}, modes {document['modes']}, rows {document['rows']}: "
            + ("every check held" if document["ok"] else f"{document['failed']} FAILED"))
    print(line)
    return 0 if document["ok"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
