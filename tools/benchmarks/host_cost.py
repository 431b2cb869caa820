"""``host-cost``: host cost of ops.py's Python layer per transfer call, measured without a GPU.

Tensors are CPU memory dressed as cuda:0 or pinned memory and the C launcher
is a no-op C function with the same signature, called through ctypes as the
real one is (tests/fake_gpu.py), so what is timed is the validation, the
argument packing and the ctypes call; not the CUDA launch, the runtime's
stream and device queries (stubbed), nor, for CPU indices, torch's pinned
staging and upload (stubbed: .pin_memory() and .to() return the tensor).
The stand-in tensors make each tensor attribute read ~60 ns dearer than a
real one, in both columns.
Needs a C compiler (cc). Run from the checkout:

    python3 tools/bench.py host-cost                 # this tree's ops.py
    python3 tools/bench.py host-cost --baseline main # ... and main's, side by side

The "routed" rows call integrations/sglang/ops.py as SGLang 0.5.23's host
pools do once the plugin is active (keyword arguments, element_dim, a
per-layer view of a page_first buffer); with --baseline, that revision's
integrations/sglang/ops.py (sglang_ops.py before), compat.py and ops.py are used together.
The "pointer table" rows time transfer/pointer_tables.py's check of a table
it has checked before (a stand-in CUDA table: data pointer and version; a CPU
table: its bytes compared), the cost every all-layer call pays per table; the
buffers the tables point into are registered as the SGLang plugin registers
a pool's (transfer/extents.py), since no driver answers here. A tree without
pointer_tables.py shows "-" there.

On a GPU, ``tools/bench.py overhead`` (``sglang-hicache-jit bench --mode overhead``) measures the whole call.
"""

import importlib
import importlib.util
import subprocess
import sys
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

TOKENS, SLOTS, LAYERS, ROW = 64, 4096, 8, 1152


def load_module(rev: str, path: str, package: str, **rebind):
    """``path`` as of git revision ``rev``, as a module of ``package`` (its
    relative imports resolve to this tree's other modules, then the globals
    named in ``rebind`` are pointed at the baseline's own modules)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"],
                            check=True, capture_output=True, text=True).stdout
    name = f"{package}._{Path(path).stem}_baseline"
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = package
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    module.__dict__.update(rebind)
    sys.modules[name] = module
    return module


# Where the modules a one-file ops.py imports lazily live since the layout moves (docs/layout.md).
MOVED = {"sglang_hicache_jit.arch": "sglang_hicache_jit.buildcache.arch",
         "sglang_hicache_jit.loader": "sglang_hicache_jit.buildcache.loader"}


def load_baseline(rev: str):
    """(ops, routed SGLang ops) as of git revision ``rev``: a revision with the one-file ops.py of
    before the layout moves (from this tree on, ops.py is an alias and the ops span transfer/)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:sglang_hicache_jit/ops.py"],
                            check=True, capture_output=True, text=True).stdout
    if "sys.modules[__name__]" in source:
        raise SystemExit(f"--baseline {rev}: its ops.py is the alias of transfer/ops.py; compare against a "
                         "revision from before the layout moves, or time each tree on its own")
    for old, new in MOVED.items():  # its lazy 'from .arch import ...' and 'from .loader import ...'
        sys.modules.setdefault(old, importlib.import_module(new))
    ops = load_module(rev, "sglang_hicache_jit/ops.py", "sglang_hicache_jit")
    compat = load_module(rev, "sglang_hicache_jit/compat.py", "sglang_hicache_jit", ops=ops)
    try:
        routed = load_module(rev, "sglang_hicache_jit/integrations/sglang/ops.py",
                             "sglang_hicache_jit.integrations.sglang", ops=ops, compat=compat)
    except subprocess.CalledProcessError:  # revisions before integrations/sglang/ became a package
        routed = load_module(rev, "sglang_hicache_jit/integrations/sglang_ops.py", "sglang_hicache_jit.integrations",
                             ops=ops, compat=compat)
    return ops, routed


def layer_table(ops, groups, **kwargs):
    """A LayerTable whose device pointer tables are CPU tensors (built on a
    GPU by LayerTable.tables on first use)."""
    import torch

    table = ops.LayerTable(groups[0] if len(groups) == 1 else tuple(groups), **kwargs)
    table._tables[0] = [torch.tensor([s.ptr for s in sides], dtype=torch.uint64) for sides in table.sides]
    return table


