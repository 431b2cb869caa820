#!/usr/bin/env python3
"""How fast do the GPU's copy engines move strided rows? One cudaMemcpy2DAsync per measurement
(so host submission cost is out of the picture), for row widths from 256 B to a contiguous block,
host->GPU, GPU->host and GPU->GPU. Explains the direct path's ceiling (docs/host_pool.md).
``flat``: the driver's cuMemcpyBatchAsync on 72 KiB pages, alone and through the direct path.
``streams``: one direction's batch dealt over 1, 2 or 4 streams.
``plan``: the direct path's host-side planning for 64K tokens in 64-token pages, stage by stage (no GPU needed).
``sizes``: the same call by copy size (what run length reaches the kernel's rate), each direction alone
and both at once, beside the contiguous copy and the JIT kernel in the same run."""

import cProfile
import ctypes
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from sglang_hicache_jit.transfer.direct import cuda_runtime  # noqa: E402

MEMCPY_DEFAULT = 4


def main() -> None:
    runtime = cuda_runtime()
    copy2d = runtime.lib.cudaMemcpy2DAsync
    copy2d.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    total = 64 * 2**20   # bytes moved per copy
    pitch = 9216         # a page_first slot of 8 layers x 1152 B
    dev_a = torch.randint(0, 256, (total * pitch // 256,), dtype=torch.uint8, device="cuda")
    host = torch.empty(dev_a.numel(), dtype=torch.uint8, pin_memory=True)
    host.copy_(dev_a)  # random bytes, generated on the GPU
    dev_b = torch.empty_like(dev_a)
    stream = torch.cuda.current_stream().cuda_stream
    print(f"{torch.cuda.get_device_name()}: one cudaMemcpy2DAsync of {total / 2**20:.0f} MiB, strided side pitch {pitch} B")
    print(f"{'width B':>8} {'rows':>8}  {'h2d GB/s':>9} {'d2h GB/s':>9} {'d2d GB/s':>9}")
    for width in (256, 576, 1152, 2048, 4608, pitch):
        rows = total // width
        cases = {
            "h2d": (dev_b.data_ptr(), width, host.data_ptr(), pitch),
            "d2h": (host.data_ptr(), pitch, dev_a.data_ptr(), width),
            "d2d": (dev_b.data_ptr(), width, dev_a.data_ptr(), pitch),
        }
        rates = []
        for dst, dpitch, src, spitch in cases.values():
            times = []
            for _ in range(6):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                code = copy2d(dst, dpitch, src, spitch, width, rows, MEMCPY_DEFAULT, stream)
                end.record()
                end.synchronize()
                runtime.check(code, "cudaMemcpy2DAsync")
                times.append(start.elapsed_time(end) / 1e3)
            rates.append(rows * width / statistics.median(times[1:]) / 1e9)
        print(f"{width:>8} {rows:>8}  {rates[0]:9.1f} {rates[1]:9.1f} {rates[2]:9.1f}", flush=True)


def many_small(copies: int = 256, rows: int = 64, width: int = 1152, pitch: int = 9216) -> None:
    """The direct path's shape: many 2-D copies of one page each. Per-copy cost, and whether
    spreading the copies over several streams engages more copy engines."""
    runtime = cuda_runtime()
    copy2d = runtime.lib.cudaMemcpy2DAsync
    copy1d = runtime.lib.cudaMemcpyAsync
    copy1d.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    span = copies * 2 * rows * pitch  # pages with gaps between them, like scattered host pages
    dev_src = torch.randint(0, 256, (span,), dtype=torch.uint8, device="cuda")
    host = torch.empty(span, dtype=torch.uint8, pin_memory=True)
    host.copy_(dev_src)
    dev = torch.empty(copies * rows * width, dtype=torch.uint8, device="cuda")
    nbytes = copies * rows * width
    print(f"{copies} copies of {rows} rows x {width} B (host pitch {pitch} B), host -> GPU")
    for nstreams in (1, 2, 4, 8):
        streams = [torch.cuda.Stream() for _ in range(nstreams)]
        for kind in ("2d", "1d"):
            times = []
            for _ in range(6):
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for s in streams:
                    s.wait_stream(torch.cuda.current_stream())
                for i in range(copies):
                    s = streams[i % nstreams].cuda_stream
                    src = host.data_ptr() + i * 2 * rows * pitch
                    dst = dev.data_ptr() + i * rows * width
                    if kind == "2d":
                        code = copy2d(dst, width, src, pitch, width, rows, MEMCPY_DEFAULT, s)
                    else:  # the same bytes as one contiguous block per copy
                        code = copy1d(dst, src, rows * width, MEMCPY_DEFAULT, s)
                    runtime.check(code, kind)
                for s in streams:
                    torch.cuda.current_stream().wait_stream(s)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            t = statistics.median(times[1:])
            print(f"  {nstreams} stream(s), {kind}: {nbytes / t / 1e9:6.1f} GB/s, {t / copies * 1e6:5.2f} us per copy",
                  flush=True)




def flat_batch(pages: int = 1024, page_bytes: int = 64 * 1152, layers: int = 8) -> None:
    """The driver's cuMemcpyBatchAsync alone (copies planned beforehand, one call per timing) against the
    direct path's whole call (planning included): where does a batch of page_first_direct pages lose time?"""
    from sglang_hicache_jit.transfer import direct

    torch.cuda.set_stream(torch.cuda.Stream())  # the batch call refuses the legacy NULL stream
    driver = direct.driver_batch()
    host = torch.empty((4 * pages, layers, page_bytes), dtype=torch.uint8, pin_memory=True)
    host.view(-1)[:] = 7
    dev = torch.empty((2 * pages, page_bytes), dtype=torch.uint8, device="cuda")
    gen = torch.Generator().manual_seed(0)
    host_pages = torch.randperm(4 * pages, generator=gen)[:pages].sort().values
    dev_pages = torch.randperm(2 * pages, generator=gen)[:pages]
    stream = torch.cuda.current_stream().cuda_stream
    nbytes = pages * page_bytes
    for order, flags in ((1, 0), (1, 1), (3, 0)):
        driver._attributes.srcAccessOrder, driver._attributes.flags = order, flags
        for name, (dst, src) in {"h2d": (dev.data_ptr() + dev_pages * page_bytes,
                                         host.data_ptr() + host_pages * layers * page_bytes),
                                 "d2h": (host.data_ptr() + host_pages * layers * page_bytes,
                                         dev.data_ptr() + dev_pages * page_bytes)}.items():
            sizes = torch.full((pages,), page_bytes, dtype=torch.int64)
            times = []
            for _ in range(8):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                driver.copy(dst.contiguous(), src.contiguous(), sizes, stream)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            t = statistics.median(times[1:])
            print(f"  driver batch {name} order={order} flags={flags}: {pages} copies of {page_bytes} B "
                  f"{nbytes / t / 1e9:6.1f} GB/s, {t / pages * 1e6:5.2f} us per copy", flush=True)
    driver._attributes.srcAccessOrder, driver._attributes.flags = 1, 0
    rows = host.view(-1, 1152)  # 1152-B rows: layer 0's page p starts at row p * layers * 64
    for count in (pages // 4, pages):  # 16K and 64K tokens
        host_idx = (host_pages[:count, None] * layers * 64 + torch.arange(64)).reshape(-1)
        dev_idx = (dev_pages[:count, None] * 64 + torch.arange(64)).reshape(-1)
        pairs = direct.Pairs([(dev.view(-1, 1152), rows)])
        for _ in range(3):
            direct.copy_rows(pairs, dev_idx, host_idx)
        torch.cuda.synchronize()
        start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start_ev.record()
        for _ in range(20):
            direct.copy_rows(pairs, dev_idx, host_idx)
        end_ev.record()
        host_s = (time.perf_counter() - t0) / 20
        end_ev.synchronize()
        gpu_s = start_ev.elapsed_time(end_ev) / 1e3 / 20
        print(f"  copy_rows h2d, {count} pages, 20 calls back to back: host {host_s * 1e6:7.1f} us per call, "
              f"GPU {gpu_s * 1e6:7.1f} us per call ({count * page_bytes / gpu_s / 1e9:5.1f} GB/s)", flush=True)
    # Where the host's time goes in the last configuration
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(20):
        direct.copy_rows(pairs, dev_idx, host_idx)
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)

def _gpu_seconds(launch, reps: int = 8) -> float:
    """Median GPU time of ``launch()`` by CUDA events on the current stream, after one warm-up call."""
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[1:])


def _both_ways(h2d, d2h, reps: int = 8) -> float:
    """Median wall time (CUDA events) of ``h2d()`` and ``d2h()`` issued together on two side streams."""
    main = torch.cuda.current_stream()
    streams = (torch.cuda.Stream(), torch.cuda.Stream())

    def launch():
        for stream, work in zip(streams, (h2d, d2h)):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                work()
        for stream in streams:
            main.wait_stream(stream)
    return _gpu_seconds(launch, reps)


def sizes_sweep(total: int = 64 * 2**20, row: int = 1152) -> None:
    """One cuMemcpyBatchAsync call moving ``total`` bytes in copies of 8 rows to 4 MiB, pages placed at
    random on both sides (host side sorted, as HiCache allocates), random bytes. Each direction alone
    and both at once (two streams), against one contiguous copy of the same bytes and the JIT kernel
    moving the same bytes as rows (page 64), all in this run."""
    from sglang_hicache_jit.transfer import direct
    from sglang_hicache_jit import ops

    torch.cuda.set_stream(torch.cuda.Stream())  # the batch call refuses the legacy NULL stream
    driver = direct.driver_batch()
    if driver is None:
        print(f"no driver batch call here: {direct.batch_status()[1]}")
        return
    host = torch.empty(2 * total, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.randint(0, 256, (2 * total,), dtype=torch.uint8, device="cuda"))
    dev = torch.randint(0, 256, (2 * total,), dtype=torch.uint8, device="cuda")
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    gb = lambda nbytes, t: nbytes / t / 1e9  # noqa: E731

    # The ceiling: one contiguous copy of the same bytes, each way and both at once.
    h_flat, d_flat = host[:total], dev[:total]
    d_flat2, h_flat2 = dev[total:], host[total:]
    ceiling = {"h2d": gb(total, _gpu_seconds(lambda: d_flat.copy_(h_flat, non_blocking=True))),
               "d2h": gb(total, _gpu_seconds(lambda: h_flat2.copy_(d_flat2, non_blocking=True))),
               "both": gb(2 * total, _both_ways(lambda: d_flat.copy_(h_flat, non_blocking=True),
                                                lambda: h_flat2.copy_(d_flat2, non_blocking=True)))}
    print(f"{torch.cuda.get_device_name()}: {total >> 20} MiB per direction; contiguous copy "
          f"h2d {ceiling['h2d']:.1f}, d2h {ceiling['d2h']:.1f}, both {ceiling['both']:.1f} GB/s", flush=True)

    # The kernel on the same bytes: rows of ``row`` B, random pages of 64 rows. Each direction has its own
    # pages on both sides (a permutation split in halves), so running both at once races on nothing.
    rows = total // row
    pages = rows // 64
    host_rows, dev_rows = host[:2 * rows * row].view(-1, row), dev[:2 * rows * row].view(-1, row)

    def page_rows(page_ids, sort):
        page_ids = page_ids.sort().values if sort else page_ids
        return (page_ids[:, None] * 64 + torch.arange(64)).reshape(-1).cuda()
    host_pages, dev_pages = torch.randperm(2 * pages, generator=gen), torch.randperm(2 * pages, generator=gen)
    h_in, h_out = page_rows(host_pages[:pages], True), page_rows(host_pages[pages:], True)
    d_in, d_out = page_rows(dev_pages[:pages], False), page_rows(dev_pages[pages:], False)
    kernel = {"h2d": lambda: ops.transfer_one_layer_mla(dev_rows, d_in, host_rows, h_in),
              "d2h": lambda: ops.transfer_one_layer_mla(host_rows, h_out, dev_rows, d_out)}
    k = {name: gb(total, _gpu_seconds(fn)) for name, fn in kernel.items()}
    k["both"] = gb(2 * total, _both_ways(kernel["h2d"], kernel["d2h"]))
    print(f"  jit kernel, {row}-B rows, page 64:         h2d {k['h2d']:5.1f} ({k['h2d'] / ceiling['h2d']:.2f})"
          f"  d2h {k['d2h']:5.1f} ({k['d2h'] / ceiling['d2h']:.2f})  both {k['both']:5.1f} "
          f"({k['both'] / ceiling['both']:.2f})", flush=True)

    print(f"  {'copy KiB':>8} {'copies':>6}  {'h2d GB/s':>13} {'d2h GB/s':>13} {'both GB/s':>13} {'us/copy h2d':>11} {'host us/copy':>12}")
    for size in (8 * row, 16 * row, 32 * row, 64 * row, 128 * row, 256 * row, 512 * row, 1024 * row,
                 4096 * row):
        count = total // size
        # the host side's copies in address order (a sorted allocation), the device side's at random;
        # each direction on its own half of the slots, so both at once race on nothing
        h_slots, d_slots = torch.randperm(2 * count, generator=gen), torch.randperm(2 * count, generator=gen)
        hc_in, hc_out = (host.data_ptr() + h_slots[:count].sort().values * size,
                         host.data_ptr() + h_slots[count:].sort().values * size)
        dc_in, dc_out = dev.data_ptr() + d_slots[:count] * size, dev.data_ptr() + d_slots[count:] * size
        lengths = torch.full((count,), size, dtype=torch.int64)
        h2d = lambda: driver.copy(dc_in, hc_in, lengths, stream())  # noqa: E731
        d2h = lambda: driver.copy(hc_out, dc_out, lengths, stream())  # noqa: E731
        t_h2d, t_d2h = _gpu_seconds(h2d), _gpu_seconds(d2h)
        # The host's share: how long the call itself takes to return (the GPU idle before it, so the
        # copies cannot start until submitted), median of 8.
        submit = []
        for _ in range(8):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h2d()
            submit.append(time.perf_counter() - t0)
        host_us = statistics.median(submit) / count * 1e6
        rates = {"h2d": gb(count * size, t_h2d), "d2h": gb(count * size, t_d2h),
                 "both": gb(2 * count * size, _both_ways(h2d, d2h))}
        cells = "".join(f" {rates[n]:6.1f} ({rates[n] / ceiling[n]:.2f})" for n in ("h2d", "d2h", "both"))
        print(f"  {size / 1024:8.1f} {count:6d} {cells} {t_h2d / count * 1e6:11.2f} {host_us:12.2f}", flush=True)


def planning(pages: int = 1024, page_rows: int = 64, row: int = 1152) -> None:
    """Host time of each planning stage of ``direct.copy_rows`` for ``pages`` random pages of one packed
    pair (CPU indices, as HiCache's host side has them), median of 50 calls each; no GPU is touched."""
    from sglang_hicache_jit.transfer import direct

    gen = torch.Generator().manual_seed(0)
    host_pages = torch.randperm(4 * pages, generator=gen)[:pages].sort().values
    dev_pages = torch.randperm(2 * pages, generator=gen)[:pages]
    host_idx = (host_pages[:, None] * page_rows + torch.arange(page_rows)).reshape(-1)
    dev_idx = (dev_pages[:, None] * page_rows + torch.arange(page_rows)).reshape(-1)
    pairs = direct.Pairs([(direct.Rows.at(1 << 40, row, row, 0, 2 * pages * page_rows),
                           direct.Rows.at(1 << 41, row, row, 0, 4 * pages * page_rows))])

    def median_us(fn):
        times = []
        for _ in range(51):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:]) * 1e6

    runs = direct.find_runs(dev_idx, host_idx)
    split = direct.split_runs(runs, max(1, direct.MAX_COPY_BYTES // row))
    words = direct.describe_copies(pairs, split)
    flat = pairs.packed.repeat_interleave(len(split))
    stages = {
        "find_runs": lambda: direct.find_runs(dev_idx, host_idx),
        "plan_runs (pages)": lambda: direct.plan_runs(dev_idx, host_idx, page_rows),
        "check_bounds": lambda: direct.check_bounds(runs, pairs.dst_rows, pairs.src_rows),
        "split_runs": lambda: direct.split_runs(runs, max(1, direct.MAX_COPY_BYTES // row)),
        "describe_copies": lambda: direct.describe_copies(pairs, split),
        "flat columns": lambda: (words[flat][:, direct._word("dst.ptr")].contiguous(), words[~flat].contiguous()),
    }
    print(f"planning {pages} pages of {page_rows} x {row} B ({pages * page_rows} indices), torch threads "
          f"{torch.get_num_threads()}:")
    for name, fn in stages.items():
        print(f"  {name:<16} {median_us(fn):8.1f} us", flush=True)


def split_streams(total: int = 64 * 2**20, row: int = 1152) -> None:
    """One direction's batch split over 1, 2 or 4 streams (one batch call each, the copies dealt round
    robin): does a second copy engine take the fixed per-copy cost in parallel?"""
    from sglang_hicache_jit.transfer import direct

    torch.cuda.set_stream(torch.cuda.Stream())
    driver = direct.driver_batch()
    host = torch.empty(2 * total, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.randint(0, 256, (2 * total,), dtype=torch.uint8, device="cuda"))
    dev = torch.randint(0, 256, (2 * total,), dtype=torch.uint8, device="cuda")
    gen = torch.Generator().manual_seed(0)
    ceiling = total / _gpu_seconds(lambda: dev[:total].copy_(host[:total], non_blocking=True)) / 1e9
    print(f"contiguous h2d {ceiling:.1f} GB/s")
    for size in (32 * row, 64 * row, 128 * row):
        count = total // size
        h_off = torch.randperm(2 * count, generator=gen)[:count].sort().values * size
        d_off = torch.randperm(2 * count, generator=gen)[:count] * size
        for direction in ("h2d", "d2h"):
            dst, src = ((dev.data_ptr() + d_off, host.data_ptr() + h_off) if direction == "h2d"
                        else (host.data_ptr() + h_off, dev.data_ptr() + d_off))
            for nstreams in (1, 2, 4):
                streams = [torch.cuda.Stream() for _ in range(nstreams)]
                parts = [(dst[i::nstreams].contiguous(), src[i::nstreams].contiguous(),
                          torch.full((len(range(i, count, nstreams)),), size, dtype=torch.int64))
                         for i in range(nstreams)]
                main = torch.cuda.current_stream()

                def launch():
                    for stream, (d, s_, n) in zip(streams, parts):
                        stream.wait_stream(main)
                        driver.copy(d, s_, n, stream.cuda_stream)
                    for stream in streams:
                        main.wait_stream(stream)
                rate = count * size / _gpu_seconds(launch) / 1e9
                print(f"  {size / 1024:6.1f} KiB x {count:4d} {direction} over {nstreams} stream(s): {rate:5.1f} GB/s "
                      f"({rate / ceiling:.2f})", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["flat"]:
        flat_batch()
    elif sys.argv[1:] == ["sizes"]:
        sizes_sweep()
    elif sys.argv[1:] == ["streams"]:
        split_streams()
    elif sys.argv[1:] == ["plan"]:
        planning()
    else:
        main()
        many_small()
