"""``small-copies``: below what copy size does a copy kernel with a CTA budget of 1-2 beat the copy engines?

The direct path submits one descriptor per run of consecutive rows (``direct.CopyPlan``, the runtime's
``cudaMemcpy3DBatchAsync``), and the copy engines pay a fixed cost per descriptor on top of the bytes. A
copy kernel with one or two CTAs pays per byte instead. This workload moves the same bytes both ways at
each copy size (``--total-mib`` per direction, copies placed at random on both sides, random bytes):

* ``copy-engines``: one descriptor per copy through the direct path's batched call;
* ``kernel-qN``: the JIT kernel at ``block_quota`` N, each copy as its rows of ``--row`` bytes;
* ``contiguous``: one copy of the same bytes (the ceiling).

The crossover per direction is the smallest copy size at which the copy engines reach the better of the
kernel's figures; ``route.SMALL_COPY_BYTES`` is that measured number (docs/BENCHMARKS.md).
"""

from __future__ import annotations

from .copy_engine import _gpu_seconds as _seconds  # the same CUDA-event median


def add_arguments(p, name: str) -> None:
    p.add_argument("--total-mib", type=int, default=64, help="bytes per direction per measurement")
    p.add_argument("--row", type=int, default=1152, help="row bytes (the kernel's unit)")
    p.add_argument("--rows-per-copy", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                   help="copy sizes, in rows")
    p.add_argument("--quotas", nargs="+", type=int, default=[1, 2], help="the kernel's CTA budgets")


def run(args, out, name: str) -> int:
    import torch

    from sglang_hicache_jit import ops
    from sglang_hicache_jit.bench.workloads import _fill_random
    from sglang_hicache_jit.transfer import direct

    if not torch.cuda.is_available():
        raise SystemExit("small-copies needs a CUDA GPU")
    torch.cuda.set_stream(torch.cuda.Stream())  # the batch call refuses the legacy NULL stream
    total, row = args.total_mib << 20, args.row
    rows = total // row
    host = torch.empty((2 * rows, row), dtype=torch.uint8, pin_memory=True)
    dev = torch.empty((2 * rows, row), dtype=torch.uint8, device="cuda")
    _fill_random(host, torch)
    _fill_random(dev, torch)
    gen = torch.Generator().manual_seed(0)
    gb = lambda nbytes, t: nbytes / t / 1e9  # noqa: E731
    nbytes = rows * row
    ceiling = {"h2d": gb(nbytes, _seconds(torch, lambda: dev[:rows].copy_(host[:rows], non_blocking=True))),
               "d2h": gb(nbytes, _seconds(torch, lambda: host[:rows].copy_(dev[:rows], non_blocking=True)))}
    out.row(what="contiguous", **{f"{k}_gbps": v for k, v in ceiling.items()})
    print(f"{torch.cuda.get_device_name()}: {nbytes >> 20} MiB per direction, {row}-B rows; contiguous "
          f"h2d {ceiling['h2d']:.1f} GB/s, d2h {ceiling['d2h']:.1f} GB/s", flush=True)
    names = ["copy-engines"] + [f"kernel-q{q}" for q in args.quotas]
    print(f"  {'copy KiB':>8} {'dir':>4} " + " ".join(f"{n:>18}" for n in names), flush=True)
    for k in args.rows_per_copy:
        count = rows // k
        # Copies at random slots of k rows on both sides (host side sorted, as HiCache allocates).
        h_slots = torch.randperm(2 * count, generator=gen)[:count].sort().values
        d_slots = torch.randperm(2 * count, generator=gen)[:count]
        h_idx = (h_slots[:, None] * k + torch.arange(k)).reshape(-1)
        d_idx = (d_slots[:, None] * k + torch.arange(k)).reshape(-1)
        h_cuda, d_cuda = h_idx.cuda(), d_idx.cuda()
        for way in ("h2d", "d2h"):
            dst, dst_idx, src, src_idx = ((dev, d_idx, host, h_idx) if way == "h2d" else (host, h_idx, dev, d_idx))
            dst_cuda, src_cuda = (d_cuda, h_cuda) if way == "h2d" else (h_cuda, d_cuda)
            pairs = direct.Pairs([(dst, src)])
            plan = direct.CopyPlan(pairs, direct.plan_runs(dst_idx, src_idx, k))
            calls = {"copy-engines": lambda: plan.run(pairs)}
            for q in args.quotas:
                calls[f"kernel-q{q}"] = (lambda q=q: ops.transfer_one_layer_mla(dst, dst_cuda, src, src_cuda,
                                                                                 block_quota=q))
            cells = []
            for what, call in calls.items():
                call()
                torch.cuda.synchronize()
                # bit-exact before timing
                assert torch.equal(dst[dst_idx[:4096]].cpu(), src[src_idx[:4096]].cpu()), (what, k, way)
                rate = gb(count * k * row, _seconds(torch, call))
                out.row(what=what, direction=way, copy_bytes=k * row, copies=count, gbps=rate,
                        ratio=rate / ceiling[way], runs=plan.n_runs)
                cells.append(f"{rate:7.1f} ({rate / ceiling[way]:.2f})")
            print(f"  {k * row / 1024:8.1f} {way:>4} " + " ".join(f"{c:>18}" for c in cells), flush=True)
    return 0
