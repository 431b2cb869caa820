"""The benchmark's modes: transfer (GB/s per provider), interference (beside a saturating matmul or
decode-like steps) and overhead (host cost per call)."""

from __future__ import annotations

import ctypes
import statistics
import time

from .providers import _build_or_skip, _providers, family
from .report import _row
from .workloads import LAYERS, beside, log, make_indices, make_pools, matmul, time_call

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
    """A bf16 matmul saturating the GPU on the compute stream, transfers on a side stream
    (workloads.beside).

    For each provider: the matmul's slow-down against running alone, and the
    transfer rate achieved while it runs (ratio to the unloaded ceiling).
    """
    import torch

    m = args.gemm_size
    if args.load == "matmul":  # one saturating matmul after another: prefill-like
        gemm = matmul(m)
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
                    got = beside(fn, gemm, window_s=args.gemm_seconds, load_s=gemm_alone, stream=side)
                    count, load_alone, gemm_loaded = got["calls"], got["load_alone_s"], got["load_beside_s"]
                    loaded_gbps = count * nbytes / got["seconds"] / 1e9
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

    from ..transfer import abi, launcher, ops, plans, pointer_tables

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

    # Raw pointer tables (SGLang's all-layer backups): 8 device layers into the page_first host buffer's layers.
    layers = [torch.empty((4096, 1152), dtype=torch.uint8, device="cuda") for _ in range(8)]
    dev_table = torch.tensor([t.data_ptr() for t in layers], device="cuda").view(torch.uint64)
    host_table = torch.tensor([host_buf[:, i].data_ptr() for i in range(8)], device="cuda").view(torch.uint64)
    calls = {
        "jit one-layer, GPU indices": lambda: ops.transfer_one_layer_mla(dev, idx_gpu, host, idx_gpu),
        "jit all-layer, pointer tables": lambda: ops.transfer_pointer_tables(
            host_table, idx_gpu, dev_table, idx_gpu, dst_stride_bytes=8 * 1152, src_stride_bytes=1152,
            element_size=1152),
        "  pointer table check, cached": lambda: pointer_tables.checked(dev_table, "tables_src"),
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


MODES = {"transfer": run, "interference": interference, "overhead": overhead}
