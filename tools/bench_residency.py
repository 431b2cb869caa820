#!/usr/bin/env python3
"""What does keeping copy CTAs resident cost the compute beside them?

For each load (a saturating bf16 matmul, an fp32 matmul, decode-like steps) the
load runs alone, then beside the resident copy kernel of the 'resident' method
kept alive but idle (R CTAs, no transfers), then beside a stream of small
(64-token) resident transfers. The slow-down isolates the cost of the SMs the
resident CTAs hold from the cost of the copies themselves. Needs a GPU.
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from sglang_hicache_jit import ops, settings  # noqa: E402


def loads():
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    c = torch.empty_like(a)
    f = torch.randn(4096, 4096, device="cuda")
    fc = torch.empty_like(f)
    s = torch.randn(64, 8192, dtype=torch.bfloat16, device="cuda")
    sc = torch.empty_like(s)

    def decode():
        for _ in range(16):
            torch.mm(s, a, out=sc)
        torch.cuda._sleep(200_000)
    return {"matmul-bf16-8192": lambda: torch.mm(a, a, out=c), "matmul-fp32-4096": lambda: torch.mm(f, f, out=fc),
            "decode-steps": decode}


def timed(load, reps):
    g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g0.record()
    for _ in range(reps):
        load()
    g1.record()
    return g0, g1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--seconds", type=float, default=0.2)
    p.add_argument("--json")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    host = torch.randint(0, 256, (4096, 1152), dtype=torch.uint8).pin_memory()
    dev = torch.empty((4096, 1152), dtype=torch.uint8, device="cuda")
    idx = torch.arange(64, device="cuda")
    records = []
    os.environ[settings.RESIDENT_IDLE_US] = str(60_000_000)  # stays until stopped
    for name, load in loads().items():
        load()
        torch.cuda.synchronize()
        g0, g1 = timed(load, 5)
        g1.synchronize()
        reps = max(5, int(args.seconds / (g0.elapsed_time(g1) / 1e3 / 5)))
        for blocks in args.blocks:
            for mode in ("idle", "small transfers"):
                ops.stop_resident()
                os.environ[settings.RESIDENT_BLOCKS] = str(blocks)
                g0, g1 = timed(load, reps)  # alone, right before (clocks drift as the GPU heats)
                g1.synchronize()
                alone = g0.elapsed_time(g1) / reps
                ops.transfer_one_layer_mla(dev, idx, host, idx, method="resident")  # starts the kernel
                torch.cuda.current_stream().synchronize()  # the transfer, not the kernel: it stays
                side = torch.cuda.Stream()
                g0, g1 = timed(load, reps)
                count = 0
                if mode == "small transfers":
                    with torch.cuda.stream(side):
                        while not g1.query():
                            ops.transfer_one_layer_mla(dev, idx, host, idx, method="resident")
                            count += 1
                            if count % 8 == 0:
                                side.synchronize()
                g1.synchronize()
                loaded = g0.elapsed_time(g1) / reps
                ops.stop_resident()
                rec = dict(load=name, blocks=blocks, mode=mode, alone_ms=alone, loaded_ms=loaded,
                           slowdown=loaded / alone - 1, transfers=count, device=torch.cuda.get_device_name())
                records.append(rec)
                print(f"{name:<18} R={blocks:<2} {mode:<16} alone {alone:7.3f} ms  beside {loaded:7.3f} ms  "
                      f"+{rec['slowdown'] * 100:5.1f}%  (transfers {count})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
