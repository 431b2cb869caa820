"""``layouts`` and ``cta``: SGLang's per-layer load loop and all-layer backup through this package's host
pools, for each host layout, page size and call size, alone and beside back-to-back bf16 matmuls.

Shapes (DeepSeek-V3 MLA, bf16): rows of 576 x 2 = 1152 B, 8 layers, a device pool of 256K slots, a host
pool of 256K slots per layout and page size; random bytes everywhere, random whole pages (host pages
sorted, as HiCache's allocator hands them out after churn, device pages in random order).

* A **load** is SGLang's loop: ``load_to_device_per_layer`` for layers 0..7, one call each, with the same
  index tensors every layer. A **backup** is one ``backup_from_device_all_layer``. Each load and backup
  gets fresh copies of the index tensors, as SGLang's are made per load (``--keep-indices``: the same
  tensors every call), so a plan kept per index tensor serves one load's layers, never the next load.
  A load's row also has the time to its first layer and to its last (``first_layer_s``, ``last_layer_s``).
* ``layouts`` runs each through the pool's ``io_backend`` values in PROVIDERS (``kernel`` with GPU
  indices, ``direct`` and ``auto`` with CPU indices, as SGLang's cache controller moves them for each
  backend); ``--providers NAME=IO_BACKEND[/cpu|cuda[/DIRECT_MODE]]`` adds one without editing.
* ``cta`` runs the kernel on the same calls at explicit CTA budgets (``block_quota``) through the public
  ops on the pool's layer views.

Each provider is checked bit-exact first (the destination rows scrambled with random bytes, one call,
every layer compared bit for bit), then timed: alone (CUDA-event medians of back-to-back calls, on a side
stream) and beside the matmul (workloads.beside, ``--runs`` windows, medians). The contiguous pinned copy
of the same bytes in the same direction is measured the same two ways in every cell; every ratio is
against it alone.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

DIM, LAYERS = 576, 8
LAYOUTS = ("page_first_direct", "page_first", "layer_first")  # the order they run in: the focus first


@dataclass(frozen=True)
class Provider:
    """One way to make the pool's calls: its ``io_backend`` argument, where the index tensors live
    ('cuda' or 'cpu'), ``pool.direct_mode`` during the calls (None: the pool's default), and the layouts
    it applies to (None: all)."""

    io_backend: str
    indices: str = "cpu"
    direct_mode: str | None = None
    layouts: tuple | None = None
    load_group: int = 0  # the pool's load_group during its loads (staged group loads; 0: layer by layer)


# The providers `layouts` measures by default; add a path the pools gain here (or on the command line).
PROVIDERS = {
    "kernel": Provider("kernel", indices="cuda"),
    "direct": Provider("direct", indices="cpu"),
    "auto": Provider("auto", indices="cpu"),
}


# Asked for by name only: the experimental group loads (transfer/staged_loads.py) through the pool's staging
# area, 4 or all 8 layers at a time, with the direct backend's CPU indices.
_STAGED = ("page_first", "page_first_direct")
EXTRA_PROVIDERS = {
    "staged-g4": Provider("direct", indices="cpu", layouts=_STAGED, load_group=4),
    "staged-g8": Provider("direct", indices="cpu", layouts=_STAGED, load_group=8),
}


def parse_provider(text: str) -> tuple[str, Provider]:
    """'kernel' (a name in PROVIDERS or EXTRA_PROVIDERS) or 'NAME=IO_BACKEND[/cpu|cuda[/DIRECT_MODE]]'."""
    if "=" not in text:
        known = {**PROVIDERS, **EXTRA_PROVIDERS}
        if text not in known:
            raise ValueError(f"unknown provider {text!r}: one of {', '.join(known)}, or "
                             "NAME=IO_BACKEND[/cpu|cuda[/DIRECT_MODE]]")
        return text, known[text]
    name, _, spec = text.partition("=")
    parts = spec.split("/")
    if not name or not parts[0] or len(parts) > 3 or (len(parts) > 1 and parts[1] not in ("cpu", "cuda")):
        raise ValueError(f"bad provider {text!r}: expected NAME=IO_BACKEND[/cpu|cuda[/DIRECT_MODE]]")
    return name, Provider(parts[0], parts[1] if len(parts) > 1 else "cpu", parts[2] if len(parts) > 2 else None)


def parse_quota(text: str) -> int:
    """'1', '2', ... or 'default' (0: the kernel's measured default)."""
    if text == "default":
        return 0
    value = int(text)
    if value < 1:
        raise ValueError(f"a CTA budget is a positive number or 'default', got {text!r}")
    return value


def add_arguments(p, workload: str) -> None:
    cta = workload == "cta"
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS,
                   default=["page_first", "page_first_direct"] if cta else list(LAYOUTS))
    p.add_argument("--pages", nargs="+", type=int, default=[64] if cta else [64, 256])
    p.add_argument("--tokens", nargs="+", type=int, default=[16384, 65536], help="tokens per layer per call")
    p.add_argument("--ops", nargs="+", choices=("load", "backup"), default=["load", "backup"])
    if cta:
        p.add_argument("--quotas", nargs="+", type=parse_quota, default=[1, 2, 4, 0],
                       help="CTA budgets: numbers, and 'default' for the kernel's own choice")
    else:
        p.add_argument("--providers", nargs="+", default=list(PROVIDERS),
                       help=f"names in the table ({', '.join(PROVIDERS)}; also {', '.join(EXTRA_PROVIDERS)}: group loads, "
                            "experimental) or NAME=IO_BACKEND[/cpu|cuda[/DIRECT_MODE]]")
    p.add_argument("--host-slots", type=int, default=256 * 1024)
    p.add_argument("--device-slots", type=int, default=256 * 1024)
    p.add_argument("--matmul", type=int, default=8192, help="the square bf16 matmul run back to back beside")
    p.add_argument("--window-s", type=float, default=0.2, help="matmul time per measurement beside it")
    p.add_argument("--runs", type=int, default=3, help="measurements beside the matmul per figure (median)")
    p.add_argument("--no-beside", action="store_true", help="alone only")
    p.add_argument("--keep-indices", action="store_true",
                   help="the same index tensors for every call (default: fresh copies per load or backup, as "
                        "SGLang makes them, so a plan kept per tensor serves one load's layers only)")
    p.add_argument("--budget-s", type=float, default=0, help="stop starting new cells after this many seconds")
    if not cta:
        p.add_argument("--gather-blocks", type=int, default=None,
                       help="CTAs of the staged backups' gather (transfer/staging.py's GATHER_BLOCKS) for the run")
    p.add_argument("--smoke", action="store_true",
                   help="CPU only, tiny sizes: runs every line and every bit-exact check; rates mean nothing")


# --------------------------------------------------------------------------------------------------------
# Setup shared by both workloads

class Bench:
    """The run's device, timers, matmul beside, side stream and ceiling."""

    def __init__(self, args):
        import torch

        from sglang_hicache_jit.bench import workloads

        from .harness import CpuCuda

        self.torch, self.workloads, self.args = torch, workloads, args
        self.smoke = args.smoke
        if self.smoke:
            self.device, self.cuda = "cpu", CpuCuda
            args.host_slots, args.device_slots = min(args.host_slots, 2048), min(args.device_slots, 2048)
            args.tokens = [max(args.pages) * 2 ** i for i in range(len(args.tokens))]  # one page, two, ...
            args.matmul, args.window_s, args.runs = min(args.matmul, 16), min(args.window_s, 0.002), 1
            self.budget_s = 0.005
        else:
            if not torch.cuda.is_available():
                raise SystemExit("this workload needs a CUDA GPU (--smoke runs it on the CPU, rates meaningless)")
            self.device, self.cuda = "cuda", torch.cuda
            self.budget_s = 0.25
        self.side = self.cuda.Stream()
        self.ceiling = workloads.Ceiling(self.device)
        self.load = self.load_s = None
        if not args.no_beside:
            self.load = workloads.matmul(args.matmul, self.device)
            self.load_s = statistics.median(workloads.time_call(self.load, budget_s=0.5 if not self.smoke else 0.01,
                                                                cuda=self.cuda))
            flops = 2 * args.matmul ** 3 / self.load_s / 1e12
            print(f"bf16 {args.matmul}^3 matmul alone: {self.load_s * 1e3:.3f} ms ({flops:.0f} TFLOP/s)", flush=True)
        self.started = time.monotonic()

    def out_of_time(self) -> bool:
        return bool(self.args.budget_s) and time.monotonic() - self.started > self.args.budget_s

    def random_rows(self, count: int, device: str):
        t = self.torch
        return t.randint(-2**15, 2**15, (count, 1, DIM), dtype=t.int16, device=device).view(t.bfloat16)

    def device_pool(self):
        from sglang_hicache_jit.host_pool import MLADevicePool

        t = self.torch
        layers = [t.empty((self.args.device_slots, 1, DIM), dtype=t.bfloat16, device=self.device)
                  for _ in range(LAYERS)]
        for layer in layers:
            self.workloads._fill_random(layer, t)
        return MLADevicePool(layers)

    def host_pool(self, device_pool, layout: str, page: int):
        from sglang_hicache_jit.host_pool import MLAHostKVPool

        began = time.perf_counter()
        pool = MLAHostKVPool(device_pool, size=self.args.host_slots, page_size=page, layout=layout)
        register_s = time.perf_counter() - began
        self.workloads._fill_random(pool.kv_buffer, self.torch)
        return pool, register_s

    def measure(self, call, nbytes: int) -> dict:
        """Alone (medians of back-to-back calls on the side stream) and beside the matmul (medians of runs)."""
        with self.cuda.stream(self.side):
            times = self.workloads.time_call(call, budget_s=self.budget_s, cuda=self.cuda,
                                             **({"min_reps": 1, "max_reps": 2} if self.smoke else {}))
        result = {"alone_s": statistics.median(times), "alone_reps": len(times),
                  "alone_gbps": nbytes / statistics.median(times) / 1e9}
        if self.load is None:
            return result
        samples = []
        for _ in range(self.args.runs):
            got = self.workloads.beside(call, self.load, window_s=self.args.window_s, load_s=self.load_s,
                                        stream=self.side, cuda=self.cuda)
            samples.append({"gbps": got["calls"] * nbytes / got["seconds"] / 1e9, "slowdown": got["slowdown"],
                            "calls": got["calls"], "issued": got["issued"], "matmul_alone_s": got["load_alone_s"],
                            "matmul_beside_s": got["load_beside_s"]})
        result.update(beside_gbps=statistics.median(s["gbps"] for s in samples),
                      slowdown=statistics.median(s["slowdown"] for s in samples), beside=samples)
        return result

    def release(self) -> None:
        gc.collect()
        if not self.smoke:
            self.torch.cuda.empty_cache()


def host_rows(pool, host_idx, layer: int):
    """The rows of host layer ``layer`` at token slots ``host_idx`` (CPU int64), read by the layout's shape
    (transfer/layout.py)."""
    from sglang_hicache_jit.transfer import layout

    return pool.kv_buffer[layout.token_index(pool.layout, layer, host_idx, pool.page_size)]


def set_host_rows(pool, host_idx, layer: int, values) -> None:
    from sglang_hicache_jit.transfer import layout

    pool.kv_buffer[layout.token_index(pool.layout, layer, host_idx, pool.page_size)] = values


def host_layer_view(pool, layer: int):
    """Host layer ``layer`` as the transfers see it: (rows, 1, D) with one slot stride; for
    page_first_direct the flat rows from the layer's first row, addressed by
    ``pool.translate_host_indices`` (transfer/layout.py)."""
    from sglang_hicache_jit.transfer import layout

    return layout.layer_rows(pool.kv_buffer, pool.layout, layer)


def exact(bench: Bench, pool, device_pool, host_idx, dev_idx, op: str, call) -> bool:
    """Scrambles the rows ``call`` writes with random bytes, runs it once, compares every layer bit for bit."""
    t = bench.torch
    n = host_idx.numel()
    dev = dev_idx.to(bench.device)
    for layer in range(LAYERS):
        if op == "load":
            device_pool.kv_buffer[layer][dev] = bench.random_rows(n, bench.device)
        else:
            set_host_rows(pool, host_idx, layer, bench.random_rows(n, "cpu"))
    bench.cuda.synchronize()
    with bench.cuda.stream(bench.side):
        call()
    bench.cuda.synchronize()
    return all(t.equal(device_pool.kv_buffer[layer][dev].cpu().view(t.int16),
                       host_rows(pool, host_idx, layer).view(t.int16)) for layer in range(LAYERS))


# --------------------------------------------------------------------------------------------------------
# The calls each workload measures in a cell: (name, row fields, callable or the exception that stopped it)

def pool_calls(bench: Bench, providers: dict, pool, device_pool, op: str, host_idx, dev_idx):
    for name, provider in providers.items():
        if provider.layouts and pool.layout not in provider.layouts:
            continue
        where = bench.device if provider.indices == "cuda" else "cpu"
        backend = provider.io_backend
        if op == "load":
            def transfer(idx, layer, backend=backend, group=provider.load_group):
                pool.load_group = group
                pool.load_to_device_per_layer(device_pool, idx[0], idx[1], layer, backend)
        else:
            def transfer(idx, layer, backend=backend):
                pool.backup_from_device_all_layer(device_pool, idx[0], idx[1], backend)
        fields = {"provider": name, "io_backend": backend, "indices": provider.indices,
                  "direct_mode": provider.direct_mode}
        yield name, fields, (host_idx.to(where), dev_idx.to(where)), transfer, provider.direct_mode or "auto"


class CpuOps:
    """--smoke for ``cta``: the two ops' calls done by tensor indexing on the CPU, so the views and
    translated indices the workload passes are checked bit for bit too."""

    @staticmethod
    def LayerTable(layers, **_):  # noqa: N802  (the name of the class it stands in for)
        return list(layers)

    @staticmethod
    def transfer_one_layer_mla(dst, indices_dst, src, indices_src, *, block_quota=None):
        dst[indices_dst] = src[indices_src]

    @staticmethod
    def transfer_all_layer(dst, indices_dst, src, indices_src, *, block_quota=None):
        for d, s in zip(dst, src):
            d[indices_dst] = s[indices_src]


def quota_calls(bench: Bench, quotas: list, pool, device_pool, op: str, host_idx, dev_idx):
    if bench.smoke:
        ops = CpuOps
    else:
        from sglang_hicache_jit import ops
    views = [host_layer_view(pool, layer) for layer in range(LAYERS)]
    rows = pool.translate_host_indices(host_idx).to(bench.device)
    dev = dev_idx.to(bench.device)
    layers = device_pool.kv_buffer
    if op == "backup":
        host_table = ops.LayerTable(views, name="host", written=True)
        dev_table = ops.LayerTable(layers, name="device")
    for quota in quotas:
        budget = quota or None
        if op == "load":
            def transfer(idx, layer, budget=budget):
                ops.transfer_one_layer_mla(layers[layer], idx[1], views[layer], idx[0], block_quota=budget)
        else:
            def transfer(idx, layer, budget=budget):
                ops.transfer_all_layer(host_table, idx[0], dev_table, idx[1], block_quota=budget)
        name = f"q{quota}" if quota else "default"
        yield name, {"provider": name, "quota": quota or None}, (rows, dev), transfer, None


def whole_call(transfer, idx, op: str, fresh: bool):
    """One load (the per-layer loop) or one backup. With ``fresh``, each call gets its own copies of the
    index tensors, as each of SGLang's loads and backups does: a plan kept for one tensor serves the layers
    of one load, never the next call."""
    def call():
        i = tuple(t.clone() for t in idx) if fresh else idx
        if op == "load":
            for layer in range(LAYERS):
                transfer(i, layer)
        else:
            transfer(i, None)
    return call


def layer_times(bench: Bench, transfer, idx, fresh: bool, reps: int = 5) -> dict:
    """A load's time to its first layer and to its last (medians of ``reps`` loads, CUDA events on the
    stream the loop runs on, recorded after each layer's call): when layer 0 is usable, when all are."""
    samples = []
    with bench.cuda.stream(bench.side):
        for _ in range(reps + 1):
            bench.cuda.synchronize()
            i = tuple(t.clone() for t in idx) if fresh else idx
            start = bench.cuda.Event(enable_timing=True)
            start.record()
            marks = []
            for layer in range(LAYERS):
                transfer(i, layer)
                marks.append(bench.cuda.Event(enable_timing=True))
                marks[-1].record()
            bench.cuda.synchronize()
            samples.append([start.elapsed_time(m) / 1e3 for m in marks])
    samples = samples[1:]  # the first one warms up
    return {"first_layer_s": statistics.median(s[0] for s in samples),
            "last_layer_s": statistics.median(s[-1] for s in samples)}


# --------------------------------------------------------------------------------------------------------

def run(args, out, workload: str) -> int:
    if getattr(args, "gather_blocks", None) is not None:
        from sglang_hicache_jit.transfer import staging

        if args.gather_blocks < 1:
            raise SystemExit(f"--gather-blocks must be a positive number of CTAs, got {args.gather_blocks}")
        staging.GATHER_BLOCKS = args.gather_blocks  # read at each gather, so every staging area of the run takes it
    bench = Bench(args)
    if workload == "layouts":
        providers = dict(parse_provider(text) for text in args.providers)
        calls = lambda *a: pool_calls(bench, providers, *a)  # noqa: E731
    else:
        calls = lambda *a: quota_calls(bench, args.quotas, *a)  # noqa: E731
    device_pool = bench.device_pool()
    failed = 0
    stopped = False
    for layout in args.layouts:
        for page in args.pages:
            if bench.out_of_time():
                stopped = True
                break
            pool, register_s = bench.host_pool(device_pool, layout, page)
            print(f"{layout}, page {page}: {pool.kv_buffer.nbytes / 1e9:.2f} GB host pool, registered in "
                  f"{register_s:.2f} s; kernel path: {pool.transfer_path} ({pool.transfer_path_reason})", flush=True)
            for tokens in args.tokens:
                if bench.out_of_time():
                    stopped = True
                    break
                host_idx, dev_idx = bench.workloads.make_indices(tokens, page, pool.size, args.device_slots,
                                                                 seed=tokens + page)
                for op in args.ops:
                    failed += _cell(bench, out, pool, device_pool, layout, page, tokens, op, host_idx, dev_idx, calls)
            del pool
            bench.release()
    if stopped:
        print(f"stopped after {args.budget_s:.0f} s (--budget-s): the cells not measured are left out", flush=True)
    print("\n" + "\n".join(table(out.rows, workload)), flush=True)
    return 1 if failed else 0


def _cell(bench, out, pool, device_pool, layout, page, tokens, op, host_idx, dev_idx, calls) -> int:
    direction = "h2d" if op == "load" else "d2h"
    nbytes = tokens * pool.row_bytes * LAYERS
    cell = {"layout": layout, "page": page, "tokens": tokens, "op": op, "direction": direction, "bytes": nbytes,
            "row_bytes": pool.row_bytes, "layers": LAYERS}
    base = bench.measure(bench.ceiling.call(nbytes, direction), nbytes)
    link = base["alone_gbps"]
    _print(out.row(**cell, provider="contiguous", **_ratios(base, link), exact=None, **base))  # a plain copy_
    failed = 0
    for name, fields, idx, transfer, direct_mode in calls(pool, device_pool, op, host_idx, dev_idx):
        call = whole_call(transfer, idx, op, not bench.args.keep_indices)
        pool.direct_mode = direct_mode or "auto"
        pool.last_direct_mode = None
        try:
            ok = exact(bench, pool, device_pool, host_idx, dev_idx, op, call)
            ran = pool.last_direct_mode
            result = bench.measure(call, nbytes)
            if op == "load":
                result.update(layer_times(bench, transfer, idx, not bench.args.keep_indices, 1 if bench.smoke else 5))
        except Exception as exc:  # a path this tree lacks, or one that fails: a row says so, the run goes on
            bench.cuda.synchronize()
            _print(out.row(**cell, **fields, exact=False, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            failed += 1
            continue
        finally:
            pool.direct_mode = "auto"
        failed += not ok
        _print(out.row(**cell, **fields, ran=ran, exact=ok, **_ratios(result, link), **result,
                       contiguous_gbps=link, contiguous_slowdown=base.get("slowdown")))
    return failed


def _ratios(result: dict, link: float) -> dict:
    ratios = {"alone_ratio": result["alone_gbps"] / link}
    if "beside_gbps" in result:
        ratios["beside_ratio"] = result["beside_gbps"] / link
    return ratios


def _print(row: dict) -> None:
    head = f"{row['layout']:<17} p{row['page']:<4} {row['tokens']:>6} {row['op']:<6} {row['provider']:<10}"
    if row.get("error"):
        print(f"{head} error: {row['error']}", flush=True)
        return
    beside = (f"  beside {row['beside_gbps']:6.1f} GB/s x{row['beside_ratio']:.2f} matmul "
              f"{row['slowdown'] * 100:+.1f}%") if "beside_gbps" in row else ""
    ran = f"  [{row['ran']}]" if row.get("ran") else ""
    if "first_layer_s" in row:
        ran += f"  layer 0 at {row['first_layer_s'] * 1e3:.2f} ms, all at {row['last_layer_s'] * 1e3:.2f} ms"
    exact = {True: "  exact=yes", False: "  exact=NO", None: ""}[row["exact"]]
    print(f"{head} alone {row['alone_gbps']:6.1f} GB/s x{row['alone_ratio']:.2f}{beside}{exact}{ran}", flush=True)


# --------------------------------------------------------------------------------------------------------
# The markdown table printed at the end (and by `tools/bench.py report FILE`)

def _figure(row: dict | None) -> str:
    if row is None:
        return "-"
    if row.get("error"):
        return "error"
    text = f"{row['alone_ratio']:.2f}"
    if "beside_ratio" in row:
        text += f" / {row['beside_ratio']:.2f} {row['slowdown'] * 100:+.1f}%"
    if row.get("bench") == "cta" and "beside_gbps" in row:
        points = max(row["slowdown"] * 100, 0.5)
        text += f" ({row['beside_gbps'] / points:.1f})"
    return text + ("" if row.get("exact") else " NOT EXACT")


def table(rows: list[dict], workload: str) -> list[str]:
    rows = [r for r in rows if r.get("bench") == workload]
    if not rows:
        return [f"({workload}: no rows)"]
    providers = list(dict.fromkeys(r["provider"] for r in rows if r["provider"] != "contiguous"))
    cells = {}
    for r in rows:
        cells.setdefault((r["layout"], r["page"], r["tokens"], r["op"]), {})[r["provider"]] = r
    beside = any("beside_ratio" in r for r in rows)
    what = "alone / beside the matmul, matmul slowdown" if beside else "alone"
    lines = [f"{workload}: ratio to the contiguous copy alone ({what})"
             + ("; (GB/s beside per point of slowdown, floor 0.5)" if workload == "cta" and beside else "")
             + "; contiguous: GB/s alone / ratio beside, slowdown",
             "| layout | page | tokens | op | contiguous | " + " | ".join(providers) + " |",
             "|" + "---|" * (5 + len(providers))]
    for (layout, page, tokens, op), by in cells.items():
        c = by.get("contiguous")
        contiguous = "-" if c is None else f"{c['alone_gbps']:.1f}" + (
            f" / {c['beside_ratio']:.2f} {c['slowdown'] * 100:+.1f}%" if "beside_ratio" in c else "")
        tok = f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)
        lines.append(f"| {layout} | {page} | {tok} | {op} | {contiguous} | "
                     + " | ".join(_figure(by.get(p)) for p in providers) + " |")
    loads = [(key, by) for key, by in cells.items() if any("first_layer_s" in r for r in by.values())]
    if loads:
        lines += ["", f"{workload}, loads alone: ms to layer 0 / to the last layer",
                  "| layout | page | tokens | " + " | ".join(providers) + " |", "|" + "---|" * (3 + len(providers))]
        for (layout, page, tokens, _), by in loads:
            tok = f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)
            times = [f"{by[p]['first_layer_s'] * 1e3:.2f} / {by[p]['last_layer_s'] * 1e3:.2f}"
                     if "first_layer_s" in by.get(p, {}) else "-" for p in providers]
            lines.append(f"| {layout} | {page} | {tok} | " + " | ".join(times) + " |")
    return lines
