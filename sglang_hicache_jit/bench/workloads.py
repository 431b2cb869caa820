"""The setup every benchmark shares: pool shapes (docs/BENCHMARKS.md, "Workloads"), random bytes and
random whole pages of indices, the CUDA-event timer every figure comes from, the ceiling (a contiguous
pinned copy of the same bytes) and the back-to-back bf16 matmul a transfer is measured beside.

Used by the CLI's ``bench`` (modes.py) and by tools/bench.py's workloads. The timers take ``cuda``, a
stand-in for ``torch.cuda`` (tools/bench.py --smoke passes one that runs on the CPU)."""

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
    """Random bytes (never zeros) generated on the GPU in chunks and copied in (on the CPU without a GPU)."""
    flat = t.view(-1) if t.dtype == torch.uint8 else t.view(torch.uint8).view(-1)
    chunk = 1 << 28
    where = "cuda" if torch.cuda.is_available() else "cpu"
    for start in range(0, flat.numel(), chunk):
        n = min(chunk, flat.numel() - start)
        flat[start:start + n].copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, device=where))


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


def time_call(fn, *, min_reps=5, max_reps=40, budget_s=0.25, queue_s=300e-6, cuda=None) -> list[float]:
    """Per-call seconds from CUDA events, after a warm-up.

    Each timed rep enqueues enough back-to-back calls to keep the GPU busy for
    about ``queue_s`` and divides, so a provider's Python cost per call does
    not show up as idle GPU time unless it exceeds the transfer itself (then
    the figure is CPU-bound, as it would be in a server).
    """
    cuda = cuda or _torch_cuda()
    fn()
    cuda.synchronize()
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end) / 1e3, 1e-6)
    batch = int(min(16, max(1, round(queue_s / once))))
    reps = int(min(max_reps, max(min_reps, budget_s / (once * batch))))
    events = [(cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        for _ in range(batch):
            fn()
        end.record()
    cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 / batch for s, e in events]


def _torch_cuda():
    import torch

    return torch.cuda


class Ceiling:
    """The ceiling every ratio is against: one contiguous copy of the same bytes in the same direction,
    pinned host memory <-> ``device`` (random bytes). Keeps the buffers of the last two sizes."""

    def __init__(self, device: str = "cuda"):
        self.device = device
        self._buffers: dict = {}

    def call(self, nbytes: int, direction: str):
        """A zero-argument callable doing the copy ('h2d': host -> device, 'd2h': device -> host)."""
        import torch

        if nbytes not in self._buffers:
            if len(self._buffers) >= 2:
                self._buffers.pop(next(iter(self._buffers)))
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device != "cpu")
            _fill_random(host, torch)
            self._buffers[nbytes] = (host, torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        host, dev = self._buffers[nbytes]
        if direction == "h2d":
            return lambda: dev.copy_(host, non_blocking=True)
        return lambda: host.copy_(dev, non_blocking=True)


def matmul(size: int = 8192, device: str = "cuda"):
    """One bf16 ``size``^3 matrix multiply on random data, as a zero-argument callable: the compute that
    saturates the GPU, run back to back beside a transfer."""
    import torch

    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    c = torch.empty_like(a)
    return lambda: torch.mm(a, b, out=c)


def beside(fn, load, *, window_s: float = 0.2, load_s: float | None = None, stream=None, cuda=None) -> dict:
    """``fn`` (a transfer) back to back on ``stream`` while ``load`` runs back to back on the current stream.

    The load runs alone first, for about ``window_s`` (the GPU's clocks drift as it heats, so a baseline
    taken once at the start would count that drift as slow-down), then again with the transfers beside
    it. The host keeps at most two transfers queued and stops issuing once the load has finished; only
    transfers that finished inside the load's window count towards the rate. Returns ``calls`` (those
    counted), ``seconds`` (from the first transfer's start to the last counted one's end), ``load_alone_s``
    and ``load_beside_s`` (per step) and ``slowdown`` (beside / alone - 1).
    """
    cuda = cuda or _torch_cuda()
    if load_s is None:
        load_s = min(time_call(load, min_reps=3, max_reps=5, budget_s=0.05, cuda=cuda))
    steps = max(3, round(window_s / max(load_s, 1e-6)))
    side = stream if stream is not None else cuda.Stream()

    def event():
        return cuda.Event(enable_timing=True)

    cuda.synchronize()
    a0, a1 = event(), event()
    a0.record()
    for _ in range(steps):
        load()
    a1.record()
    a1.synchronize()
    alone = a0.elapsed_time(a1) / 1e3 / steps
    g0, g1 = event(), event()
    g0.record()
    for _ in range(steps):
        load()
    g1.record()
    ends = []
    with cuda.stream(side):
        t0 = event()
        t0.record()
        while True:  # at least one transfer, even where the load is done before the first is issued
            fn()
            ends.append(event())
            ends[-1].record()
            if len(ends) >= 2:
                ends[-2].synchronize()
            if g1.query():
                break
    cuda.synchronize()
    window_ms = t0.elapsed_time(g1)
    inside = [e for e in ends if t0.elapsed_time(e) <= window_ms] or ends[:1]
    with_load = g0.elapsed_time(g1) / 1e3 / steps
    return {"calls": len(inside), "issued": len(ends), "seconds": t0.elapsed_time(inside[-1]) / 1e3,
            "load_alone_s": alone, "load_beside_s": with_load, "slowdown": with_load / alone - 1}
