#!/usr/bin/env python3
"""Host time per call of SGLang's own MLA host pool, through the plugin or unpatched, on any release 0.5.16+.

Run it twice per release, in separate processes (the plugin patches process-wide state):

    python3 tools/bench_pool_calls.py --label plugin
    SGLANG_HICACHE_JIT_SGLANG_PLUGIN=0 python3 tools/bench_pool_calls.py --label unpatched

with the release's code and an sgl_kernel on PYTHONPATH (tools/gpu_sglang.sh sets them). The pool is
built as tests/sglang_cells.py builds it for that release: mla-bf16 rows (1152 B), page_first, 4
layers, page 16. Each sample times ``calls`` back-to-back calls on the host clock (the GPU work of
a call, 64 tokens, is shorter than the host's part, so the host is what is measured): a
load_to_device_per_layer of one layer and a backup_from_device_all_layer of all layers, with
io_backend='kernel'. Rounds alternate the two operations; the median over rounds is reported,
with the spread. Unpatched, the pool runs SGLang's own JIT kernels (built on first use with
apache-tvm-ffi, before timing starts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

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
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
