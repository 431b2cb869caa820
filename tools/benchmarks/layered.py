"""``layered``: a host hit as SGLang runs it, without a server. The loads of every layer are issued first on a
load stream (SGLang's scheduler issues them before the forward pass); the forward pass on the compute stream
waits for layer i's load before it computes layer i (SGLang's layer-done counter). The same forward pass with
every layer already on the GPU is the device hit. The question: how much later does the forward pass end when
its layers come from host memory, per copy method, and is that the link's time or something else?

Shapes: Llama-3.1-8B's (32 layers; K and V rows of 8 heads x 128 bf16 = 2048 B; hidden 4096, MLP 14336),
a ``page_first`` host pool (a layer is a strided view, as SGLang's ``k_data_refs``), random bytes, random whole
host pages and device slots, GPU indices on both sides (what SGLang's ``kernel`` backend passes). A layer of
the forward pass: the extend tokens' projections and MLP (one bf16 weight set shared by the layers, so every
layer streams its weights from HBM as a real one does), and an attention stand-in that reads every loaded K
and V row of the layer (two bf16 matmuls over them), so it cannot start before its load ends.

Providers: ``bulk`` (this package's default for host-to-GPU: bulk copies, 4 CTAs, a whole multiprocessor's
shared memory each), ``bulk-q2``, ``plain`` (the plain copy loop, 8 CTAs, no shared memory), ``plain-q2``,
``resident`` (CTAs kept on the GPU, fed by a queue), ``upstream`` (SGLang's own kernel, where importable:
sglang_hicache_jit/bench/upstream.py), and ``staged-g8`` / ``staged-g32`` (group loads, transfer/staged_loads.py:
8 or all 32 layers' part of whole host blocks on the copy engines into the staging area, then one scatter launch
per chunk; host slots read on the host, as SGLang's ``direct`` backend passes them). ``--beside decode`` runs
decode-like steps (a batch of 32 tokens through the same weights, back to back) on a third stream all along, as
a server's running batch does; ``--beside matmul`` runs bf16 8192^3 matmuls there instead, compute that holds
every SM (where a launched copy kernel waits for SMs: tools/bench.py layouts measures rates beside the same).

Per provider and rep (the providers interleaved): the forward pass's end after the start (``host_ms``), the
loads' end (``load_ms``), layer 0's load (``first_ms``), and the device hit's end measured in the same rep
(``device_ms``); medians over reps, with ``host_ms - device_ms`` against the PCIe floor (the loaded bytes at
a contiguous pinned copy's rate, measured in the same run). Every provider is checked bit-exact first.
"""

from __future__ import annotations

import statistics
import time

LAYERS, HEADS, HEAD_DIM, HIDDEN, INTER = 32, 8, 128, 4096, 14336
KV_DIM = HEADS * HEAD_DIM  # bf16 elements per K (or V) row: 2048 B
DECODE_BATCH = 32
MATMUL = 8192  # --beside matmul: bf16 MATMUL^3 products back to back
PROVIDERS = ("bulk", "bulk-q2", "plain", "plain-q2", "resident", "upstream", "staged-g8", "staged-g32")
_OURS = {"bulk": ("bulk", None), "bulk-q2": ("bulk", 2), "plain": ("plain", None), "plain-q2": ("plain", 2),
         "resident": ("resident", None)}


def add_arguments(p, name: str) -> None:
    p.add_argument("--tokens", type=int, default=8192, help="the prefix's tokens, loaded per layer")
    p.add_argument("--page", type=int, default=64, help="host page size (tokens)")
    p.add_argument("--extend", type=int, default=128, help="tokens the forward pass computes (the request's new ones)")
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--beside", choices=("none", "decode", "matmul"), default="none",
                   help="decode: decode-like steps on a third stream all along; matmul: back-to-back bf16 "
                        "8192^3 matmuls there (compute that saturates the SMs, as layouts runs beside)")
    p.add_argument("--reps", type=int, default=7, help="reps per provider (interleaved); medians count")
    p.add_argument("--smoke", action="store_true",
                   help="CPU only, tiny sizes, a torch-indexing provider: runs every line; times mean nothing")


