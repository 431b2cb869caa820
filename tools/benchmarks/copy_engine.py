"""``plan-cost`` and ``copy-sizes``: the direct (copy-engine) path, studied alone.

* ``plan-cost`` (CPU, no GPU touched): host time of each planning stage of ``direct.copy_rows`` for
  ``--pages`` random pages of one packed pair (CPU indices, as HiCache's host side has them), median of
  50 calls each, and what a later layer of a load pays instead: a hit in route.py's plan cache (the index
  bytes compared); and the plan of one chunk of a staged backup (made per chunk of every backup).
* ``copy-sizes`` (GPU): one ``cudaMemcpy3DBatchAsync`` call (what the direct path submits; the driver's
  ``cuMemcpyBatchAsync`` is never called, docs/troubleshooting.md) moving 64 MiB in copies of 8 rows to 4 MiB, pages
  placed at random on both sides (host side sorted, as HiCache allocates), random bytes. Each direction
  alone and both at once (two streams), against one contiguous copy of the same bytes and the JIT kernel
  moving the same bytes as rows (page 64), all in the same run: what copy size reaches the link.
"""

from __future__ import annotations

import statistics
import time


def add_arguments(p, name: str) -> None:
    if name == "plan-cost":
        p.add_argument("--pages", type=int, default=1024)
        p.add_argument("--page-rows", type=int, default=64)
    else:
        p.add_argument("--total-mib", type=int, default=64, help="bytes per direction per measurement")
    p.add_argument("--row", type=int, default=1152, help="row bytes")


def run(args, out, name: str) -> int:
    return planning(args, out) if name == "plan-cost" else sizes(args, out)


