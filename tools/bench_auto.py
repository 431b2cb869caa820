#!/usr/bin/env python3
"""What the pools' ``io_backend="auto"`` should pick: the kernel or the copy engines, by page and call size.

A load is on the critical path (the layer waits for it), so ``auto`` sends it where it is fastest beside
compute; a backup is not. The copy engines' rate grows with the length of one copy (a page of one layer
is one copy in ``page_first_direct``) and with the call's size (the host plans every call), the kernel's
does not; this measures where they cross.

Workload: mla-bf16 rows (1152 B), a ``page_first_direct`` host pool of 8 layers, random whole pages
(host pages sorted, as HiCache allocates), random bytes. For each page size and token count, calls as
SGLang makes them: a load is the per-layer loop (``load_to_device_per_layer`` for layers 0..7, one call
each), a backup one ``backup_from_device_all_layer``; through ``io_backend="kernel"`` (GPU device
indices, as SGLang passes them to the kernel) and ``"direct"`` (CPU indices, as SGLang moves them for its
direct backend). Each is checked bit-exact, then timed:

* alone: CUDA-event medians of calls back to back;
* beside back-to-back bf16 matmuls on another stream: the call's rate and the matmul's slow-down against
  the matmul alone just before.

The contiguous pinned copy of the same bytes (the ceiling) is measured the same two ways in the same run.

    python tools/bench_auto.py [--pages 64 128 256] [--tokens 4096 16384] [--operations load backup]
                               [--backends kernel direct] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_pool import Ceiling, fill_random, make_matmul, time_call, under_load  # noqa: E402
from sglang_hicache_jit.bench.workloads import make_indices  # noqa: E402
from sglang_hicache_jit.host_pool import MLADevicePool, MLAHostKVPool  # noqa: E402

DIM, LAYERS = 576, 8


def host_rows(pool, host_idx: torch.Tensor, layer: int) -> torch.Tensor:
    """The host rows of ``layer`` at ``host_idx``, read from the (pages, L, P, 1, D) host buffer."""
    page = pool.page_size
    return pool.kv_buffer[host_idx // page, layer, host_idx % page]


def calls(pool, device_pool, host_idx, dev_idx, backend: str) -> dict:
    """operation -> (direction, one call of it as SGLang makes it)."""
    def load():
        for layer in range(LAYERS):
            pool.load_to_device_per_layer(device_pool, host_idx, dev_idx, layer, backend)

    def backup():
        pool.backup_from_device_all_layer(device_pool, host_idx, dev_idx, backend)

    return {"load": ("h2d", load), "backup": ("d2h", backup)}


def exact(pool, device_pool, host_idx, dev_idx, operation: str, call) -> bool:
    """Scrambles the side ``call`` writes, runs it once, and compares every layer bit for bit."""
    dev = dev_idx.cuda()
    if operation == "load":
        for layer in device_pool.kv_buffer:
            fill_random(layer)
    else:
        fill_random(pool.kv_buffer)
    call()
    torch.cuda.synchronize()
    return all(torch.equal(device_pool.kv_buffer[l][dev].cpu().view(torch.int16),
                           host_rows(pool, host_idx, l).view(torch.int16)) for l in range(LAYERS))


def measure(page: int, tokens: int, args, mm, ceiling: Ceiling) -> list[dict]:
    device_pool = MLADevicePool([torch.empty((args.device_slots, 1, DIM), dtype=torch.bfloat16, device="cuda")
                                 for _ in range(LAYERS)])
    pool = MLAHostKVPool(device_pool, size=args.host_slots, page_size=page, layout="page_first_direct")
    fill_random(pool.kv_buffer)
    for layer in device_pool.kv_buffer:
        fill_random(layer)
    host_idx, dev_idx = make_indices(tokens, page, args.host_slots, args.device_slots, seed=page + tokens)
    nbytes = tokens * pool.row_bytes * LAYERS
    rows = []
    for operation in args.operations:
        direction = calls(pool, device_pool, host_idx, dev_idx, "direct")[operation][0]
        ceil = ceiling.rate(nbytes, direction, args.reps)
        for backend in ("ceiling", *args.backends):
            if backend == "kernel" and pool.transfer_path != "kernel":
                print(f"  skip kernel: {pool.transfer_path_reason}")
                continue
            ok = True
            if backend == "ceiling":
                call = ceiling.call(nbytes, direction)
            else:
                # GPU device indices for the kernel, CPU ones for the direct path, as SGLang passes them.
                dev = dev_idx.cuda() if backend == "kernel" else dev_idx
                call = calls(pool, device_pool, host_idx, dev, backend)[operation][1]
                ok = exact(pool, device_pool, host_idx, dev_idx, operation, call)
            alone = nbytes / time_call(call, reps=args.reps) / 1e9
            loaded = under_load(call, nbytes, nbytes / alone / 1e9, mm) if mm else {}
            row = {"page": page, "tokens": tokens, "copy_KiB": page * pool.row_bytes / 1024, "operation": operation,
                   "backend": backend, "alone_GBps": alone, "ceiling_GBps": ceil, "alone_ratio": alone / ceil,
                   "bit_exact": ok, "loaded_ratio": loaded.get("GBps_under_load", float("nan")) / ceil,
                   "matmul_slowdown": loaded.get("matmul_slowdown", float("nan"))}
            rows.append(row)
            print(f"p{page:<4} {tokens:>6} {row['copy_KiB']:6.0f} KiB {operation:<6} {backend:<7} alone "
                  f"{alone:6.1f} GB/s x{row['alone_ratio']:.2f}  beside matmul x{row['loaded_ratio']:.2f} "
                  f"{row['matmul_slowdown'] * 100:+.1f}%  exact={'yes' if ok else 'NO'}", flush=True)
    del pool, device_pool
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--host-slots", type=int, default=128 * 1024)
    parser.add_argument("--device-slots", type=int, default=128 * 1024)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--operations", nargs="+", choices=("load", "backup"), default=["load"])
    parser.add_argument("--backends", nargs="+", choices=("kernel", "direct"), default=["kernel", "direct"])
    parser.add_argument("--no-load", action="store_true", help="skip the measurements beside the matmul")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_auto needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    mm = None if args.no_load else make_matmul()
    ceiling = Ceiling()
    rows = [row for page in args.pages for tokens in args.tokens for row in measure(page, tokens, args, mm, ceiling)]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