def calls(ops, routed):
    """The timed calls, host -> GPU as in bench --mode overhead (the routed
    backup: GPU -> host)."""
    import torch

    import fake_gpu

    dev = [[fake_gpu.cuda(torch.zeros(SLOTS, ROW, dtype=torch.uint8)) for _ in range(LAYERS)] for _ in range(2)]
    # page_first host pool: [slots, layers, row]; a layer is a strided view.
    host_buf = [torch.zeros(SLOTS, LAYERS, ROW, dtype=torch.uint8) for _ in range(2)]
    host = [[fake_gpu.pinned(buf[:, layer]) for layer in range(LAYERS)] for buf in host_buf]
    idx_gpu = fake_gpu.cuda(torch.arange(TOKENS))
    idx_cpu = torch.arange(TOKENS)
    mla_dev, mla_host = layer_table(ops, dev[:1], written=True), layer_table(ops, host[:1])
    mha_dev, mha_host = layer_table(ops, dev, written=True), layer_table(ops, host)
    # As SGLang's MLA pools keep them: device layers (slots, 1, dim); a
    # page_first host buffer (slots, layers, 1, dim) with per-layer views
    # (data_refs) cut once; a layer_first buffer (layers, slots, 1, dim)
    # indexed per call (a fresh view each time).
    # The probe's verdict, without a GPU: in transfer/route.py since issue 34, in the routed ops before.
    verdicts = getattr(routed, "_kernel_ok", None)
    if verdicts is None:
        from sglang_hicache_jit.transfer import route

        verdicts = route._verdicts
    verdicts[ROW] = True
    mla_dev3 = [fake_gpu.cuda(torch.zeros(SLOTS, 1, ROW, dtype=torch.uint8)) for _ in range(LAYERS)]
    pf_buf = fake_gpu.pinned(torch.zeros(SLOTS, LAYERS, 1, ROW, dtype=torch.uint8))
    data_refs = [fake_gpu.pinned(pf_buf.transpose(0, 1)[layer]) for layer in range(LAYERS)]
    lf_buf = torch.zeros(LAYERS, SLOTS, 1, ROW, dtype=torch.uint8)
    # The backup: every layer, GPU -> page_first host, through the pointer
    # table of the device layers and compat's table of host layer addresses
    # (put in its cache by hand: building it needs a GPU).
    dev_ptrs = fake_gpu.cuda(torch.tensor([t.data_ptr() for t in mla_dev3], dtype=torch.uint64))
    host_rows = torch.tensor([pf_buf.data_ptr() + layer * ROW for layer in range(LAYERS)], dtype=torch.uint64)
    for key in ((id(pf_buf), pf_buf.data_ptr(), LAYERS, ROW, str(dev_ptrs.device)),  # before pointer_tables.py
                (id(pf_buf), pf_buf.data_ptr(), (LAYERS, ROW), str(dev_ptrs.device))):
        routed.compat._host_tables[key] = (weakref.ref(pf_buf), fake_gpu.cuda(host_rows))
    if hasattr(routed.compat, "_table_key"):  # keyed on the memory's owner since 2026-12-06
        root = routed.compat._root(pf_buf)
        routed.compat._host_tables[routed.compat._table_key(pf_buf, root, (LAYERS, ROW), dev_ptrs.device)] = (
            weakref.ref(root), fake_gpu.cuda(host_rows))
    # A layer_first host pool (layers, slots, 1, dim) and its per-layer views (data_refs) and tables, as
    # SGLang's layer_first pools keep them: the D2H backup of every layer through two pointer tables
    # (MLA) or four (MHA).
    lf_host = [fake_gpu.pinned(torch.zeros(LAYERS, SLOTS, 1, ROW, dtype=torch.uint8)) for _ in range(2)]
    lf_refs = [[buf[layer] for layer in range(LAYERS)] for buf in lf_host]
    lf_ptrs = [fake_gpu.cuda(torch.tensor([t.data_ptr() for t in refs], dtype=torch.uint64)) for refs in lf_refs]
    mha_dev_ptrs = [fake_gpu.cuda(torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)) for layers in dev]
    cpu_table = torch.tensor([t.data_ptr() for t in mla_dev3], dtype=torch.uint64)  # a table in host memory
    pointer_tables = getattr(importlib.import_module(ops.__package__), "pointer_tables", None)
    if pointer_tables is not None:  # no driver to ask here: register what the tables point into
        from sglang_hicache_jit.transfer import extents

        for t in [*mla_dev3, pf_buf, *lf_refs[0], *lf_refs[1], *dev[0], *dev[1]]:
            extents.register(t)
    suite = {
        "routed MLA load, page_first": lambda: routed.transfer_hicache_one_layer_mla(
            page_size=64, cache_dst=mla_dev3[3], cache_src=data_refs[3], indices_dst=idx_gpu, indices_src=idx_gpu,
            element_dim=ROW),
        "routed MLA load, layer_first": lambda: routed.transfer_hicache_one_layer_mla(
            page_size=64, cache_dst=mla_dev3[3], cache_src=fake_gpu.pinned(lf_buf[3]), indices_dst=idx_gpu,
            indices_src=idx_gpu, element_dim=ROW),
        "routed MLA backup, all layers": lambda: routed.transfer_kv_all_layer_mla_lf_pf(
            src_layers=dev_ptrs, dst=pf_buf, src_indices=idx_gpu, dst_indices=idx_gpu, item_size=ROW,
            dst_layout_dim=LAYERS * ROW, num_layers=LAYERS),
        # SGLang's MHA page_first pool (0.5.17+) with the JIT names: its per-layer views (k_data_refs) cut once.
        "routed MHA load, page_first": lambda: routed.transfer_hicache_one_layer(
            k_cache_dst=dev[0][3], v_cache_dst=dev[1][3], indices_dst=idx_gpu, k_cache_src=host[0][3],
            v_cache_src=host[1][3], indices_src=idx_gpu, element_dim=ROW),
        "MLA one-layer, GPU indices": lambda: ops.transfer_one_layer_mla(dev[0][0], idx_gpu, host[0][0], idx_gpu),
        "MLA one-layer, CPU indices": lambda: ops.transfer_one_layer_mla(dev[0][0], idx_cpu, host[0][0], idx_cpu),
        # SGLang's routed ops cut a fresh view of each pool buffer per call.
        "MLA one-layer, fresh views": lambda: ops.transfer_one_layer_mla(
            dev[0][0].view(SLOTS, -1), idx_gpu, fake_gpu.pinned(host_buf[0][:, 0]), idx_gpu),
        "MHA one-layer, GPU indices": lambda: ops.transfer_one_layer(dev[0][0], dev[1][0], idx_gpu,
                                                                     host[0][0], host[1][0], idx_gpu),
        "MLA all-layer (LayerTable)": lambda: ops.transfer_all_layer(mla_dev, idx_gpu, mla_host, idx_gpu),
        "MHA all-layer (LayerTable)": lambda: ops.transfer_all_layer(mha_dev, idx_gpu, mha_host, idx_gpu),
        "routed MLA backup, 2 tables": lambda refs=lf_refs: routed.transfer_kv_all_layer_mla(  # refs: registered
            dev_ptrs, lf_ptrs[0], idx_gpu, idx_gpu, ROW, LAYERS),
        "routed MHA backup, 4 tables": lambda: routed.transfer_kv_all_layer(
            mha_dev_ptrs[0], lf_ptrs[0], mha_dev_ptrs[1], lf_ptrs[1], idx_gpu, idx_gpu, ROW, LAYERS),
    }
    if pointer_tables is not None:
        suite["pointer table, CUDA, cached"] = lambda: pointer_tables.checked(dev_ptrs, "table")
        suite["pointer table, CPU, cached"] = lambda: pointer_tables.checked(cpu_table, "table")
    if hasattr(routed, "transfer_hicache_all_layer_staged_lf_pf") and pointer_tables is not None:
        suite.update(staged_write_backs(routed))
    return suite


