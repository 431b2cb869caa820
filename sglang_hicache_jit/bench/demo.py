"""``sglang-hicache-jit demo``: a DeepSeek-V3-shaped HiCache round trip on this machine.

It builds an MLA device pool (kv_cache_dim 576, bf16: 1152-byte rows) and a
``page_first`` host pool with pages of 64 tokens, then backs up and loads
random whole pages through the path the probe picks and through the other
one, checks every copied row bit-exactly, and reports GB/s beside the ceiling
(one contiguous copy of the same bytes, same direction, measured in the same
run). Without a GPU it runs the direct path on CPU tensors and says so: the
bit-exact checks still hold there, but its rates are not meaningful (memory
copies between CPU tensors, not transfers over a link), so they are not shown.

Before it allocates anything it checks that the pools fit in this machine's
free memory (``check_tokens``), and while it runs it reports each step to a
``progress`` callback (the CLI prints them to stderr): a first run compiles the
kernel, and the whole demo takes 5-40 s.
"""

from __future__ import annotations

import logging
import statistics
import time
from contextlib import contextmanager

import torch

from .. import settings
from ..transfer import host_pool as host_pool_module
from ..transfer.host_pool import MLADevicePool, MLAHostKVPool

KV_CACHE_DIM = 576  # DeepSeek-V3: kv_lora_rank 512 + qk_rope_head_dim 64
DTYPE = torch.bfloat16
LAYERS = 8          # DeepSeek-V3 has 61; eight keep the demo quick and the rates the same
PAGE_SIZE = 64
REPS = 5
ROW_BYTES = KV_CACHE_DIM * 2  # bf16
MAX_TOKENS = 1 << 40  # a bound for the arithmetic; memory refuses far less (check_tokens)


