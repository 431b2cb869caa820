#!/usr/bin/env python3
"""How fast do the GPU's copy engines move strided rows? One cudaMemcpy2DAsync per measurement
(so host submission cost is out of the picture), for row widths from 256 B to a contiguous block,
host->GPU, GPU->host and GPU->GPU. Explains the direct path's ceiling (docs/host_pool.md)."""

import ctypes
import statistics
import sys
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


if __name__ == "__main__":
    main()
