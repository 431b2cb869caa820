#!/usr/bin/env python3
"""Host-pool benchmark: the kernel path through the pool against the raw op, the
direct (copy-engine) path against the ceiling, and both beside a saturating
matrix multiply.

Workload (docs/BENCHMARKS.md, "Workloads": mla-bf16): DeepSeek-V3 MLA rows of 1152 B, a
``page_first`` host pool of 512K token slots x 8 layers, a 256K-slot device
pool, page 64, 16K tokens of random whole pages (host pages sorted). Random
bytes everywhere; every provider's result is checked bit-exactly once before
it is timed. Figures are medians of CUDA-event timings; each timed rep queues
a few calls back to back, so a provider's CPU cost shows only when it exceeds
the copy (it is then CPU-bound, as it would be in a server). The ceiling (one
contiguous pinned copy of the same bytes, same direction) is measured in the
same run.

    python tools/bench_pool.py [--json out.json] [--tokens 16384] [--quick]

Exit status 1 if any provider copied wrong bytes; targets are reported, not enforced.
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

from sglang_hicache_jit import ops  # noqa: E402
from sglang_hicache_jit.transfer import direct  # noqa: E402
from sglang_hicache_jit.bench.workloads import _fill_random, make_indices  # noqa: E402
from sglang_hicache_jit.host_pool import MLADevicePool, MLAHostKVPool, choose_io_backend  # noqa: E402
from sglang_hicache_jit.probe import probe  # noqa: E402

KV_CACHE_DIM, LAYERS, PAGE = 576, 8, 64
MATMUL_N = 8192
TARGETS = {"pool_vs_raw_kernel": 0.97, "direct_page_first_vs_ceiling": 0.5}


# ---------------------------------------------------------------------------
# Setup

def fill_random(t: torch.Tensor) -> None:
    _fill_random(t.view(torch.uint8), torch)
    torch.cuda.synchronize()


def make_setup(host_slots: int, device_slots: int, tokens: int, seed: int):
    device_pool = MLADevicePool([torch.empty((device_slots, 1, KV_CACHE_DIM), dtype=torch.bfloat16, device="cuda")
                                 for _ in range(LAYERS)])
    for layer in device_pool.kv_buffer:
        fill_random(layer)
    started = time.perf_counter()
    pool = MLAHostKVPool(device_pool, size=host_slots, page_size=PAGE, layout="page_first")
    register_s = time.perf_counter() - started
    fill_random(pool.kv_buffer)
    host_idx, dev_idx = make_indices(tokens, PAGE, host_slots, device_slots, seed)
    return device_pool, pool, host_idx, dev_idx, register_s


# ---------------------------------------------------------------------------
# Timing

def time_call(fn, *, reps: int, queue_s: float = 300e-6, budget_s: float = 1.0) -> float:
    """Median seconds per call over ``reps`` timed reps of a few back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began = time.perf_counter()
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end) / 1e3, time.perf_counter() - began, 1e-6)
    batch = int(min(16, max(1, round(queue_s / once))))
    reps = int(max(3, min(reps, budget_s / (once * batch))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in events:
        s.record()
        for _ in range(batch):
            fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) / 1e3 / batch for s, e in events)