@contextmanager
def _path_choice_told_by_the_report():
    """The report prints the chosen path and why; the pool's own log line saying the same (a WARNING when
    it falls back to the copy engines) would only alarm a first-time user, so it is dropped meanwhile."""
    logger = host_pool_module.log  # filters act only on their own logger's records (its name is not the module's)

    def drop(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("HiCache host pool:")

    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _random_layer(slots: int, device: str, gen: torch.Generator) -> torch.Tensor:
    words = torch.randint(-2**63, 2**63 - 1, (slots * KV_CACHE_DIM // 4,), dtype=torch.int64, generator=gen)
    return words.to(device).view(DTYPE).view(slots, 1, KV_CACHE_DIM)


def _indices(pool: MLAHostKVPool, tokens: int, device_slots: int, gen: torch.Generator):
    """Random whole pages: host pages from the pool's allocator (sorted, as HiCache hands them
    out after churn), device pages in random order."""
    everything = pool.alloc(pool.available_size())
    pages = everything.view(-1, PAGE_SIZE)
    pool.free(pages[torch.randperm(pages.shape[0], generator=gen)].reshape(-1))
    host = pool.alloc(tokens).view(-1, PAGE_SIZE)
    host = host[host[:, 0].argsort()].reshape(-1)
    device_pages = torch.randperm(device_slots // PAGE_SIZE, generator=gen)[: tokens // PAGE_SIZE]
    device = (device_pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(-1)
    return host, device


def _timed(fn, on_gpu: bool) -> float:
    """Median seconds per call over REPS calls, after one warm-up."""
    fn()
    samples = []
    for _ in range(REPS):
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16).cpu(), b.view(torch.int16).cpu())


def _ceiling(nbytes: int, on_gpu: bool) -> dict:
    """One contiguous copy of ``nbytes`` each way: pinned host <-> GPU, or CPU memory on a CPU-only run."""
    if on_gpu:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        h2d = _timed(lambda: gpu.copy_(host, non_blocking=True), True)
        d2h = _timed(lambda: host.copy_(gpu, non_blocking=True), True)
    else:
        a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        h2d = d2h = _timed(lambda: a.copy_(b), False)
    return {"h2d_GBps": nbytes / h2d / 1e9, "d2h_GBps": nbytes / d2h / 1e9}


def memory_needed(tokens: int, on_gpu: bool, staging_bytes: int = 0) -> dict:
    """Bytes the demo allocates at ``tokens``: ``host`` (CPU memory) and ``device`` (GPU memory, 0 without a GPU).
    One transfer moves ``n = tokens x LAYERS x ROW_BYTES``: the host pool holds 4n, the two device pools 2n
    each, the ceiling's buffers n on each side, the random rows n/4 while one layer is made, and a staged
    backup up to ``staging_bytes`` on the GPU."""
    n = tokens * LAYERS * ROW_BYTES
    pools, ceiling, making = 4 * n, n, n // 4
    if on_gpu:
        return {"host": pools + ceiling + making, "device": 4 * n + ceiling + min(staging_bytes, n)}
    return {"host": pools + 4 * n + 2 * ceiling + making, "device": 0}


def _available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None (the check is skipped)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _largest_fitting(per_token: int, available: int) -> int:
    return max(0, available // max(per_token, 1) // PAGE_SIZE * PAGE_SIZE)


def check_tokens(tokens: int, on_gpu: bool | None = None) -> None:
    """ValueError, naming ``tokens`` and what would fit, unless ``tokens`` is a positive multiple of PAGE_SIZE
    whose pools fit in this machine's free host (and GPU) memory: the demo used to start allocating and end in
    torch's allocation traceback. Reads SGLANG_HICACHE_JIT_STAGING (BadSettingError names it when bad)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 < tokens <= MAX_TOKENS or tokens % PAGE_SIZE:
        raise ValueError(f"tokens must be a positive multiple of {PAGE_SIZE} up to {MAX_TOKENS}, got {tokens!r}")
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    staging = settings.staging_bytes()  # read here, so that a bad one stops the demo before its first step
    staging = staging if on_gpu else 0
    need = memory_needed(tokens, on_gpu, staging)
    per_token = memory_needed(1, on_gpu, 0)
    host = _available_host_bytes()
    if host is not None and need["host"] > host:
        raise ValueError(f"{tokens} tokens need about {need['host'] / 2**30:.1f} GiB of host memory and {host / 2**30:.1f} "
                         f"GiB is available; at most {_largest_fitting(per_token['host'], host)} tokens fit here")
    if on_gpu:
        free, _ = torch.cuda.mem_get_info()
        if need["device"] > free:
            fit = _largest_fitting(per_token["device"], max(0, free - staging))
            raise ValueError(f"{tokens} tokens need about {need['device'] / 2**30:.1f} GiB of GPU memory and "
                             f"{free / 2**30:.1f} GiB is free; at most {fit} tokens fit here")


def run_demo(tokens: int = 16384, *, seed: int = 0, progress=None) -> dict:
    """Runs the demo and returns its report (see format_report). ``progress(line)``, when given, hears what
    each step is about to do."""
    on_gpu = torch.cuda.is_available()
    check_tokens(tokens, on_gpu)
    started = time.perf_counter()

    def step(text: str) -> None:
        if progress is not None:
            progress(f"[{time.perf_counter() - started:5.1f} s] {text}")

    device = "cuda" if on_gpu else "cpu"
    gen = torch.Generator().manual_seed(seed)
    host_slots, device_slots = 4 * tokens, 2 * tokens
    step(f"filling {LAYERS} layers of {device_slots} device slots with random rows "
         f"({LAYERS * device_slots * ROW_BYTES / 1e6:.0f} MB on the {'GPU' if on_gpu else 'CPU'})")
    source = MLADevicePool([_random_layer(device_slots, device, gen) for _ in range(LAYERS)])
    target = MLADevicePool([torch.zeros_like(t) for t in source.kv_buffer])
    step(f"building a page_first host pool of {host_slots} slots "
         f"({host_slots * LAYERS * ROW_BYTES / 1e6:.0f} MB{' pinned' if on_gpu else ''}); the probe picks its path"
         + (" (a first run compiles the kernel: up to a minute)" if on_gpu else ""))
    with _path_choice_told_by_the_report():
        pool = MLAHostKVPool(source, size=host_slots, page_size=PAGE_SIZE, layout="page_first")
    host_idx, dev_idx = _indices(pool, tokens, device_slots, gen)
    # Load into other device pages than the backup read, in another page order.
    load_idx = dev_idx.view(-1, PAGE_SIZE)[torch.randperm(tokens // PAGE_SIZE, generator=gen)].reshape(-1)
    nbytes = tokens * LAYERS * pool.row_bytes

    paths = [pool.transfer_path] + (["direct"] if pool.transfer_path == "kernel" else [])
    results = []
    for path in paths:
        pool.kv_buffer[host_idx] = 0
        step(f"{path} path: backing up {tokens} tokens x {LAYERS} layers ({REPS + 1} runs), then checking every row")
        backup = _timed(lambda: pool.backup_from_device_all_layer(source, host_idx, dev_idx, path), on_gpu)
        backup_ok = all(_same_bits(pool.kv_buffer[host_idx, l], source.kv_buffer[l][dev_idx].cpu())
                        for l in range(LAYERS))
        backup_mode = pool.last_direct_mode if path == "direct" else "one all-layer launch"
        for t in target.kv_buffer:
            t.zero_()

        def load_all_layers():
            for layer in range(LAYERS):
                pool.load_to_device_per_layer(target, host_idx, load_idx, layer, path)

        step(f"{path} path: loading them back layer by layer ({REPS + 1} runs), then checking every row")
        load = _timed(load_all_layers, on_gpu)
        load_ok = all(_same_bits(target.kv_buffer[l][load_idx].cpu(), pool.kv_buffer[host_idx, l])
                      for l in range(LAYERS))
        load_mode = pool.last_direct_mode if path == "direct" else "one launch per layer"
        results.append({"path": path, "op": "backup", "how": backup_mode, "seconds": backup,
                        "GBps": nbytes / backup / 1e9, "bit_exact": backup_ok})
        results.append({"path": path, "op": "load", "how": load_mode, "seconds": load,
                        "GBps": nbytes / load / 1e9, "bit_exact": load_ok})
    step(f"measuring the ceiling: one contiguous copy of the same {nbytes / 1e6:.0f} MB each way")
    ceiling = _ceiling(nbytes, on_gpu)
    step("done")
    for r in results:
        r["ratio"] = r["GBps"] / ceiling["d2h_GBps" if r["op"] == "backup" else "h2d_GBps"]
    if on_gpu:
        name = torch.cuda.get_device_name()
        note = ("kernel path chosen by the probe; the direct path ran for comparison" if pool.transfer_path == "kernel"
                else "the kernel path is unavailable here (see the reason); only the direct path ran")
    else:
        name = "CPU"
        note = ("no GPU on this machine: the pools live in CPU memory and the direct path runs as plain tensor "
                "copies (same plan as the GPU copy engines). Only the bit-exact checks mean something here; "
                "the rates of CPU tensor copies say nothing about the GPU transfers")
    return {
        "device": device, "device_name": name, "note": note, "rates_meaningful": on_gpu,
        "shape": {"model": "DeepSeek-V3 MLA", "kv_cache_dim": KV_CACHE_DIM, "dtype": "bf16",
                  "row_bytes": pool.row_bytes, "layers": LAYERS, "page_size": PAGE_SIZE, "layout": pool.layout,
                  "tokens": tokens, "host_slots": pool.size, "device_slots": device_slots,
                  "bytes_per_transfer": nbytes},
        "chosen_path": pool.transfer_path, "reason": pool.transfer_path_reason,
        "ceiling": ceiling, "results": results,
    }


def format_report(report: dict) -> str:
    s = report["shape"]
    lines = [
        f"HiCache demo: {s['model']} (kv_cache_dim {s['kv_cache_dim']}, {s['dtype']}: {s['row_bytes']}-B rows), "
        f"{s['layers']} layers, {s['layout']} host pool of {s['host_slots']} slots, page {s['page_size']}",
        f"device: {report['device_name']} ({report['device']}); {s['tokens']} tokens = "
        f"{s['bytes_per_transfer'] / 1e6:.1f} MB per transfer (all layers)",
        f"chosen path: {report['chosen_path']}, because {report['reason']}",
        f"note: {report['note']}",
        "",
        f"{'path':<8} {'operation':<10} {'GB/s':>7} {'x ceiling':>10}  {'bit-exact':<9}  how",
    ]
    rates = report["rates_meaningful"]
    for r in report["results"]:
        gbps, ratio = (f"{r['GBps']:7.1f}", f"{r['ratio']:10.2f}") if rates else (f"{'-':>7}", f"{'-':>10}")
        lines.append(f"{r['path']:<8} {r['op']:<10} {gbps} {ratio}  {'yes' if r['bit_exact'] else 'NO':<9}  {r['how']}")
    c = report["ceiling"]
    if rates:
        lines.append(f"{'ceiling':<8} {'h2d/d2h':<10} {c['h2d_GBps']:7.1f} / {c['d2h_GBps']:.1f}  "
                     f"(one contiguous pinned host <-> GPU copy of the same bytes, this run)")
    else:
        lines.append("rates: not shown without a GPU (CPU tensor copies are not GPU transfers); "
                     "run the demo on a GPU machine to measure them")
    verdict = all(r["bit_exact"] for r in report["results"])
    lines.append("" if verdict else "\nFAILED: some copies were not bit-exact")
    return "\n".join(lines).rstrip()
