#!/usr/bin/env python3
"""SGLang 0.5.23's own MLA host pool: GB/s through the plugin, and host cost of the plugin.

Run it twice, in separate processes (the plugin patches process-wide state):

    python tools/bench_sglang.py --label plugin            # this package, through the plugin
    SGLANG_HICACHE_JIT_SGLANG_PLUGIN=0 python tools/bench_sglang.py --label upstream
                                                           # the same pool on upstream's JIT kernels

The pool is built the way SGLang's assembler builds it (from an MLABufferInfo):
mla-bf16 rows (576 x bf16 = 1152 B), a page_first host pool of 512K slots x 8
layers, a 256K-slot device pool, page 64, random whole pages (host side
sorted), random bytes. Reported per batch size: one backup_from_device_all_layer
(GPU -> host, all layers) and one load_to_device_per_layer (host -> GPU, one
layer), as GB/s and as a ratio to one contiguous pinned copy of the same bytes
in the same direction, measured in the same run; medians of CUDA-event timings.

``--overhead`` also measures host time per call of the op the pool calls
(the plugin's routed transfer_hicache_one_layer_mla) against calling
sglang_hicache_jit.compat directly: the plugin's own cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from sglang_hicache_jit.bench.workloads import _fill_random, make_indices  # noqa: E402

LAYERS, DIM, PAGE = 8, 576, 64


def build_pool(layout: str, host_slots: int, device_slots: int):
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


def ceiling_gbs(nbytes: int, to_device: bool, reps: int) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    fn = (lambda: dev.copy_(host, non_blocking=True)) if to_device else (lambda: host.copy_(dev, non_blocking=True))
    return nbytes / time_ms(fn, reps) / 1e6


def host_overhead(pool, buffers, tokens: int, calls: int) -> dict:
    """Host microseconds per call: the routed op the pool calls vs compat directly."""
    import sglang.srt.mem_cache.pool_host.mla as mla

    from sglang_hicache_jit import compat

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--host-slots", type=int, default=512 * 1024)
    parser.add_argument("--device-slots", type=int, default=256 * 1024)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--overhead", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from sglang.srt.plugins import load_plugins

    load_plugins()
    pool, buffers = build_pool("page_first", args.host_slots, args.device_slots)
    rows = []
    for tokens in args.tokens:
        host_idx, dev_idx = make_indices(tokens, PAGE, args.host_slots - PAGE, args.device_slots, seed=tokens)
        # Upstream's kernels want the host indices of a backup on the CPU and those of a load on
        # the GPU (its staged write-back and its load kernels check); both modes get the same.
        dev_idx, host_idx_gpu = dev_idx.cuda(), host_idx.cuda()
        per_layer = tokens * DIM * 2
        backup_ms = time_ms(lambda: pool.backup_from_device_all_layer(None, host_idx, dev_idx, "kernel"), args.reps)
        load_ms = time_ms(lambda: pool.load_to_device_per_layer(None, host_idx_gpu, dev_idx, 3, "kernel"), args.reps)
        for op, ms, nbytes, to_device in (("backup_all_layers", backup_ms, per_layer * LAYERS, False),
                                          ("load_one_layer", load_ms, per_layer, True)):
            gbs = nbytes / ms / 1e6
            ceil = ceiling_gbs(nbytes, to_device, args.reps)
            rows.append({"label": args.label, "op": op, "tokens": tokens, "gbs": round(gbs, 1),
                         "ceiling_gbs": round(ceil, 1), "ratio": round(gbs / ceil, 3)})
            print(f"{args.label:9s} {op:18s} {tokens:6d} tok  {gbs:6.1f} GB/s  ceiling {ceil:5.1f}  "
                  f"ratio {gbs / ceil:.2f}", flush=True)
    out = {"rows": rows}
    if args.overhead:
        out["overhead_us"] = {t: host_overhead(pool, buffers, t, 100) for t in (1024, 16384)}
        print("host us/call:", json.dumps(out["overhead_us"]), flush=True)
    pool.destroy()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
