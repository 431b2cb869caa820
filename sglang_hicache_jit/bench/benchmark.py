"""Transfer benchmark: this package's kernels beside upstream SGLang's, PyTorch baselines and the link's ceiling.

Workloads and pool shapes are those of docs/BENCHMARKS.md ("Workloads"): a
``page_first`` host pool of 512K token slots x 8 layers, a 256K-slot device
pool, random whole pages (host side sorted), one layer per call or all layers
at once. Every figure is a median of CUDA-event timings over several calls on
random bytes; the ceiling (one contiguous pinned copy of the same bytes, same
direction) is measured in the same run, and every ratio is against it. Upstream SGLang's own kernels
run as the ``upstream*`` providers (upstream.py) when SGLang is importable; a transfer run ends
with a summary of the best of ours against the best of upstream per cell.

Run with ``sglang-hicache-jit bench`` or ``python tools/bench_transfer.py``.
"""

from __future__ import annotations

import argparse
import ctypes
import io
import json
import logging
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass

from . import upstream
from .. import safeio, settings
from .upstream import Unavailable
from ..errors import BadSettingError

WORKLOADS = {
    # name: (caches per layer, row bytes)
    "mla-bf16": (1, 1152),
    "mla-fp8": (1, 576),
    "dsa-fp8": (1, 656),
    "mha-llama8b": (2, 2048),
    "mha-small": (2, 256),
}
LAYERS = 8

log = logging.getLogger("sglang_hicache_jit")


@dataclass
class Pools:
    caches: int
    row_bytes: int
    host: list      # per cache: pinned (slots, LAYERS, row_bytes) uint8, page_first
    device: list    # per cache: list of LAYERS device tensors (slots, row_bytes)
    host_slots: int
    device_slots: int
    # 'page_first', or 'page_first_direct': the same bytes read as (pages, LAYERS, page_size, row_bytes),
    # so a page of one layer is one contiguous run (SGLang's layout for its direct backend).
    layout: str = "page_first"


def _fill_random(t, torch):
    """Random bytes (never zeros) generated on the GPU in chunks and copied in."""
    flat = t.view(-1)
    chunk = 1 << 28
    for start in range(0, flat.numel(), chunk):
        n = min(chunk, flat.numel() - start)
        flat[start:start + n].copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda"))


