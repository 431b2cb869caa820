"""``copy-queue`` (GPU): how long a small copy on another stream waits behind a transfer's large copies.

SGLang's scheduler copies each step's sampled tokens to the host (a few KiB, device to host) on its compute
stream while HiCache's write stream sends a backup to the host. The staged backup sends each run of
consecutive host pages as one copy (up to ``direct.MAX_COPY_BYTES``: 128 MiB per cache for a 2,048-token chunk
of a Llama-3.1-8B-sized pool whose host pages are consecutive); upstream SGLang sends one copy per page (4 MiB
there). If a copy engine serves a small copy only once the large copy ahead of it is done, every large copy
can hold a token back for its whole duration. This measures it, in one run for every piece size:

* ``--total-mib`` of random bytes moved on one stream (device to host, host to device, per ``--directions``),
  cut into copies of each ``--piece-mib`` (``0``: no large transfer, the baseline);
* meanwhile, on a second stream, ``--small-kib`` copies in the same direction, one issued every
  ``--gap-us`` from the host, each timed by CUDA events around it (the time it took, waits included);
* per piece size: the small copies' median, p90 and largest latency, and the large transfer's GB/s
  (what cutting it costs), over ``--reps`` runs;
* per ``--between`` mode: what the large transfer's stream holds between two pieces: ``none`` (the pieces
  back to back), ``event`` (an event recorded) or ``kernel`` (a one-element add). Copy engines are reported
  to serve a stream's ready copies back to back before another stream's, and to let other streams in when
  a small compute op separates them (torchrec's copy-engine contention study): this measures it here.
"""

from __future__ import annotations

import statistics
import time


def add_arguments(p, name: str) -> None:
    p.add_argument("--total-mib", type=int, default=512, help="bytes of the large transfer, per run")
    p.add_argument("--piece-mib", type=float, nargs="+", default=[0, 512, 128, 32, 8, 4, 1],
                   help="copy sizes the large transfer is cut into (0: no large transfer, the baseline)")
    p.add_argument("--small-kib", type=int, default=4, help="bytes of each small copy")
    p.add_argument("--gap-us", type=int, default=200, help="host time between two small copies")
    p.add_argument("--directions", nargs="+", choices=("d2h", "h2d"), default=["d2h", "h2d"])
    p.add_argument("--reps", type=int, default=3, help="runs per piece size")
    p.add_argument("--between", nargs="+", choices=("none", "event", "kernel"), default=["none", "event", "kernel"],
                   help="what the large transfer's stream holds between two pieces")


def _percentile(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args, out, name: str) -> int:
    import torch

    from sglang_hicache_jit.bench.workloads import _fill_random

    if not torch.cuda.is_available():
        print("copy-queue needs a GPU")
        return 2
    if args.total_mib < 1 or args.small_kib < 1 or args.gap_us < 0 or args.reps < 1 or min(args.piece_mib) < 0:
        print("--total-mib, --small-kib and --reps must be positive, --gap-us and --piece-mib not negative")
        return 2
    total = args.total_mib << 20
    small = args.small_kib << 10
    device = torch.empty(total + small, dtype=torch.uint8, device="cuda")
    host = torch.empty(total + small, dtype=torch.uint8, pin_memory=True)
    _fill_random(device, torch)
    _fill_random(host, torch)
    big_stream, small_stream = torch.cuda.Stream(), torch.cuda.Stream()
    scratch = torch.zeros(1, device="cuda")
    print(f"{args.total_mib} MiB cut into pieces on one stream, {args.small_kib} KiB copies every {args.gap_us} us "
          f"on another; latency of the small copies (us) and the large transfer's rate:")
    for direction in args.directions:
        # The small copies use their own bytes past the large transfer's, so the two never touch.
        if direction == "d2h":
            big_dst, big_src, small_dst, small_src = host[:total], device[:total], host[total:], device[total:]
        else:
            big_dst, big_src, small_dst, small_src = device[:total], host[:total], device[total:], host[total:]
        cases = [(0, "none")] if 0 in args.piece_mib else []
        cases += [(p, between) for p in args.piece_mib if p > 0 for between in args.between]
        for piece_mib, between in cases:
            piece = int(piece_mib * (1 << 20))
            latencies, rates = [], []
            big_dst.zero_()  # what the copies must overwrite, checked after the runs
            for _ in range(args.reps):
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if piece > 0:
                    with torch.cuda.stream(big_stream):
                        start.record()
                        for first in range(0, total, piece):
                            big_dst[first:first + piece].copy_(big_src[first:first + piece], non_blocking=True)
                            if between == "event":
                                torch.cuda.Event().record()
                            elif between == "kernel":
                                scratch.add_(1)
                        end.record()
                timed = []
                issued = 0
                # Small copies while the large transfer runs (or 64 of them without one).
                while (not end.query()) if piece > 0 else issued < 64:
                    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    with torch.cuda.stream(small_stream):
                        before.record()
                        small_dst.copy_(small_src, non_blocking=True)
                        after.record()
                    timed.append((before, after))
                    issued += 1
                    time.sleep(args.gap_us / 1e6)
                torch.cuda.synchronize()
                latencies += [b.elapsed_time(a) * 1e3 for b, a in timed]
                if piece > 0:
                    rates.append(total / (start.elapsed_time(end) / 1e3) / 1e9)
            if not latencies:
                print(f"  {direction} pieces {piece_mib:g} MiB, {between}: the transfer ended before a small copy went")
                continue
            if piece > 0 and not torch.equal(big_dst.to(big_src.device), big_src):
                print(f"{direction} pieces of {piece_mib} MiB: the large transfer's bytes differ")
                return 1
            record = out.row(direction=direction, piece_mib=piece_mib, between=between, total_mib=args.total_mib,
                             small_kib=args.small_kib, gap_us=args.gap_us, n=len(latencies),
                             small_us_median=statistics.median(latencies), small_us_p90=_percentile(latencies, 0.9),
                             small_us_max=max(latencies), gbps=statistics.median(rates) if rates else None)
            rate = f"{record['gbps']:6.2f} GB/s" if rates else "   (none)  "
            print(f"  {direction} pieces {piece_mib:>6g} MiB, {between:<6}: {rate} | small copies median "
                  f"{record['small_us_median']:8.1f}  p90 {record['small_us_p90']:8.1f}  max "
                  f"{record['small_us_max']:8.1f} us (n={len(latencies)})", flush=True)
    return 0
