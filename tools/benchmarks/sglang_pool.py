"""``sglang-pool``: SGLang's own MLA host pool, through the plugin or unpatched.

Run it once per side, in separate processes (the plugin patches process-wide state), with the release's
code and an sgl_kernel on PYTHONPATH (tools/gpu_bench.sh's sglang step sets them):

    python3 tools/bench.py sglang-pool --label plugin
    SGLANG_HICACHE_JIT_SGLANG_PLUGIN=0 python3 tools/bench.py sglang-pool --label unpatched

``--part calls`` (the default; any release 0.5.16+): host time per call. The pool is built as
tests/sglang_cells.py builds it for that release: mla-bf16 rows (1152 B), page_first, 4 layers, page 16.
Each sample times ``--calls`` back-to-back calls on the host clock (the GPU work of a call, 64 tokens, is
shorter than the host's part, so the host is what is measured): a load_to_device_per_layer of one layer
and a backup_from_device_all_layer of all layers, with io_backend='kernel'. Rounds alternate the two
operations; the median over rounds is reported, with the spread. Unpatched, the pool runs SGLang's own
JIT kernels (built on first use with apache-tvm-ffi, before timing starts).

``--part rates`` (sglang 0.5.23+: the pool is built from an MLABufferInfo, as SGLang's assembler builds
it): mla-bf16 rows, a page_first host pool of 512K slots x 8 layers, a 256K-slot device pool, page 64,
random whole pages (host side sorted), random bytes. Per call size: one backup_from_device_all_layer and
one load_to_device_per_layer of one layer, as GB/s and as a ratio to the contiguous pinned copy of the
same bytes in the same direction, measured in the same run; medians of CUDA-event timings.
``--overhead`` adds the host time per call of the op the pool calls (the plugin's routed
transfer_hicache_one_layer_mla) against calling sglang_hicache_jit.compat directly: the plugin's own cost.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def add_arguments(p, name: str) -> None:
    p.add_argument("--label", required=True, help="what this process measures: plugin, unpatched, ...")
    p.add_argument("--part", choices=("calls", "rates"), default="calls")
    p.add_argument("--calls", type=int, default=200, help="calls: back-to-back calls per sample")
    p.add_argument("--rounds", type=int, default=15, help="calls: rounds")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 65536], help="rates: call sizes")
    p.add_argument("--host-slots", type=int, default=512 * 1024)
    p.add_argument("--device-slots", type=int, default=256 * 1024)
    p.add_argument("--reps", type=int, default=20, help="rates: timed calls per figure")
    p.add_argument("--overhead", action="store_true", help="rates: also the plugin's own host cost per call")


def run(args, out, name: str) -> int:
    return calls(args, out) if args.part == "calls" else rates(args, out)


def calls(args, out) -> int:
    sys.path[:0] = [str(ROOT / "tests")]
    from release_kit import tolerate_newer_transformers

    tolerate_newer_transformers()
    import torch

    import sglang_cells as cells
    from importlib.metadata import version

    status = cells.load_plugin()
    built = cells.mla_pool(layout="page_first", sharded=False, dtype=torch.bfloat16, dim=576, device="cuda:0",
                           pin=True)
    host, device_pool = built.host, built.device_pool
    generator = torch.Generator().manual_seed(1)
    host_idx = cells._tokens(cells._pages(4, host.page_num - 1, generator))
    dev_idx = cells._tokens(cells._pages(4, cells.DEVICE_PAGES, generator)).cuda()
    # Upstream's kernels take a load's host indices on the GPU and a backup's on the CPU (as its controller passes them).
    host_idx_gpu = host_idx.cuda()
    ops = {"load_one_layer": lambda: host.load_to_device_per_layer(device_pool, host_idx_gpu, dev_idx, 1, "kernel"),
           "backup_all_layers": lambda: host.backup_from_device_all_layer(device_pool, host_idx, dev_idx, "kernel")}
    for fn in ops.values():  # builds whatever kernel the call uses, then warms up
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in ops}
    for _ in range(args.rounds):
        for name, fn in ops.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            samples[name].append((time.perf_counter() - start) / args.calls * 1e6)
            torch.cuda.synchronize()
    result = {"label": args.label, "sglang": version("sglang"), "patched": len(status["patched"]),
              "can_use_jit": bool(host.can_use_jit), "calls": args.calls, "rounds": args.rounds,
              "us_per_call": {name: {"median": round(statistics.median(v), 2), "min": round(min(v), 2),
                                     "max": round(max(v), 2)} for name, v in samples.items()}}
    host.destroy()
    print(json.dumps(result), flush=True)
    out.row(part="calls", **result)
    return 0


LAYERS, DIM, PAGE = 8, 576, 64  # --part rates


def build_pool(layout: str, host_slots: int, device_slots: int):
    import torch
    from sglang_hicache_jit.bench.workloads import _fill_random

    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    buffers = tuple(torch.empty((device_slots, 1, DIM), dtype=torch.bfloat16, device="cuda:0")
                    for _ in range(LAYERS))
    for b in buffers:
        _fill_random(b.view(torch.uint8), torch)
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64, device="cuda:0")
    info = MLABufferInfo(buffers=buffers, data_ptrs=ptrs, layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS,
                         page_size=PAGE, kv_lora_rank=512, qk_rope_head_dim=64, kv_cache_dim=DIM,
                         dtype=torch.bfloat16, device=torch.device("cuda:0"))
    pool = MLATokenToKVPoolHost(info, 1.0, 0, PAGE, layout, device_capacity_tokens=device_slots,
                                host_token_capacity=host_slots, start_layer=0, end_layer=LAYERS,
                                target_layer_num=LAYERS)
    _fill_random(pool.kv_buffer.view(torch.uint8), torch)
    torch.cuda.synchronize()
    return pool, buffers


def time_ms(fn, reps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


_ceiling = []


def ceiling_gbs(nbytes: int, to_device: bool, reps: int) -> float:
    """The contiguous pinned copy of the same bytes, same direction (random bytes)."""
    from sglang_hicache_jit.bench.workloads import Ceiling

    if not _ceiling:
        _ceiling.append(Ceiling("cuda:0"))
    return nbytes / time_ms(_ceiling[0].call(nbytes, "h2d" if to_device else "d2h"), reps) / 1e6


def host_overhead(pool, buffers, tokens: int, calls: int) -> dict:
    """Host microseconds per call: the routed op the pool calls vs compat directly."""
    import sglang.srt.mem_cache.pool_host.mla as mla
    import torch

    from sglang_hicache_jit import compat
    from sglang_hicache_jit.bench.workloads import make_indices

    host_idx, dev_idx = make_indices(tokens, PAGE, pool.size - PAGE, buffers[0].shape[0], seed=7)
    host_idx, dev_idx = host_idx.cuda(), dev_idx.cuda()
    kwargs = dict(cache_dst=buffers[0], indices_dst=dev_idx, cache_src=pool.data_refs[0], indices_src=host_idx,
                  element_dim=DIM)
    samples = {"plugin": [], "compat": []}
    fns = {"plugin": mla.jit_transfer_hicache_one_layer_mla, "compat": compat.transfer_hicache_one_layer_mla}
    for _ in range(15):  # interleaved rounds, so drift hits both alike
        for name, fn in fns.items():
            fn(page_size=PAGE, **kwargs)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn(page_size=PAGE, **kwargs)
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    result = {name: statistics.median(values) for name, values in samples.items()}
    result["plugin_over_compat"] = result["plugin"] / result["compat"]
    return result


def rates(args, out) -> int:
    from sglang.srt.plugins import load_plugins

    from sglang_hicache_jit.bench.workloads import make_indices

    load_plugins()
    pool, buffers = build_pool("page_first", args.host_slots, args.device_slots)
    for tokens in args.tokens:
        host_idx, dev_idx = make_indices(tokens, PAGE, args.host_slots - PAGE, args.device_slots, seed=tokens)
        # Upstream's kernels want the host indices of a backup on the CPU and those of a load on
        # the GPU (its staged write-back and its load kernels check); both sides get the same.
        dev_idx, host_idx_gpu = dev_idx.cuda(), host_idx.cuda()
        per_layer = tokens * DIM * 2
        backup_ms = time_ms(lambda: pool.backup_from_device_all_layer(None, host_idx, dev_idx, "kernel"), args.reps)
        load_ms = time_ms(lambda: pool.load_to_device_per_layer(None, host_idx_gpu, dev_idx, 3, "kernel"), args.reps)
        for op, ms, nbytes, to_device in (("backup_all_layers", backup_ms, per_layer * LAYERS, False),
                                          ("load_one_layer", load_ms, per_layer, True)):
            gbs = nbytes / ms / 1e6
            ceil = ceiling_gbs(nbytes, to_device, args.reps)
            out.row(part="rates", label=args.label, op=op, tokens=tokens, gbps=round(gbs, 1),
                    ceiling_gbps=round(ceil, 1), ratio=round(gbs / ceil, 3))
            print(f"{args.label:9s} {op:18s} {tokens:6d} tok  {gbs:6.1f} GB/s  ceiling {ceil:5.1f}  "
                  f"ratio {gbs / ceil:.2f}", flush=True)
    if args.overhead:
        overhead = {t: host_overhead(pool, buffers, t, 100) for t in (1024, 16384)}
        out.row(part="overhead", label=args.label, us_per_call=overhead)
        print("host us/call:", json.dumps(overhead), flush=True)
    pool.destroy()
    return 0