# SGLang's staged write-back (0.5.17+, MHA page_first, the kernel io_backend): Llama-3.1-8B's pool, 32 layers of
# 8 KV heads of 128 bf16, pages of 64, SGLang's staging buffers of 64 pages per cache.
WB_LAYERS, WB_HEADS, WB_DIM, WB_PAGE, WB_SLOTS, WB_DEVICE_SLOTS = 32, 8, 128, 64, 3 * 8192, 8192


def staged_write_backs(routed) -> dict:
    """The write-through of a request's new pages (64 and 512 tokens) and of a whole 8K-token prompt (into fresh
    pages, and into scattered ones), as SGLang calls it: host slots on the CPU, device slots on the GPU,
    through the staging area (its gather launched through the no-op launcher, its copies described and handed
    to nothing: fake_gpu.stub_copy_engines)."""
    import torch

    import fake_gpu
    from sglang_hicache_jit.transfer import extents, route

    route._verdicts[WB_HEADS * WB_DIM * 2] = True
    bf16 = torch.bfloat16
    device = [[fake_gpu.cuda(torch.empty(WB_DEVICE_SLOTS, WB_HEADS, WB_DIM, dtype=bf16)) for _ in range(WB_LAYERS)]
              for _ in range(2)]
    staging_buffers = [fake_gpu.cuda(torch.empty(64 * WB_PAGE, WB_LAYERS, WB_HEADS, WB_DIM, dtype=bf16))
                       for _ in range(2)]
    for t in [*device[0], *device[1], *staging_buffers]:
        extents.register(t)
    tables = [fake_gpu.cuda(torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)) for layers in device]
    host = fake_gpu.pinned(torch.empty(2, WB_SLOTS, WB_LAYERS, WB_HEADS, WB_DIM, dtype=bf16))
    suite = {}
    pages = torch.randperm(WB_SLOTS // WB_PAGE, generator=torch.Generator().manual_seed(7))[:8192 // WB_PAGE]
    scattered = (pages[:, None] * WB_PAGE + torch.arange(WB_PAGE)).flatten()  # pages a long-running pool hands out
    for tokens, label in ((64, ""), (512, ""), (8192, ""), (8192, ", scattered pages")):
        # Fresh pages, as HiCache's allocator hands them at first; or scattered ones, as after churn.
        host_idx = scattered if label else torch.arange(WB_PAGE * 7, WB_PAGE * 7 + tokens)
        device_idx = fake_gpu.cuda(torch.randperm(WB_DEVICE_SLOTS, generator=torch.Generator().manual_seed(tokens))[
            :tokens])

        def write_back(host_idx=host_idx, device_idx=device_idx, device=device):  # device: the tables' memory
            # A fresh view of each host buffer per call, as SGLang's k_buffer / v_buffer properties hand them.
            routed.transfer_hicache_all_layer_staged_lf_pf(
                k_ptr_src=tables[0], v_ptr_src=tables[1], src_indices=device_idx, dst_indices=host_idx,
                staging_k=staging_buffers[0], staging_v=staging_buffers[1], dst_k=fake_gpu.pinned(host[0]),
                dst_v=fake_gpu.pinned(host[1]), page_size=WB_PAGE)

        suite[f"routed MHA staged write-back, {tokens} tokens{label}"] = write_back
    return suite


def add_arguments(p, name: str) -> None:
    p.add_argument("--baseline", metavar="REV", help="also time ops.py of this git revision")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds; the best counts (the "
                   "least disturbed by other processes)")
    p.add_argument("--calls", type=int, default=5000, help="calls per round")


def run(args, out, name: str) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    import fake_gpu
    from sglang_hicache_jit import ops as current_ops
    from sglang_hicache_jit.integrations.sglang import ops as current_routed

    versions = {"this tree": (current_ops, current_routed)}
    if args.baseline:
        versions = {args.baseline: load_baseline(args.baseline), **versions}
    suites = {}
    with (fake_gpu.stub_cuda_runtime(current_ops), fake_gpu.stub_uploads(), fake_gpu.stub_streams(),
          fake_gpu.stub_device_tensors(), fake_gpu.stub_copy_engines()):
        for label, (ops, routed) in versions.items():
            with fake_gpu.stub_cuda_runtime(ops):
                fake_gpu.install(ops, handle=fake_gpu.noop_library())
            suites[label] = calls(ops, routed)
        samples = {(label, case): [] for label, suite in suites.items() for case in suite}
        for _ in range(args.rounds):  # interleaved, so drift hits every column alike
            for label, suite in suites.items():
                ops = versions[label][0]
                with fake_gpu.stub_cuda_runtime(ops):
                    for case, fn in suite.items():
                        fn()
                        start = time.perf_counter()
                        for _ in range(args.calls):
                            fn()
                        samples[label, case].append((time.perf_counter() - start) / args.calls * 1e6)
    labels = list(suites)
    print(f"{'us per call (best of ' + str(args.rounds) + ' rounds)':<52}" + "".join(f"{lb:>14}" for lb in labels)
          + ("   change" if len(labels) == 2 else ""))
    for case in dict.fromkeys(case for suite in suites.values() for case in suite):
        best = [min(samples[label, case]) if (label, case) in samples else None for label in labels]
        change = f"   {best[1] / best[0] - 1:+.0%}" if len(best) == 2 and None not in best else ""
        print(f"{case:<52}" + "".join("-".rjust(14) if m is None else f"{m:14.2f}" for m in best) + change)
        for label, value in zip(labels, best):
            if value is not None:
                out.row(case=case, tree=label, us_per_call=value, rounds=args.rounds, calls=args.calls)
    return 0
