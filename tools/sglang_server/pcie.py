"""The PCIe floor of the real-size runs: the contiguous pinned copy's rate, measured in the same call.

    python3 tools/sglang_server/pcie.py --out pcie.json [--mib 1024] [--reps 10]

A host hit cannot load its prefix faster than one contiguous copy of the same bytes from pinned host
memory, so ``prefix bytes / h2d rate`` is the floor that host-hit TTFT is compared with. Random bytes
(never zeros), CUDA-event medians over ``--reps`` copies each way, after two warm-up copies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def measure(mib: int = 1024, reps: int = 10) -> dict:
    import torch

    n = mib << 20
    host = torch.randint(0, 256, (n,), dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {"mib": mib, "reps": reps, "device": torch.cuda.get_device_name()}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for i in range(reps + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end) / 1000.0)
        out[f"{name}_gbps"] = round(n / statistics.median(times) / 1e9, 2)
        out[f"{name}_spread_gbps"] = [round(n / max(times) / 1e9, 2), round(n / min(times) / 1e9, 2)]
    if not torch.equal(dev[:4096].cpu(), host[:4096]):
        raise RuntimeError("the round trip changed the bytes")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    result = measure(args.mib, args.reps)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