class Setup:
    """The pools, indices, weights and streams of one run."""

    def __init__(self, args):
        import torch

        self.torch, self.args, self.smoke = torch, args, args.smoke
        if self.smoke:
            from .harness import CpuCuda

            self.cuda, self.device = CpuCuda, "cpu"
            self.layers, self.hidden, self.inter = 2, 64, 128
            args.tokens, args.page, args.extend, args.reps = 2 * args.page, args.page, 4, 1
        else:
            if not torch.cuda.is_available():
                raise SystemExit("this workload needs a CUDA GPU (--smoke runs it on the CPU, times meaningless)")
            self.cuda, self.device = torch.cuda, "cuda"
            self.layers, self.hidden, self.inter = LAYERS, HIDDEN, INTER
        gen = torch.Generator().manual_seed(36)
        slots = 2 * args.tokens  # host and device: half of them used, at random whole pages / slots
        # page_first host buffers (slots, layers, heads, dim); a layer is the strided view [:, layer]
        self.host = [self._random((slots, self.layers, HEADS, HEAD_DIM), pin=not self.smoke) for _ in range(2)]
        self.dev = [[self._random((slots, HEADS, HEAD_DIM), device=self.device) for _ in range(self.layers)]
                    for _ in range(2)]
        pages = torch.randperm(slots // args.page, generator=gen)[:args.tokens // args.page]
        host_idx = (pages[:, None] * args.page + torch.arange(args.page)).reshape(-1)
        dev_idx = torch.randperm(slots, generator=gen)[:args.tokens]
        self.host_idx, self.dev_idx = host_idx.to(self.device), dev_idx.to(self.device)
        self.host_idx_cpu = host_idx  # the staged loads plan their copies from the host slots on the host
        w = dict(dtype=torch.bfloat16, device=self.device)
        scale = self.hidden ** -0.5
        self.w_qkv = torch.randn(self.hidden, self.hidden + 2 * KV_DIM, **w) * scale
        self.w_o = torch.randn(self.hidden, self.hidden, **w) * scale
        self.w_up = torch.randn(self.hidden, 2 * self.inter, **w) * scale
        self.w_down = torch.randn(self.inter, self.hidden, **w) * scale
        self.x = torch.randn(args.extend, self.hidden, **w)
        self.q = torch.randn(args.extend, KV_DIM, **w)
        self.decode_x = torch.randn(DECODE_BATCH, self.hidden, **w)
        n = 64 if self.smoke else MATMUL
        self.matmul = torch.randn(n, n, **w) if args.beside == "matmul" else None
        self.load_stream, self.compute, self.side = (self.cuda.Stream() for _ in range(3))
        self.row_bytes = KV_DIM * 2

    def _random(self, shape, *, device="cpu", pin=False):
        """Random bytes as bf16 (NaN patterns included: every comparison reads them as int16)."""
        from sglang_hicache_jit.bench.workloads import _fill_random

        t = self.torch.empty(shape, dtype=self.torch.bfloat16, device=device, pin_memory=pin)
        _fill_random(t, self.torch)
        return t

    def layer(self, i: int) -> None:
        """One layer of the forward pass: attention over the layer's loaded K and V rows, then projections and MLP."""
        torch = self.torch
        k = self.dev[0][i].view(-1, KV_DIM).index_select(0, self.dev_idx)
        v = self.dev[1][i].view(-1, KV_DIM).index_select(0, self.dev_idx)
        attn = torch.softmax((self.q @ k.T).float() * KV_DIM ** -0.5, dim=-1).to(torch.bfloat16) @ v
        h = (self.x @ self.w_qkv)[:, :self.hidden] @ self.w_o
        up = h @ self.w_up
        out = (up[:, :self.inter] * up[:, self.inter:]) @ self.w_down
        self.sink = (out, attn)  # kept, so nothing is freed while queued work may still use it

    def decode_step(self) -> None:
        """One step of the work beside the pass: a decode-like step, or one large matmul (--beside matmul)."""
        if self.matmul is not None:
            self.decode_sink = self.matmul @ self.matmul
            return
        self.decode_sink = (self.decode_x @ self.w_up)[:, :self.inter] @ self.w_down

    def transfers(self, provider: str) -> list:
        """One callable per layer that loads that layer's rows through ``provider``."""
        if self.smoke:
            def torch_copy(i):
                for c in range(2):
                    self.dev[c][i][self.dev_idx] = self.host[c][:, i][self.host_idx].to(self.device)
            return [lambda i=i: torch_copy(i) for i in range(self.layers)]
        if provider == "upstream":
            from sglang_hicache_jit.bench import upstream
            from sglang_hicache_jit.bench.workloads import Pools

            up = upstream.module()
            flat = [buf.view(buf.shape[0], self.layers, -1).view(self.torch.uint8) for buf in self.host]
            dev = [[t.view(t.shape[0], -1).view(self.torch.uint8) for t in layers] for layers in self.dev]
            pools = Pools(caches=2, row_bytes=self.row_bytes, host=flat, device=dev, host_slots=flat[0].shape[0],
                          device_slots=dev[0][0].shape[0])
            return [upstream.build_call(up, "upstream", pools, "one", True, i, self.host_idx, self.dev_idx,
                                        self.args.page, self.layers) for i in range(self.layers)]
        if provider.startswith("staged-g"):
            return self._staged(int(provider[len("staged-g"):]))
        from sglang_hicache_jit.transfer import ops

        method, quota = _OURS[provider]

        def call(i):
            ops.transfer_one_layer(self.dev[0][i], self.dev[1][i], self.dev_idx, self.host[0][:, i],
                                   self.host[1][:, i], self.host_idx, method=method, block_quota=quota)
        return [lambda i=i: call(i) for i in range(self.layers)]

    def _staged(self, group: int) -> list:
        """Group loads (transfer/staged_loads.py): layer i's call loads layers i..i+group-1 when i is a
        multiple of ``group`` (whole host blocks of those layers on the copy engines into the staging area, then
        one scatter launch) and has nothing left to do otherwise, as SGLang calls a pool layer by layer."""
        from sglang_hicache_jit import settings
        from sglang_hicache_jit.transfer import staging
        from sglang_hicache_jit.transfer.staged_loads import GroupLoads

        area = staging.PageStaging(self.host, budget_bytes=settings.staging_bytes(), device=self.device,
                                   device_rows=self.dev[0][0].shape[0], gather=staging.torch_gather(self.dev))
        loads = GroupLoads(area, self.dev)

        def call(i):
            if i % group == 0 and not loads.load(self.host_idx_cpu, self.dev_idx, i, min(group, self.layers - i)):
                raise RuntimeError("the staging area declined the load (host slots not in runs)")
        return [lambda i=i: call(i) for i in range(self.layers)]

    def exact(self, transfers) -> bool:
        torch = self.torch
        for c in range(2):
            for i in range(self.layers):
                self.dev[c][i][self.dev_idx] = self._random((self.args.tokens, HEADS, HEAD_DIM), device=self.device)
        self.cuda.synchronize()
        for t in transfers:
            t()
        self.cuda.synchronize()
        return all(torch.equal(self.dev[c][i][self.dev_idx].cpu().view(torch.int16),
                               self.host[c][:, i][self.host_idx.cpu()].view(torch.int16))
                   for c in range(2) for i in range(self.layers))

    def run(self, transfers) -> dict:
        """One forward pass (a host hit with ``transfers``, a device hit without); times in ms from its start."""
        cuda = self.cuda
        self.compute.synchronize()  # not the whole device: decode steps queued on the side stream keep running
        self.load_stream.synchronize()
        start, end, load_end = (cuda.Event(enable_timing=True) for _ in range(3))
        loaded = [cuda.Event(enable_timing=True) for _ in range(self.layers)]
        with cuda.stream(self.compute):
            start.record()
        if transfers is not None:
            _wait(self.load_stream, start)
            with cuda.stream(self.load_stream):  # every load first, as SGLang's scheduler issues them
                for i, t in enumerate(transfers):
                    t()
                    loaded[i].record()
                load_end.record()
        with cuda.stream(self.compute):
            for i in range(self.layers):
                if transfers is not None:
                    _wait(self.compute, loaded[i])
                self.layer(i)
            end.record()
        end.synchronize()
        if transfers is not None:
            load_end.synchronize()
        result = {"end_ms": start.elapsed_time(end)}
        if transfers is not None:
            result.update(load_ms=start.elapsed_time(load_end), first_ms=start.elapsed_time(loaded[0]))
        return result

    def decode_for(self, seconds: float, step_s: float) -> None:
        """Queues decode steps on the side stream for about ``seconds`` of GPU time."""
        with self.cuda.stream(self.side):
            for _ in range(max(1, int(seconds / max(step_s, 1e-6)))):
                self.decode_step()


def _wait(stream, event) -> None:
    if hasattr(stream, "wait_event"):  # the CPU stand-in runs everything in order already
        stream.wait_event(event)


def run(args, out, name: str) -> int:
    from sglang_hicache_jit.bench import upstream
    from sglang_hicache_jit.bench.workloads import Ceiling, time_call

    s = Setup(args)
    providers = ["torch"] if s.smoke else list(args.providers)
    calls = {}
    for p in providers:
        try:
            transfers = s.transfers(p)
        except (upstream.Unavailable, ImportError, RuntimeError, ValueError) as exc:
            print(f"{p}: skipped ({exc})", flush=True)
            continue
        ok = s.exact(transfers)
        print(f"{p}: bit-exact={'yes' if ok else 'NO'}", flush=True)
        if ok:
            calls[p] = transfers
        else:
            out.row(provider=p, exact=False)
    nbytes = 2 * s.layers * args.tokens * s.row_bytes
    floor_gbps = None
    if not s.smoke:  # the contiguous pinned copy of the same bytes, host to GPU (median of back-to-back copies)
        floor_gbps = nbytes / statistics.median(time_call(Ceiling("cuda").call(nbytes, "h2d"))) / 1e9
    step_s = 0.0
    if args.beside != "none" and not s.smoke:
        began = time.perf_counter()
        for _ in range(20):
            s.decode_step()
        s.cuda.synchronize()
        step_s = (time.perf_counter() - began) / 20
    samples = {p: [] for p in calls}
    for _ in range(args.reps + 1):  # the first round warms up
        for p, transfers in calls.items():
            if step_s:
                s.decode_for(0.2, step_s)  # covers both runs of the rep
            device = s.run(None)
            host = s.run(transfers)
            samples[p].append(dict(host, device_ms=device["end_ms"], host_ms=host["end_ms"]))
    floor_ms = nbytes / floor_gbps / 1e6 if floor_gbps else None
    print(f"{args.tokens} tokens x {s.layers} layers x K+V of {s.row_bytes} B = {nbytes / 2 ** 20:.0f} MiB; "
          f"extend {args.extend} tokens; beside: {args.beside}" +
          (f"; PCIe floor {floor_ms:.2f} ms at {floor_gbps:.1f} GB/s" if floor_ms else ""))
    print(f"{'provider':<10} {'device hit':>10} {'host hit':>9} {'host-dev':>9} {'of floor':>9} {'loads end':>10} "
          f"{'layer 0':>8}   (ms, medians of {args.reps})")
    for p, reps in samples.items():
        reps = reps[1:]
        med = {k: statistics.median(r[k] for r in reps) for k in ("device_ms", "host_ms", "load_ms", "first_ms")}
        gap = statistics.median(r["host_ms"] - r["device_ms"] for r in reps)
        row = out.row(provider=p, exact=True, tokens=args.tokens, page=args.page, extend=args.extend,
                      beside=args.beside, layers=s.layers, reps=len(reps), floor_ms=floor_ms, floor_gbps=floor_gbps,
                      host_minus_device_ms=gap, of_floor=gap / floor_ms if floor_ms else None,
                      load_gbps=nbytes / (med["load_ms"] / 1e3) / 1e9 if med["load_ms"] else None,
                      samples=reps, **med)
        of = f"{row['of_floor']:9.2f}" if row["of_floor"] is not None else f"{'-':>9}"
        print(f"{p:<10} {med['device_ms']:10.2f} {med['host_ms']:9.2f} {gap:9.2f} {of} {med['load_ms']:10.2f} "
              f"{med['first_ms']:8.2f}")
    return 0