def make_pools(workload: str, host_slots: int, device_slots: int, layout: str = "page_first") -> Pools:
    import torch

    caches, row_bytes = WORKLOADS[workload]
    host, device = [], []
    for _ in range(caches):
        buf = torch.empty((host_slots, LAYERS, row_bytes), dtype=torch.uint8, pin_memory=True)
        _fill_random(buf, torch)
        host.append(buf)
        layers = [torch.empty((device_slots, row_bytes), dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
        for layer in layers:
            _fill_random(layer, torch)
        device.append(layers)
    torch.cuda.synchronize()
    return Pools(caches, row_bytes, host, device, host_slots, device_slots, layout)


def make_indices(tokens: int, page_size: int, host_slots: int, device_slots: int, seed: int):
    """Random whole pages on both sides; the host side sorted (as HiCache allocates)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    pages = tokens // page_size
    host_pages = torch.randperm(host_slots // page_size, generator=gen)[:pages].sort().values
    dev_pages = torch.randperm(device_slots // page_size, generator=gen)[:pages]
    offsets = torch.arange(page_size)
    host = (host_pages[:, None] * page_size + offsets).reshape(-1)
    dev = (dev_pages[:, None] * page_size + offsets).reshape(-1)
    return host, dev


def time_call(fn, *, min_reps=5, max_reps=40, budget_s=0.25, queue_s=300e-6) -> list[float]:
    """Per-call seconds from CUDA events, after a warm-up.

    Each timed rep enqueues enough back-to-back calls to keep the GPU busy for
    about ``queue_s`` and divides, so a provider's Python cost per call does
    not show up as idle GPU time unless it exceeds the transfer itself (then
    the figure is CPU-bound, as it would be in a server).
    """
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end) / 1e3, 1e-6)
    batch = int(min(16, max(1, round(queue_s / once))))
    reps = int(min(max_reps, max(min_reps, budget_s / (once * batch))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        for _ in range(batch):
            fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 / batch for s, e in events]


def _providers(args):
    if args.providers:  # an explicit list may name tuned variants, e.g. jit-bulk-q4-w2-a128, upstream-tma-q8
        return ["ceiling"] + [p for p in args.providers if p != "ceiling"]
    names = ["ceiling", "jit"] + [f"jit-q{q}" for q in args.quotas]
    names += [f"jit-{m}-q{q}" for m in args.methods for q in args.quotas]
    if upstream.importable():  # upstream SGLang's kernels beside ours, at SGLang's own defaults
        names += ["upstream", "upstream-reg", "upstream-tma"]
    return names + ["torch-index", "per-page"]


def check_provider(name: str) -> None:
    """ValueError for a provider name the benchmark does not know (checked before anything runs)."""
    if name in ("ceiling", "torch-index", "per-page") or name in DIRECT_PROVIDERS:
        return
    head = name.split("-")[0]
    try:
        if head == "jit":
            _parse_jit_provider(name)
            return
        if head == "upstream":
            upstream.parse(name)
            return
    except (ValueError, IndexError) as exc:
        raise ValueError(f"bad provider {name!r}: {exc}") from None
    raise ValueError(f"unknown provider {name!r} (ceiling, jit[-plain|-bulk|-resident][-qN][-rR][-wW][-aA], "
                     "upstream[-reg|-tma][-qN], direct[-batch3d|-2d], torch-index, per-page)")


def family(provider: str) -> str:
    """'ours' (jit*), 'upstream' (upstream*), 'ceiling' or 'baseline' (the PyTorch ways)."""
    if provider == "ceiling":
        return "ceiling"
    if provider.startswith("jit"):
        return "ours"
    return "upstream" if provider.startswith("upstream") else "baseline"


def _build_or_skip(provider, skipped: set, *args):
    """build_call's callable, or None after printing why ``provider`` cannot run here (once per reason)."""
    try:
        return build_call(provider, *args)
    except Unavailable as exc:
        if (provider, str(exc)) not in skipped:
            skipped.add((provider, str(exc)))
            print(f"skipped {provider}: {exc}", flush=True)
        return None


# The copy engines (direct.py) by submission: 'direct' as the pools call it (auto), the others forced.
DIRECT_PROVIDERS = {"direct": "auto", "direct-batch3d": "batch3d", "direct-2d": "2d"}


def build_call(provider, pools: Pools, scope, direction, layer, host_idx, dev_idx, page_size, scratch):
    """A zero-argument callable doing one transfer with ``provider``; Unavailable if it cannot run here."""
    to_device = direction == "h2d"
    if provider.startswith("upstream"):
        up = upstream.module()  # Unavailable without SGLang, before anything touches the GPU
        if pools.layout == "page_first_direct":
            raise Unavailable("SGLang's kernels take page_first_direct pages through its direct backend only")
        return upstream.build_call(up, provider, pools, scope, to_device, layer, host_idx.cuda(),
                                         dev_idx.cuda(), page_size, LAYERS)

    import torch

    from ..transfer import ops

    host_views = [buf[:, layer] for buf in pools.host]
    dev_views = [layers[layer] for layers in pools.device]
    if pools.layout == "page_first_direct":
        if scope == "all":
            raise Unavailable("page_first_direct is measured one layer at a time")
        # A layer's rows of page p start at row (p * LAYERS + layer) * page_size of the flat buffer.
        host_views = [buf.view(-1, pools.row_bytes)[layer * page_size:] for buf in pools.host]
        host_idx = (torch.div(host_idx, page_size, rounding_mode="floor") * (LAYERS * page_size)
                    + host_idx % page_size)
    caches = pools.caches
    host_cuda, dev_cuda = host_idx.cuda(), dev_idx.cuda()
    n = host_idx.numel()

    if provider == "ceiling":
        nbytes = n * pools.row_bytes * caches * (LAYERS if scope == "all" else 1)
        key = ("ceiling", nbytes)
        if key not in scratch:
            scratch.clear()
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            _fill_random(host, torch)
            scratch[key] = (host, torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
        host, dev = scratch[key]
        return (lambda: dev.copy_(host, non_blocking=True)) if to_device else (lambda: host.copy_(dev, non_blocking=True))

    if provider.startswith("jit"):
        method, quota, tuning = _parse_jit_provider(provider)
        if method and method.startswith("resident"):
            _resident_blocks(ops, tuning.pop("resident_blocks", None))

        # Set for this provider's measurements (the next jit provider sets its own): set per call, it would
        # drop the launch plans on every call and time their rebuild too.
        ops.set_tuning(bulk_warps=tuning.get("bulk_warps", 0), read_align=tuning.get("read_align", 0))
        return _jit_call(ops, pools, scope, to_device, host_views, dev_views, host_cuda, dev_cuda, quota, method)
    if scope == "all":
        pairs = [(pools.host[c][:, l], pools.device[c][l]) for l in range(LAYERS) for c in range(caches)]
    else:
        pairs = list(zip(host_views, dev_views))
    if provider in DIRECT_PROVIDERS:  # the copy engines: one copy per run of slots, batched calls
        from ..transfer import direct

        copy_pairs = direct.Pairs([(dev, host) if to_device else (host, dev) for host, dev in pairs])
        dst_idx, src_idx = (dev_idx, host_idx) if to_device else (host_idx, dev_idx)
        mode = DIRECT_PROVIDERS[provider]
        return lambda: direct.copy_rows(copy_pairs, dst_idx, src_idx, mode=mode)
    if provider == "torch-index":
        if to_device:
            def call():
                for host, dev in pairs:
                    dev[dev_cuda] = host[host_idx].to("cuda", non_blocking=True)
        else:
            def call():
                for host, dev in pairs:
                    host[host_idx] = dev[dev_cuda].to("cpu")
        return call
    if provider == "per-page":
        starts = list(zip(host_idx[::page_size].tolist(), dev_idx[::page_size].tolist()))
        if to_device:
            def call():
                for host, dev in pairs:
                    for h, d in starts:
                        dev[d:d + page_size].copy_(host[h:h + page_size], non_blocking=True)
        else:
            def call():
                for host, dev in pairs:
                    for h, d in starts:
                        host[h:h + page_size].copy_(dev[d:d + page_size], non_blocking=True)
        return call
    raise ValueError(f"unknown provider {provider!r}")


def _parse_jit_provider(name: str):
    """'jit[-plain|-bulk|-resident][-qN][-rR][-wW][-aA]': method, CTAs, resident CTAs (R, for
    'resident') and bulk tuning (warps, read alignment)."""
    method, quota, tuning = None, None, {}
    for part in name.split("-")[1:]:
        if part in ("plain", "bulk", "resident"):
            method = part if method is None else f"{method}-{part}"  # e.g. jit-resident-bulk
        elif part[0] == "r" and part[1:].isdigit():
            tuning["resident_blocks"] = int(part[1:])
        elif part[0] == "q":
            quota = int(part[1:])
        elif part[0] == "w":
            tuning["bulk_warps"] = int(part[1:])
        elif part[0] == "a":
            tuning["read_align"] = int(part[1:])
        else:
            raise ValueError(f"unknown provider part {part!r} in {name!r}")
    return method, quota, tuning


def _resident_blocks(ops, blocks) -> None:
    """Resident CTAs for the next resident transfer: the queue is made again when the count changes."""
    import os

    from .. import settings

    wanted = str(blocks) if blocks else ""
    if os.environ.get(settings.RESIDENT_BLOCKS, "") != wanted:
        ops.stop_resident()
        if wanted:
            os.environ[settings.RESIDENT_BLOCKS] = wanted
        else:
            os.environ.pop(settings.RESIDENT_BLOCKS, None)


def _jit_call(ops, pools, scope, to_device, host_views, dev_views, host_cuda, dev_cuda, quota, method):
    if scope == "all":
        host_tab = ops.LayerTable(_table_arg([[buf[:, l] for l in range(LAYERS)] for buf in pools.host]),
                                  written=not to_device)
        dev_tab = ops.LayerTable(_table_arg(pools.device), written=to_device)
        if to_device:
            return lambda: ops.transfer_all_layer(dev_tab, dev_cuda, host_tab, host_cuda, block_quota=quota, method=method)
        return lambda: ops.transfer_all_layer(host_tab, host_cuda, dev_tab, dev_cuda, block_quota=quota, method=method)
    if pools.caches == 1:
        if to_device:
            return lambda: ops.transfer_one_layer_mla(dev_views[0], dev_cuda, host_views[0], host_cuda,
                                                      block_quota=quota, method=method)
        return lambda: ops.transfer_one_layer_mla(host_views[0], host_cuda, dev_views[0], dev_cuda,
                                                  block_quota=quota, method=method)
    if to_device:
        return lambda: ops.transfer_one_layer(dev_views[0], dev_views[1], dev_cuda, host_views[0], host_views[1],
                                              host_cuda, block_quota=quota, method=method)
    return lambda: ops.transfer_one_layer(host_views[0], host_views[1], host_cuda, dev_views[0], dev_views[1],
                                          dev_cuda, block_quota=quota, method=method)


def _table_arg(groups):
    return groups[0] if len(groups) == 1 else (tuple(groups[0]), tuple(groups[1]))


def run(args, records: list | None = None) -> list[dict]:
    import torch

    records = [] if records is None else records  # filled as it goes: an interrupted run keeps them
    scratch: dict = {}
    skipped: set = set()
    device_name = torch.cuda.get_device_name()
    points = [(w, sc, p, t, d) for w in args.workloads for sc in args.scopes for p in args.page_sizes
              for t in args.tokens for d in args.directions if not (sc == "all" and t > args.max_all_layer_tokens)]
    done, started = 0, time.monotonic()
    for workload in args.workloads:
        log.info("%s: filling a %d-slot host pool and a %d-slot device pool with random bytes", workload,
                 args.host_slots, args.device_slots)
        pools = make_pools(workload, args.host_slots, args.device_slots, args.host_layout)
        for scope in args.scopes:
            for page_size in args.page_sizes:
                for tokens in args.tokens:
                    if scope == "all" and tokens > args.max_all_layer_tokens:
                        continue
                    host_idx, dev_idx = make_indices(tokens, page_size, pools.host_slots, pools.device_slots,
                                                     seed=tokens + page_size)
                    for direction in args.directions:
                        done += 1
                        ceiling = None
                        for provider in _providers(args):
                            log.info("[%d/%d] %s %s-layer %s page %d, %d tokens: %s (%.0f s so far)", done,
                                     len(points), workload, scope, direction, page_size, tokens, provider,
                                     time.monotonic() - started)
                            if provider in ("torch-index", "per-page") and tokens > args.max_baseline_tokens:
                                continue
                            if provider == "per-page" and page_size < 16:
                                continue  # one copy per token: minutes per point, and not a real contender
                            fn = _build_or_skip(provider, skipped, pools, scope, direction, 3, host_idx, dev_idx,
                                                page_size, scratch)
                            if fn is None:
                                continue
                            times = time_call(fn)
                            median = statistics.median(times)
                            nbytes = tokens * pools.row_bytes * pools.caches * (LAYERS if scope == "all" else 1)
                            gbps = nbytes / median / 1e9
                            if provider == "ceiling":
                                ceiling = gbps
                            record = dict(workload=workload, host_layout=args.host_layout, scope=scope,
                                          direction=direction, page_size=page_size, tokens=tokens, provider=provider, family=family(provider),
                                          kernel=getattr(fn, "kernel", None), bytes=nbytes, median_s=median,
                                          min_s=min(times), max_s=max(times), reps=len(times), gbps=gbps,
                                          ratio=gbps / ceiling if ceiling else None, device=device_name)
                            records.append(record)
                            if not args.quiet:
                                print(_row(record), flush=True)
        del pools
        torch.cuda.empty_cache()
    return records


def interference(args, records: list | None = None) -> list[dict]:
    """A bf16 matmul saturating the GPU on the compute stream, transfers on a side stream.

    For each provider: the matmul's slow-down against running alone, and the
    transfer rate achieved while it runs (ratio to the unloaded ceiling).
    """
    import collections

    import torch

    m = args.gemm_size
    if args.load == "matmul":  # one saturating matmul after another: prefill-like
        a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
        c = torch.empty_like(a)
        gemm = lambda: torch.mm(a, b, out=c)  # noqa: E731
    else:  # decode-like: a step of many small matmuls (64 tokens), then a gap of ~0.1 ms with one SM busy
        a = torch.randn(64, m, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
        c = torch.empty(64, m, dtype=torch.bfloat16, device="cuda")

        def gemm():
            for _ in range(16):
                torch.mm(a, b, out=c)
            torch.cuda._sleep(200_000)
    gemm_alone = statistics.median(time_call(gemm, budget_s=0.5))
    print(f"{args.load} load ({m}) alone: {gemm_alone * 1e3:.3f} ms per step", flush=True)
    low, high = torch.cuda.Stream.priority_range()
    records = [] if records is None else records  # filled as it goes: an interrupted run keeps them
    scratch, skipped = {}, set()
    for workload in args.workloads:
        pools = make_pools(workload, args.host_slots, args.device_slots, args.host_layout)
        tokens = args.tokens[0]
        page_size = args.page_sizes[0]
        host_idx, dev_idx = make_indices(tokens, page_size, pools.host_slots, pools.device_slots, seed=1)
        nbytes = tokens * pools.row_bytes * pools.caches
        for direction in args.directions:
            ceiling = None
            for provider in _providers(args):
                for priority_name, priority in (("normal", low), ("high", high)):
                    if priority_name not in args.priorities:
                        continue
                    fn = _build_or_skip(provider, skipped, pools, "one", direction, 3, host_idx, dev_idx, page_size,
                                        scratch)
                    if fn is None:
                        break
                    alone = statistics.median(time_call(fn))
                    if provider == "ceiling" and priority_name == "normal":
                        ceiling = nbytes / alone / 1e9
                    side = torch.cuda.Stream(priority=priority)
                    reps = max(3, int(round(args.gemm_seconds / gemm_alone)))
                    torch.cuda.synchronize()
                    g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    # The load alone, just before: the GPU's clocks drift as it heats, so a baseline
                    # taken once at the start would count that drift as slow-down.
                    g0.record()
                    for _ in range(reps):
                        gemm()
                    g1.record()
                    g1.synchronize()
                    load_alone = g0.elapsed_time(g1) / 1e3 / reps
                    g0.record()
                    for _ in range(reps):
                        gemm()
                    g1.record()
                    count, pending = 0, collections.deque()
                    with torch.cuda.stream(side):
                        t0.record(side)
                        while not g1.query():
                            fn()
                            done = torch.cuda.Event()
                            done.record(side)
                            pending.append(done)
                            count += 1
                            if len(pending) > 4:
                                pending.popleft().synchronize()
                        t1.record(side)
                    torch.cuda.synchronize()
                    gemm_loaded = g0.elapsed_time(g1) / 1e3 / reps
                    loaded_gbps = count * nbytes / (t0.elapsed_time(t1) / 1e3) / 1e9
                    record = dict(mode="interference", load=args.load, workload=workload,
                                  host_layout=args.host_layout, direction=direction, tokens=tokens, page_size=page_size, provider=provider, family=family(provider),
                                  kernel=getattr(fn, "kernel", None), priority=priority_name,
                                  transfers=count, gbps_alone=nbytes / alone / 1e9, gbps_loaded=loaded_gbps,
                                  ratio_loaded=loaded_gbps / ceiling if ceiling else None,
                                  gemm_alone_s=load_alone, gemm_loaded_s=gemm_loaded,
                                  gemm_slowdown=gemm_loaded / load_alone - 1, device=torch.cuda.get_device_name())
                    records.append(record)
                    print(f"{workload:<12} {direction} {provider:<16} {priority_name:<6} alone {record['gbps_alone']:6.2f}"
                          f" GB/s | under matmul {loaded_gbps:6.2f} GB/s (x{record['ratio_loaded'] or 0:.2f})"
                          f" | matmul +{record['gemm_slowdown'] * 100:5.1f}%  (n={count})", flush=True)
        del pools
        torch.cuda.empty_cache()
    return records


def overhead(args, records: list | None = None) -> list[dict]:
    """Host (CPU) cost per call, launching back to back without waiting: the
    floor under which a small transfer cannot go however fast the kernel is."""
    import torch

    from ..transfer import abi, launcher, ops, plans

    records = [] if records is None else records  # filled as it goes: an interrupted run keeps them
    tokens = 64
    dev = torch.randint(0, 256, (4096, 1152), dtype=torch.uint8, device="cuda")
    host_buf = torch.empty((4096, 8, 1152), dtype=torch.uint8, pin_memory=True)
    host = host_buf[:, 3]
    idx_gpu = torch.arange(tokens, device="cuda")
    idx_cpu = torch.arange(tokens)
    contiguous_host = torch.empty(tokens * 1152, dtype=torch.uint8, pin_memory=True)
    contiguous_dev = torch.empty_like(contiguous_host, device="cuda")
    state = launcher._state(torch.cuda.current_device())

    def through_torch_op():  # the binding's torch op instead of the C launcher, for comparison
        c_launch, state._launch_c = state._launch_c, None
        try:
            ops.transfer_one_layer_mla(dev, idx_gpu, host, idx_gpu)
        finally:
            state._launch_c = c_launch

    calls = {
        "jit one-layer, GPU indices": lambda: ops.transfer_one_layer_mla(dev, idx_gpu, host, idx_gpu),
        "jit one-layer, CPU indices": lambda: ops.transfer_one_layer_mla(dev, idx_cpu, host, idx_cpu),
        # SGLang's routed ops pass a fresh view of each pool buffer per call.
        "jit one-layer, fresh views": lambda: ops.transfer_one_layer_mla(dev.view(4096, -1), idx_gpu,
                                                                        host_buf[:, 3], idx_gpu),
        "jit one-layer, via torch op": through_torch_op,
        "torch copy_ (contiguous)": lambda: contiguous_dev.copy_(contiguous_host, non_blocking=True),
    }
    if state._launch_c is not None:
        # Where the first row's time goes: the kept plan run without the key
        # look-up, the C launcher alone on the plan's filled struct (with and
        # without a kernel to launch), and a ctypes call that does nothing.
        plans._clear_plans()
        ops.transfer_one_layer_mla(dev, idx_gpu, host, idx_gpu)
        plan = next(iter(plans._plan_cache().values()))
        launch, stream = state._launch_c, abi._raw_stream(state.device)
        empty = abi._CTransfer.from_buffer_copy(plan.spec)
        empty.num_items = 0
        noop = state.library.handle.hicache_error_string
        calls["  breakdown: plan.run"] = lambda: plan.run(idx_gpu, idx_gpu)
        calls["  breakdown: C launcher"] = lambda: launch(plan.spec_addr, stream, plan.method_used_addr)
        calls["  breakdown: C launcher, 0 rows"] = lambda: launch(ctypes.addressof(empty), stream,
                                                                  plan.method_used_addr)
        calls["  breakdown: no-op ctypes call"] = lambda: noop(0)
    try:  # upstream SGLang's JIT op (tvm-ffi), when sglang is installed and its kernel builds
        from sglang.kernels.ops.kvcache import hicache as upstream

        dev3, host3 = dev.view(-1, 1, 1152).view(torch.bfloat16), host.view(-1, 1, 1152).view(torch.bfloat16)
        upstream.transfer_hicache_one_layer_mla(dev3, idx_gpu, host3, idx_gpu, element_dim=576)
        calls["upstream sglang one-layer (tvm-ffi)"] = lambda: upstream.transfer_hicache_one_layer_mla(
            dev3, idx_gpu, host3, idx_gpu, element_dim=576)
    except Exception as exc:
        print(f"upstream sglang op not measured: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    for name, fn in calls.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        n = 2000
        t = time.perf_counter()
        for _ in range(n):
            fn()
        cpu = (time.perf_counter() - t) / n
        torch.cuda.synchronize()
        records.append(dict(mode="overhead", provider=name, cpu_us_per_call=cpu * 1e6))
        print(f"{name:<32} {cpu * 1e6:6.1f} us per call (host)", flush=True)
    return records


def _row(r: dict) -> str:
    ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "  - "
    kernel = f"  [{r['kernel']} kernel]" if r.get("kernel") else ""  # what upstream's provider ran
    return (f"{r['workload']:<12} {r['scope']:<3} {r['direction']} p{r['page_size']:<3} {r['tokens']:>6} "
            f"{r['provider']:<16} {r['gbps']:7.2f} GB/s  x{ratio}  ({r['median_s'] * 1e6:9.1f} us, n={r['reps']})"
            f"{kernel}")


CELL = ("workload", "scope", "direction", "page_size", "tokens")


def _cell_order(key):
    workload, scope, direction, page_size, tokens = key
    return workload, scope, direction, -page_size, tokens


def summarize(records: list[dict]) -> list[dict]:
    """Ours against upstream per cell (workload, scope, direction, page size, tokens) of a transfer run.

    For each cell with a figure from either side: the best ``jit*`` provider and the best
    ``upstream*`` provider by ratio to the same-run ceiling, and ``quotient`` = ours / upstream
    (above 1: ours is faster; the ceiling cancels, so it is also the quotient of the GB/s).
    """
    cells: dict = {}
    for r in records:
        side = family(r["provider"])
        if r.get("mode", "transfer") != "transfer" or side == "baseline":
            continue
        cell = cells.setdefault(tuple(r[k] for k in CELL), {})
        if side == "ceiling":
            cell["ceiling"] = r
        elif r.get("ratio") is not None and (side not in cell or r["ratio"] > cell[side]["ratio"]):
            cell[side] = r
    rows = []
    for key in sorted(cells, key=_cell_order):
        cell = cells[key]
        if "ours" not in cell and "upstream" not in cell:
            continue
        row = dict(zip(CELL, key))
        row["ceiling_gbps"] = cell["ceiling"]["gbps"] if "ceiling" in cell else None
        for side in ("ours", "upstream"):
            best = cell.get(side)
            row[side] = best["provider"] if best else None
            row[f"{side}_kernel"] = best.get("kernel") if best else None
            row[f"{side}_gbps"] = best["gbps"] if best else None
            row[f"{side}_ratio"] = best["ratio"] if best else None
        row["quotient"] = row["ours_ratio"] / row["upstream_ratio"] if cell.get("ours") and cell.get("upstream") \
            else None
        rows.append(row)
    return rows


def summary_lines(rows: list[dict]) -> list[str]:
    """The summary as text: one line per cell, ours and upstream with their ratios, then ours/upstream."""
    def side(row, name):
        if row[name] is None:
            return f"{'-':<18} {'':>5}"
        return f"{row[name]:<18} {row[name + '_ratio']:5.2f}"

    lines = ["ours vs upstream: the best of each per cell, ratio to the same-run ceiling; "
             "ours/upstream above 1: ours is faster",
             f"{'workload':<12} {'scope':<5} {'dir':<3} {'page':>4} {'tokens':>6}  {'best ours':<18} {'ratio':>5}  "
             f"{'best upstream':<18} {'ratio':>5}  ours/upstream"]
    for row in rows:
        quotient = f"{row['quotient']:.2f}" if row["quotient"] is not None else "-"
        lines.append(f"{row['workload']:<12} {row['scope']:<5} {row['direction']:<3} {row['page_size']:>4} "
                     f"{row['tokens']:>6}  {side(row, 'ours')}  {side(row, 'upstream')}  {quotient}")
    return lines


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["workload"], r["scope"], r["direction"], r["page_size"]) for r in records})
    cols = 4
    rows = (len(groups) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, group in zip(axes.flat, groups):
        sel = [r for r in records if (r["workload"], r["scope"], r["direction"], r["page_size"]) == group]
        for provider in sorted({r["provider"] for r in sel}):
            pts = sorted((r["tokens"], r["gbps"]) for r in sel if r["provider"] == provider)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=provider,
                    linestyle="--" if provider == "ceiling" else "-")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{group[0]} {group[1]}-layer {group[2]} page {group[3]}", fontsize=9)
        ax.set_xlabel("tokens per call")
        ax.set_ylabel("GB/s")
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)))
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    safeio.write_output(settings.user_path("--plot", path), png.getvalue(), "--plot")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by `sglang-hicache-jit bench` and tools/bench_transfer.py)."""
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--scopes", nargs="+", default=["one", "all"], choices=["one", "all"])
    p.add_argument("--directions", nargs="+", default=["h2d", "d2h"], choices=["h2d", "d2h"])
    p.add_argument("--page-sizes", nargs="+", type=int, default=[64, 1])
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096, 16384, 65536])
    p.add_argument("--quotas", nargs="+", type=int, default=[1, 2, 4, 8], help="SM budgets (CTAs) to measure")
    p.add_argument("--methods", nargs="*", default=[], choices=["plain", "bulk"],
                   help="also measure these copy methods explicitly at each quota")
    p.add_argument("--providers", nargs="*", default=None,
                   help="only these providers (ceiling always runs): jit[-plain|-bulk][-qN][-wW][-aA], "
                        "upstream[-reg|-tma][-qN] (SGLang's own kernels), torch-index, per-page")
    p.add_argument("--host-layout", default="page_first", choices=["page_first", "page_first_direct"],
                   help="host pool layout: page_first (a layer's rows strided), or page_first_direct (a page of a "
                        "layer contiguous: the copy engines move it as one copy; one layer only)")
    p.add_argument("--host-slots", type=int, default=512 * 1024)
    p.add_argument("--device-slots", type=int, default=256 * 1024)
    p.add_argument("--max-baseline-tokens", type=int, default=16384,
                   help="skip the slow PyTorch baselines above this many tokens")
    p.add_argument("--max-all-layer-tokens", type=int, default=65536)
    p.add_argument("--mode", default="transfer", choices=["transfer", "interference", "overhead"],
                   help="transfer: GB/s per provider; interference: beside a saturating matmul; "
                        "overhead: host cost per call")
    p.add_argument("--gemm-size", type=int, default=8192, help="interference: square bf16 matmul size")
    p.add_argument("--gemm-seconds", type=float, default=0.05, help="interference: matmul time per measurement")
    p.add_argument("--priorities", nargs="+", default=["normal", "high"], choices=["normal", "high"],
                   help="interference: side-stream priorities to measure")
    p.add_argument("--load", default="matmul", choices=["matmul", "decode"],
                   help="interference: back-to-back saturating matmuls, or decode-like steps of small "
                        "matmuls with gaps")
    p.add_argument("--json", help="write the records to this JSON file")
    p.add_argument("--plot", help="draw GB/s against tokens per call into this PNG (needs matplotlib)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench_transfer.py", description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("-q", "--quiet", action="store_true", help="print no row per measurement")
    return p.parse_args(argv)


MODES = {"transfer": run, "interference": interference, "overhead": overhead}


def run_parsed(args) -> int:
    """Runs the benchmark for parsed arguments; torch is imported only here, after parsing."""
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
    records: list = []
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