def planning(args, out) -> int:
    import torch

    from sglang_hicache_jit.transfer import direct, route

    pages, page_rows, row = args.pages, args.page_rows, args.row
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
    cache = route.PlanCache()
    make = lambda dst, src: direct.CopyPlan(pairs, direct.runs_of(dst, src, page_rows))  # noqa: E731
    cache.get(dev_idx, host_idx, "load", make)  # the first layer's plan: later calls hit it
    stages = {
        "find_runs": lambda: direct.find_runs(dev_idx, host_idx),
        "plan_runs (pages)": lambda: direct.plan_runs(dev_idx, host_idx, page_rows),
        "check_bounds": lambda: direct.check_bounds(runs, pairs.dst_rows, pairs.src_rows),
        "split_runs": lambda: direct.split_runs(runs, max(1, direct.MAX_COPY_BYTES // row)),
        "describe_copies": lambda: direct.describe_copies(pairs, split),
        "plan cache hit": lambda: cache.get(dev_idx, host_idx, "load", make),
    }
    # A staged backup (transfer/staging.py, plan_chunks): runs of host token blocks against the staged blocks
    # of both buffers, planned once per backup (nothing to reuse: the host slots differ), here an 8,192-token
    # backup through SGLang's staging buffers for a Llama-3.1-8B-shaped pool (chunks of 2,048 tokens of
    # 32 x 2 KiB, K and V) whose host slots are consecutive pages, as HiCache's allocator hands them.
    from sglang_hicache_jit.transfer import staging

    chunk, block = 2048, 32 * 2048
    staged_pairs = direct.Pairs([(direct.Rows.at((1 << 42) + c * (1 << 40), block, block, 0, 32 * 4 * chunk),
                                  direct.Rows.at((1 << 41) + c * (1 << 36), block, block, 0, 2 * chunk))
                                 for c in range(2)])
    backup_blocks = torch.arange(5 * chunk, 9 * chunk)
    stages["staged backup plan (8192 tokens, 4 chunks, K and V)"] = lambda: staging.plan_chunks(
        staged_pairs, backup_blocks, chunk, 1 << 20)
    # The baseline it replaced: one plan per chunk of 2,048 blocks against one buffer, four per backup.
    stages["staged backup, a plan per chunk (4 x 2048)"] = lambda: [
        direct.CopyPlan(staged_pairs, direct.find_runs(backup_blocks[c:c + chunk], torch.arange(chunk)))
        for c in range(0, 4 * chunk, chunk)]
    print(f"planning {pages} pages of {page_rows} x {row} B ({pages * page_rows} indices), torch threads "
          f"{torch.get_num_threads()}:")
    for stage, fn in stages.items():
        us = median_us(fn)
        out.row(stage=stage, us=us, pages=pages, page_rows=page_rows, row_bytes=row)
        print(f"  {stage:<40} {us:8.1f} us", flush=True)
    return 0


def _gpu_seconds(torch, launch, reps: int = 8) -> float:
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


def _both_ways(torch, h2d, d2h, reps: int = 8) -> float:
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
    return _gpu_seconds(torch, launch, reps)


def sizes(args, out) -> int:
    import torch

    from sglang_hicache_jit import ops
    from sglang_hicache_jit.bench.workloads import _fill_random
    from sglang_hicache_jit.transfer import cuda, direct

    if not torch.cuda.is_available():
        raise SystemExit("copy-sizes needs a CUDA GPU")
    total, row = args.total_mib << 20, args.row
    torch.cuda.set_stream(torch.cuda.Stream())  # the batch call refuses the legacy NULL stream
    if not direct.batch_status()[0]:
        print(f"no batch call here: {direct.batch_status()[1]}")
        return 1
    runtime = cuda.cuda_runtime()
    host = torch.empty(2 * total, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    _fill_random(host, torch)
    _fill_random(dev, torch)
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    gb = lambda nbytes, t: nbytes / t / 1e9  # noqa: E731

    # The ceiling: one contiguous copy of the same bytes, each way and both at once.
    h_flat, d_flat = host[:total], dev[:total]
    d_flat2, h_flat2 = dev[total:], host[total:]
    ceiling = {"h2d": gb(total, _gpu_seconds(torch, lambda: d_flat.copy_(h_flat, non_blocking=True))),
               "d2h": gb(total, _gpu_seconds(torch, lambda: h_flat2.copy_(d_flat2, non_blocking=True))),
               "both": gb(2 * total, _both_ways(torch, lambda: d_flat.copy_(h_flat, non_blocking=True),
                                                lambda: h_flat2.copy_(d_flat2, non_blocking=True)))}
    out.row(what="contiguous", **{f"{k}_gbps": v for k, v in ceiling.items()})
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
    k = {name: gb(total, _gpu_seconds(torch, fn)) for name, fn in kernel.items()}
    k["both"] = gb(2 * total, _both_ways(torch, kernel["h2d"], kernel["d2h"]))
    out.row(what="kernel", page=64, **{f"{n}_gbps": k[n] for n in k}, **{f"{n}_ratio": k[n] / ceiling[n] for n in k})
    print(f"  jit kernel, {row}-B rows, page 64:         h2d {k['h2d']:5.1f} ({k['h2d'] / ceiling['h2d']:.2f})"
          f"  d2h {k['d2h']:5.1f} ({k['d2h'] / ceiling['d2h']:.2f})  both {k['both']:5.1f} "
          f"({k['both'] / ceiling['both']:.2f})", flush=True)

    print(f"  {'copy KiB':>8} {'copies':>6}  {'h2d GB/s':>13} {'d2h GB/s':>13} {'both GB/s':>13} {'us/copy h2d':>11} "
          f"{'host us/copy':>12}")
    for size in (8 * row, 16 * row, 32 * row, 64 * row, 128 * row, 256 * row, 512 * row, 1024 * row, 4096 * row):
        count = total // size
        # the host side's copies in address order (a sorted allocation), the device side's at random;
        # each direction on its own half of the slots, so both at once race on nothing
        h_slots, d_slots = torch.randperm(2 * count, generator=gen), torch.randperm(2 * count, generator=gen)
        # One copy of ``size`` bytes per slot: both sides as rows of ``size`` bytes, one run of one row each.
        slots = direct.Pairs([(direct.Rows.at(dev.data_ptr(), size, size, dev.device.index, 2 * count),
                               direct.Rows.at(host.data_ptr(), size, size, dev.device.index, 2 * count))])
        back = direct.Pairs([(slots.src[0], slots.dst[0])])
        one = torch.ones(count, dtype=torch.int64)
        h2d_words = direct.describe_copies(slots, direct.Runs(d_slots[:count], h_slots[:count].sort().values, one))
        d2h_words = direct.describe_copies(back, direct.Runs(h_slots[count:].sort().values, d_slots[count:], one))
        h2d = lambda: runtime.memcpy_batch(h2d_words, stream())  # noqa: E731
        d2h = lambda: runtime.memcpy_batch(d2h_words, stream())  # noqa: E731
        t_h2d, t_d2h = _gpu_seconds(torch, h2d), _gpu_seconds(torch, d2h)
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
                 "both": gb(2 * count * size, _both_ways(torch, h2d, d2h))}
        out.row(what="batch", copy_bytes=size, copies=count, **{f"{n}_gbps": v for n, v in rates.items()},
                **{f"{n}_ratio": v / ceiling[n] for n, v in rates.items()}, gpu_us_per_copy_h2d=t_h2d / count * 1e6,
                host_us_per_copy=host_us)
        cells = "".join(f" {rates[n]:6.1f} ({rates[n] / ceiling[n]:.2f})" for n in ("h2d", "d2h", "both"))
        print(f"  {size / 1024:8.1f} {count:6d} {cells} {t_h2d / count * 1e6:11.2f} {host_us:12.2f}", flush=True)
    return 0
