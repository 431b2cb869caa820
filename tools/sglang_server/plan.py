"""Which engines each mode of the server tests starts, in priority order.

A cell is one engine: (release, model, io_backend, layout, mode). SGLang's server arguments rewrite two
of the six io_backend x layout pairs (``kernel`` + ``page_first_direct`` runs as ``direct``, ``direct`` +
``page_first`` as ``page_first_direct``), so the matrix runs the four pairs a server really serves in
every mode, and the two rewritten requests once each (their effective arguments are recorded, and their
outputs must equal the pair they become).

* ``smoke``: one configuration (MLA, kernel, page_first) as plugin, upstream and the negative control,
  beside a short TTFT run of the KV-realistic model;
* ``matrix``: MLA then MHA, each pair in upstream / plugin / plugin-nojit, a negative control per model,
  then the rewritten requests and a control with the plugin on;
* ``ttft``: the KV-realistic MLA model, one engine at a time: upstream, plugin, plugin-nojit;
* ``realsize``: the real-size models (``models.REAL_SIZE``), one engine at a time, per model: upstream,
  plugin, plugin-nojit (TTFT and TPOT each), then HiCache off (TPOT only);
* ``cp2``: the two-rank configurations of the layer-sharded pools (``attn_cp_size`` 2), for a
  two-GPU machine (issue 28); ``--dry-run`` plans and checks them on one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PAIRS = (("kernel", "page_first"), ("kernel", "layer_first"), ("direct", "page_first_direct"),
         ("direct", "layer_first"))
REWRITTEN = {("kernel", "page_first_direct"): ("direct", "page_first_direct"),
             ("direct", "page_first"): ("direct", "page_first_direct")}
EQUAL_MODES = ("upstream", "plugin", "plugin-nojit")
ALL_MODES = ("upstream", "plugin", "plugin-nojit", "control", "control-plugin", "hicache-off",
             "plugin-nostaging", "plugin-sidestream", "plugin-loadquota2", "plugin-plain",
             "plugin-resident")  # engine_cell.MODES


@dataclass
class Cell:
    release: str
    model: str  # a kind of models.py
    io_backend: str
    layout: str
    mode: str  # engine_cell.MODES
    workload: str = "correctness"
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        kv = self.extra.get("kv_dtype")
        return f"{self.release}-{self.model}-{self.io_backend}-{self.layout}-{self.mode}" + (f"-{kv}" if kv else "")


def smoke(release: str) -> list:
    """Three engines of one configuration, and a short TTFT run that starts the 61-layer model once
    (its numbers are taken beside the others, so they only show that the ttft mode works)."""
    return [Cell(release, "mla-tiny", "kernel", "page_first", m) for m in ("plugin", "upstream", "control")] + [
        Cell(release, "mla-kv", "kernel", "page_first", "plugin", workload="ttft",
             extra={"lengths": [2048, 8192], "rounds": 2})]


def matrix(release: str, models=("mla-tiny", "mha-tiny")) -> list:
    cells = []
    for model in models:
        for io_backend, layout in PAIRS:
            cells += [Cell(release, model, io_backend, layout, m) for m in EQUAL_MODES]
            if (io_backend, layout) in (("kernel", "page_first"), ("direct", "page_first_direct")) and \
                    (model.startswith("mla") or io_backend == "kernel"):
                cells.append(Cell(release, model, io_backend, layout, "control"))
    for model in models:
        cells += [Cell(release, model, io, layout, "plugin") for io, layout in REWRITTEN]
    cells.append(Cell(release, models[0], "kernel", "page_first", "control-plugin"))
    return cells


def ttft(release: str) -> list:
    """One engine per mode, one at a time; 3 rounds per length (about 110 s an engine with its start)."""
    return [Cell(release, "mla-kv", "kernel", "page_first", m, workload="ttft", extra={"rounds": 3})
            for m in EQUAL_MODES]


REALSIZE_MODES = ("upstream", "plugin", "plugin-nojit", "hicache-off")
# Asked for by name only (--modes), each an A/B of one choice (engine_cell.MODES): staging off, the staged
# gather on a side stream, the one-layer loads at upstream's CTA budget, the plain copy loop, the resident loader.
REALSIZE_EXTRA_MODES = ("plugin-nostaging", "plugin-sidestream", "plugin-loadquota2", "plugin-plain",
                        "plugin-resident")
# The real-size engines: decode CUDA graphs on (up to the TPOT batch and the traffic beside it), prefill
# graphs off (prefills of 8K-32K tokens gain nothing from them, and capturing them costs each start).
REALSIZE_ARGS = {"disable_cuda_graph": False, "disable_prefill_cuda_graph": True, "cuda_graph_max_bs_decode": 48,
                 "cuda_graph_max_bs": 48}


def realsize(release: str, models=("mha-8b", "mla-v2lite"), modes=REALSIZE_MODES) -> list:
    """Per model, one engine per mode, in this order (the three modes the issue compares first).

    The kernel + page_first pair is SGLang's default HiCache configuration, so upstream runs its
    sgl-kernel there and the plugin its defaults."""
    return [Cell(release, model, "kernel", "page_first", mode, workload="realsize", extra={"extra_args": REALSIZE_ARGS})
            for model in models for mode in modes]


def cp2(release: str) -> list:
    """The seed's configurations with two attention context-parallel ranks (issue 28): bf16 and FP8 MLA
    rows, page_first + kernel (the seed's cell) and page_first_direct + direct, plugin off and on.

    SGLang 0.5.23 builds layer-sharded host pools only for a DSA model on a PD *prefill* worker with
    prefill context parallelism (``--enable-dsa-cache-layer-split --enable-prefill-cp --cp-strategy
    interleave``, ``--disaggregation-mode prefill``, the mooncake transfer backend): its server arguments
    refuse the flag elsewhere. A served request then also needs a decode worker and a router; those,
    and the mooncake and DSA kernels' wheels, are what a two-GPU run still has to bring."""
    cells = []
    for kv_dtype in ("auto", "fp8_e4m3"):
        for io_backend, layout in (("kernel", "page_first"), ("direct", "page_first_direct")):
            args = {"tp_size": 2, "attn_cp_size": 2, "enable_prefill_cp": True, "cp_strategy": "interleave",
                    "enable_dsa_cache_layer_split": True, "disaggregation_mode": "prefill",
                    "disaggregation_transfer_backend": "mooncake", "kv_cache_dtype": kv_dtype}
            for mode in ("upstream", "plugin"):
                cell = Cell(release, "mla-dsa", io_backend, layout, mode, extra={"extra_args": args, "gpus": 2})
                cell.extra["kv_dtype"] = kv_dtype
                cells.append(cell)
    return cells


PLANS = {"smoke": smoke, "matrix": matrix, "ttft": ttft, "realsize": realsize, "cp2": cp2}


def select(cells: list, *, only: str = "", skip: str = "") -> list:
    """The cells whose name contains one of ``only``'s comma-separated parts (all where it is empty) and
    none of ``skip``'s: a later call runs what an earlier one did not reach."""
    wanted = [part for part in only.split(",") if part]
    unwanted = [part for part in skip.split(",") if part]
    return [c for c in cells if (not wanted or any(w in c.name for w in wanted))
            and not any(u in c.name for u in unwanted)]


def effective(io_backend: str, layout: str) -> tuple:
    """What SGLang's server arguments make of a requested pair (0.5.17-0.5.23 agree)."""
    return REWRITTEN.get((io_backend, layout), (io_backend, layout))


def spec(cell: Cell, *, model_dir: str, vocab: int, port: int, device_tokens: int | None = None) -> dict:
    """The JSON engine_cell.py takes."""
    from sglang_server import workload

    if cell.workload == "ttft":
        tokens = device_tokens or 49152
        base = {"device_tokens": tokens, "host_ratio": 2.0, "chunk": 8192, "max_running": 16}
    elif cell.workload == "realsize":
        # 44K device tokens hold one 32K prefix beside the decoders but not two, so the fillers evict it;
        # the host holds three times that (every prefix and its fillers). 64 requests: the decode batch,
        # the traffic and the TTFT decoders.
        base = {"device_tokens": device_tokens or 45056, "host_ratio": 3.0, "chunk": 8192, "max_running": 64,
                "mem_fraction": 0.85, "lengths": [8192, 32768], "rounds": 7, "tpot_window_s": 6.0}
    else:
        base = {"device_tokens": device_tokens or workload.DEVICE_TOKENS, "host_ratio": workload.HOST_RATIO}
    out = {"cell": cell.name, "release": cell.release, "model": model_dir, "kind": cell.model,
           "io_backend": cell.io_backend, "layout": cell.layout, "mode": cell.mode, "workload": cell.workload,
           "vocab": vocab, "port": port, **base}
    out.update(cell.extra)
    return out
