"""The benchmark's workloads: pool shapes (docs/BENCHMARKS.md, "Workloads"), random pages of indices,
and the CUDA-event timer every figure comes from."""

from __future__ import annotations

import logging
from dataclasses import dataclass

WORKLOADS = {
    # name: (caches per layer, row bytes)
    "mla-bf16": (1, 1152),
    "mla-fp8": (1, 576),
    "dsa-fp8": (1, 656),
    "mha-llama8b": (2, 2048),
    "mha-small": (2, 256),
}
LAYERS = 8

log = logging.getLogger("sglang_hicache_jit")


@dataclass
class Pools:
    caches: int
    row_bytes: int
    host: list      # per cache: pinned (slots, LAYERS, row_bytes) uint8, page_first
    device: list    # per cache: list of LAYERS device tensors (slots, row_bytes)
    host_slots: int
    device_slots: int
    # 'page_first', or 'page_first_direct': the same bytes read as (pages, LAYERS, page_size, row_bytes),
    # so a page of one layer is one contiguous run (SGLang's layout for its direct backend).
    layout: str = "page_first"


def _fill_random(t, torch):
    """Random bytes (never zeros) generated on the GPU in chunks and copied in."""
    flat = t.view(-1)
    chunk = 1 << 28
    for start in range(0, flat.numel(), chunk):
        n = min(chunk, flat.numel() - start)
        flat[start:start + n].copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda"))


def make_pools(workload: str, host_slots: int, device_slots: int, layout: str = "page_first") -> Pools:
    import torch

    caches, row_bytes = WORKLOADS[workload]
    host, device = [], []
    for _ in range(caches):
        buf = torch.empty((host_slots, LAYERS, row_bytes), dtype=torch.uint8, pin_memory=True)
        _fill_random(buf, torch)
        host.append(buf)
        layers = [torch.empty((device_slots, row_bytes), dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
        for layer in layers:
            _fill_random(layer, torch)
        device.append(layers)
    torch.cuda.synchronize()
    return Pools(caches, row_bytes, host, device, host_slots, device_slots, layout)


def make_indices(tokens: int, page_size: int, host_slots: int, device_slots: int, seed: int):
    """Random whole pages on both sides; the host side sorted (as HiCache allocates)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    pages = tokens // page_size
    host_pages = torch.randperm(host_slots // page_size, generator=gen)[:pages].sort().values
    dev_pages = torch.randperm(device_slots // page_size, generator=gen)[:pages]
    offsets = torch.arange(page_size)
    host = (host_pages[:, None] * page_size + offsets).reshape(-1)
    dev = (dev_pages[:, None] * page_size + offsets).reshape(-1)
    return host, dev


def time_call(fn, *, min_reps=5, max_reps=40, budget_s=0.25, queue_s=300e-6) -> list[float]:
    """Per-call seconds from CUDA events, after a warm-up.

    Each timed rep enqueues enough back-to-back calls to keep the GPU busy for
    about ``queue_s`` and divides, so a provider's Python cost per call does
    not show up as idle GPU time unless it exceeds the transfer itself (then
    the figure is CPU-bound, as it would be in a server).
    """
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end) / 1e3, 1e-6)
    batch = int(min(16, max(1, round(queue_s / once))))
    reps = int(min(max_reps, max(min_reps, budget_s / (once * batch))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        for _ in range(batch):
            fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 / batch for s, e in events]
