#!/usr/bin/env python3
"""How fast do the GPU's copy engines move strided rows? One cudaMemcpy2DAsync per measurement
(so host submission cost is out of the picture), for row widths from 256 B to a contiguous block,
host->GPU, GPU->host and GPU->GPU. Explains the direct path's ceiling (docs/host_pool.md).
``flat``: the driver's cuMemcpyBatchAsync on 72 KiB pages, alone and through the direct path."""

import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from sglang_hicache_jit.direct import cuda_runtime  # noqa: E402

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
    from sglang_hicache_jit import direct

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
    host_idx = (host_pages[:, None] * layers * 64 + torch.arange(64)).reshape(-1)
    dev_idx = (dev_pages[:, None] * 64 + torch.arange(64)).reshape(-1)
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
    print(f"  copy_rows h2d, {pages} pages: host {host_s * 1e6:7.1f} us per call, GPU {gpu_s * 1e6:7.1f} us per call "
          f"({nbytes / gpu_s / 1e9:5.1f} GB/s)", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["flat"]:
        flat_batch()
    else:
        main()
        many_small()