class Ceiling:
    """One contiguous pinned copy of ``nbytes`` per direction, cached by size."""

    def __init__(self):
        self._buffers = {}

    def call(self, nbytes: int, direction: str):
        if nbytes not in self._buffers:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._buffers[nbytes] = (host, torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
        host, gpu = self._buffers[nbytes]
        if direction == "h2d":
            return lambda: gpu.copy_(host, non_blocking=True)
        return lambda: host.copy_(gpu, non_blocking=True)

    def rate(self, nbytes: int, direction: str, reps: int) -> float:
        return nbytes / time_call(self.call(nbytes, direction), reps=reps) / 1e9


# ---------------------------------------------------------------------------
# Providers: name -> (direction, bytes, callable, checker)

def providers(device_pool, pool, host_idx, dev_idx, layer: int):
    host_view = pool.kv_buffer[:, layer]
    host_views = [pool.kv_buffer[:, l] for l in range(LAYERS)]
    dev = device_pool.kv_buffer
    one, every = host_idx.numel() * pool.row_bytes, host_idx.numel() * pool.row_bytes * LAYERS
    host_table = ops.LayerTable(host_views, name="host", written=True)
    dev_table = ops.LayerTable(dev, name="device")

    def check_load(layers):
        def check():
            return all(torch.equal(dev[l][dev_idx].view(torch.int16).cpu(),
                                   pool.kv_buffer[host_idx, l].view(torch.int16)) for l in layers)
        return check

    def check_backup(layers):
        def check():
            return all(torch.equal(pool.kv_buffer[host_idx, l].view(torch.int16),
                                   dev[l][dev_idx].view(torch.int16).cpu()) for l in layers)
        return check

    def pool_call(method, mode, *args):
        def call():
            pool.direct_mode = mode
            getattr(pool, method)(device_pool, host_idx, dev_idx, *args)
        return call

    def per_layer_backup():
        for l in range(LAYERS):
            ops.transfer_one_layer_mla(host_views[l], host_idx, dev[l], dev_idx)

    def all_layer_loads(mode):
        def call():
            pool.direct_mode = mode
            for l in range(LAYERS):
                pool.load_to_device_per_layer(device_pool, host_idx, dev_idx, l, "direct")
        return call

    return {
        # (a) kernel: raw op vs the pool
        "raw-op load (1 layer)": ("h2d", one,
                                  lambda: ops.transfer_one_layer_mla(dev[layer], dev_idx, host_view, host_idx),
                                  check_load([layer])),
        "pool kernel load (1 layer)": ("h2d", one, pool_call("load_to_device_per_layer", "auto", layer, "kernel"),
                                       check_load([layer])),
        "raw-op backup per layer (8 launches)": ("d2h", every, per_layer_backup, check_backup(range(LAYERS))),
        "raw-op backup all-layer (1 launch)": ("d2h", every, lambda: ops.transfer_all_layer(host_table, host_idx,
                                                                                            dev_table, dev_idx),
                                               check_backup(range(LAYERS))),
        "pool kernel backup (all layers)": ("d2h", every, pool_call("backup_from_device_all_layer", "auto", "kernel"),
                                            check_backup(range(LAYERS))),
        # (b) direct, page_first
        "pool direct load (1 layer, batch)": ("h2d", one, pool_call("load_to_device_per_layer", "batch", layer,
                                                                    "direct"), check_load([layer])),
        "pool direct load (1 layer, 2d/run)": ("h2d", one, pool_call("load_to_device_per_layer", "2d", layer,
                                                                     "direct"), check_load([layer])),
        "pool direct load (8 layers, batch)": ("h2d", every, all_layer_loads("batch"), check_load(range(LAYERS))),
        "pool direct backup (all layers, batch)": ("d2h", every, pool_call("backup_from_device_all_layer", "batch",
                                                                           "direct"), check_backup(range(LAYERS))),
        "pool direct backup (all layers, 2d/run)": ("d2h", every, pool_call("backup_from_device_all_layer", "2d",
                                                                            "direct"), check_backup(range(LAYERS))),
    }


def scramble(device_pool, pool, host_idx, dev_idx, layer_set, direction: str) -> None:
    """Zero the rows a provider is about to write (never its source), so its check proves it copied."""
    for l in layer_set:
        if direction == "h2d":
            device_pool.kv_buffer[l][dev_idx] = 0
        else:
            pool.kv_buffer[host_idx, l] = 0


# ---------------------------------------------------------------------------
# Under load: a saturating matmul on another stream

def matmul_stream_run(count: int, a, b, c, stream):
    with torch.cuda.stream(stream):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            torch.matmul(a, b, out=c)
        end.record()
    return start, end


def under_load(fn, nbytes: int, alone_s: float, mm, window_s: float = 0.3) -> dict:
    """Transfer rate while ``count`` matmuls run on another stream, and the matmuls' slowdown."""
    a, b, c, mm_s = mm
    count = max(20, round(window_s / mm_s))
    calls = max(5, round(count * mm_s / alone_s))
    mm_stream, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    alone_start, alone_end = matmul_stream_run(count, a, b, c, mm_stream)
    torch.cuda.synchronize()
    mm_alone = alone_start.elapsed_time(alone_end) / 1e3
    mm_start, mm_end = matmul_stream_run(count, a, b, c, mm_stream)
    with torch.cuda.stream(copy_stream):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
    torch.cuda.synchronize()
    copy_s = start.elapsed_time(end) / 1e3
    mm_with = mm_start.elapsed_time(mm_end) / 1e3
    return {"GBps_under_load": calls * nbytes / copy_s / 1e9, "matmul_slowdown": mm_with / mm_alone - 1,
            "copy_window_s": copy_s, "matmul_window_s": mm_with}


def make_matmul():
    a = torch.randn((MATMUL_N, MATMUL_N), dtype=torch.bfloat16, device="cuda")
    b = torch.randn((MATMUL_N, MATMUL_N), dtype=torch.bfloat16, device="cuda")
    c = torch.empty_like(a)
    mm_s = time_call(lambda: torch.matmul(a, b, out=c), reps=10)
    return a, b, c, mm_s


# ---------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--host-slots", type=int, default=512 * 1024)
    parser.add_argument("--device-slots", type=int, default=256 * 1024)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="small pools and few reps (a sanity run)")
    parser.add_argument("--no-load", action="store_true", help="skip the under-matmul measurements")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_pool needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.quick:
        args.host_slots, args.device_slots, args.reps = 64 * 1024, 32 * 1024, 5
    probe_result = probe(KV_CACHE_DIM * 2)
    device_pool, pool, host_idx, dev_idx, register_s = make_setup(args.host_slots, args.device_slots, args.tokens, 0)
    batch_ok, batch_why = direct.batch_status()
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda_runtime": direct.cuda_runtime().version, "probe": probe_result.as_dict(),
           "pool_path": pool.transfer_path, "pool_path_reason": pool.transfer_path_reason,
           "batch": batch_ok, "batch_reason": batch_why, "host_register_s": round(register_s, 3)}
    print(f"GPU {env['gpu']}, torch {env['torch']}, CUDA runtime {env['cuda_runtime']}")
    print(f"pool: {pool!r}\n  path {pool.transfer_path}: {pool.transfer_path_reason}\n  direct: {batch_why}")
    print(f"  cudaHostRegister of {pool.kv_buffer.nbytes / 1e9:.2f} GB took {register_s:.2f} s")
    config = {"workload": "mla-bf16", "row_bytes": pool.row_bytes, "layers": LAYERS, "page_size": PAGE,
              "tokens": args.tokens, "host_slots": pool.size, "device_slots": args.device_slots,
              "layout": pool.layout}

    ceiling = Ceiling()
    layer = 3
    rows, failed = [], []
    for name, (direction, nbytes, fn, check) in providers(device_pool, pool, host_idx, dev_idx, layer).items():
        needs_kernel = "kernel" in name or name.startswith("raw")
        if needs_kernel and pool.transfer_path != "kernel":
            print(f"  skip {name}: kernel unavailable")
            continue
        if "batch" in name and not batch_ok:
            print(f"  skip {name}: {batch_why}")
            continue
        scramble(device_pool, pool, host_idx, dev_idx, [layer] if "1 layer" in name else range(LAYERS), direction)
        fn()
        torch.cuda.synchronize()
        exact = bool(check())
        if not exact:
            failed.append(name)
        seconds = time_call(fn, reps=args.reps)
        ceil = ceiling.rate(nbytes, direction, args.reps)
        rate = nbytes / seconds / 1e9
        rows.append({"provider": name, "direction": direction, "bytes": nbytes, "seconds": seconds, "GBps": rate,
                     "ceiling_GBps": ceil, "ratio": rate / ceil, "bit_exact": exact})
    by_name = {r["provider"]: r for r in rows}

    print(f"\n{'provider':<42} {'dir':<4} {'MB':>7} {'GB/s':>7} {'ceiling':>8} {'ratio':>6}  exact")
    for r in rows:
        print(f"{r['provider']:<42} {r['direction']:<4} {r['bytes'] / 1e6:7.1f} {r['GBps']:7.1f} "
              f"{r['ceiling_GBps']:8.1f} {r['ratio']:6.2f}  {'yes' if r['bit_exact'] else 'NO'}")

    checks = []

    def target(label, value, goal):
        ok = value >= goal
        checks.append({"target": label, "value": value, "goal": goal, "met": ok})
        print(f"  [{'PASS' if ok else 'MISS'}] {label}: {value:.3f} (goal >= {goal})")

    print("\ntargets")
    for pool_name, raw_name in (("pool kernel load (1 layer)", "raw-op load (1 layer)"),
                                ("pool kernel backup (all layers)", "raw-op backup all-layer (1 launch)")):
        if pool_name in by_name and raw_name in by_name:
            target(f"{pool_name} / {raw_name}", by_name[pool_name]["GBps"] / by_name[raw_name]["GBps"],
                   TARGETS["pool_vs_raw_kernel"])
    for name in ("pool direct load (1 layer, batch)", "pool direct backup (all layers, batch)"):
        if name in by_name:
            target(f"{name} / ceiling", by_name[name]["ratio"], TARGETS["direct_page_first_vs_ceiling"])

    loaded = []
    if not args.no_load:
        mm = make_matmul()
        flops = 2 * MATMUL_N ** 3 / mm[3] / 1e12
        print(f"\nunder load: {MATMUL_N}^3 bf16 matmul alone {mm[3] * 1e3:.2f} ms ({flops:.0f} TFLOP/s), "
              "on another stream")
        cases = []
        nbytes_one = host_idx.numel() * pool.row_bytes
        providers_now = providers(device_pool, pool, host_idx, dev_idx, layer)
        cases.append(("ceiling h2d (contiguous)", "h2d", nbytes_one, ceiling.call(nbytes_one, "h2d")))
        cases.append(("ceiling d2h (contiguous)", "d2h", nbytes_one * LAYERS, ceiling.call(nbytes_one * LAYERS, "d2h")))
        for name in ("pool kernel load (1 layer)", "pool kernel backup (all layers)",
                     "pool direct load (1 layer, batch)", "pool direct backup (all layers, batch)",
                     "pool direct load (1 layer, 2d/run)"):
            if name in by_name:
                direction, nbytes, fn, _ = providers_now[name]
                cases.append((name, direction, nbytes, fn))
        print(f"{'provider':<42} {'alone GB/s':>10} {'loaded GB/s':>11} {'x ceiling':>9} {'matmul slowdown':>16}")
        for name, direction, nbytes, fn in cases:
            alone = time_call(fn, reps=args.reps)
            result = under_load(fn, nbytes, alone, mm)
            base = ceiling.rate(nbytes, direction, args.reps)
            entry = {"provider": name, "direction": direction, "GBps_alone": nbytes / alone / 1e9,
                     "ceiling_alone_GBps": base, "ratio_under_load": result["GBps_under_load"] / base, **result}
            loaded.append(entry)
            print(f"{name:<42} {entry['GBps_alone']:10.1f} {entry['GBps_under_load']:11.1f} "
                  f"{entry['ratio_under_load']:9.2f} {entry['matmul_slowdown'] * 100:15.1f}%")
        by_load = {e["provider"]: e for e in loaded}
        for kernel_name, direct_name in (("pool kernel load (1 layer)", "pool direct load (1 layer, batch)"),
                                         ("pool kernel backup (all layers)", "pool direct backup (all layers, batch)")):
            if kernel_name in by_load and direct_name in by_load:
                k, d = by_load[kernel_name], by_load[direct_name]
                better = "direct" if d["GBps_under_load"] > k["GBps_under_load"] else "kernel"
                print(f"  under load, {direct_name.split(' (')[0].replace('pool direct ', '')}: kernel "
                      f"{k['GBps_under_load']:.1f} GB/s (matmul +{k['matmul_slowdown'] * 100:.1f}%) vs direct "
                      f"{d['GBps_under_load']:.1f} GB/s (matmul +{d['matmul_slowdown'] * 100:.1f}%) -> {better} "
                      f"(auto policy: {choose_io_backend(pool.transfer_path == 'kernel', 'load' if 'load' in kernel_name else 'backup')})")

    report = {"env": env, "config": config, "rows": rows, "targets": checks, "under_load": loaded,
              "failed_checks": failed}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json}")
    if failed:
        print(f"\nFAILED bit-exact checks: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
