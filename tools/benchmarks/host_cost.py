"""``host-cost``: host cost of the transfer ops' Python layer per call, measured without a GPU.

Tensors are CPU memory dressed as cuda:0 or pinned memory and the C launcher
is a no-op C function with the same signature, called through ctypes as the
real one is (tests/fake_gpu.py), so what is timed is the validation, the
argument packing and the ctypes call; not the CUDA launch, the runtime's
stream and device queries (stubbed), nor, for CPU indices, torch's pinned
staging and upload (stubbed: .pin_memory() and .to() return the tensor).
The stand-in tensors make each tensor attribute read ~60 ns dearer than a
real one, in both columns.
Needs a C compiler (cc). Run from the checkout:

    python3 tools/bench.py host-cost                 # this tree
    python3 tools/bench.py host-cost --baseline main # ... and main's, side by side

``--baseline REV`` exports that revision's tree (git archive) to a temp folder and times its package in a
child process with this harness (this file and tests/fake_gpu.py), between two halves of this tree's rounds,
so drift over the run reaches both columns; a case the older tree cannot run shows "-".

The "routed" rows call integrations/sglang/ops.py as SGLang 0.5.23's host
pools do once the plugin is active (keyword arguments, element_dim, a
per-layer view of a page_first buffer). The "pointer table" rows time
transfer/pointer_tables.py's check of a table
it has checked before (a stand-in CUDA table: data pointer and version; a CPU
table: its bytes compared), the cost every all-layer call pays per table; the
buffers the tables point into are registered as the SGLang plugin registers
a pool's (transfer/extents.py), since no driver answers here. The "staged
write-back" rows run SGLang's staged write-back through the staging area.

On a GPU, ``tools/bench.py overhead`` (``sglang-hicache-jit bench --mode overhead``) measures the whole call.
"""
import importlib
import subprocess
import sys
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

TOKENS, SLOTS, LAYERS, ROW = 64, 4096, 8, 1152


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
    p.add_argument("--baseline", metavar="REV", help="also time the package of this git revision (exported to a "
                   "temp folder, timed in a child process with this harness)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds; the best counts (the "
                   "least disturbed by other processes)")
    p.add_argument("--calls", type=int, default=5000, help="calls per round")


def measure(rounds: int, calls_per_round: int) -> dict:
    """{case: microseconds per call, best of ``rounds``} for the sglang_hicache_jit this process imports (None:
    a case that tree cannot run)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import fake_gpu
    from sglang_hicache_jit import ops
    from sglang_hicache_jit.integrations.sglang import ops as routed

    with (fake_gpu.stub_cuda_runtime(ops), fake_gpu.stub_uploads(), fake_gpu.stub_streams(),
          fake_gpu.stub_device_tensors(), fake_gpu.stub_copy_engines()):
        fake_gpu.install(ops, handle=fake_gpu.noop_library())
        suite = calls(ops, routed)
        best: dict = {}
        for case, fn in suite.items():
            try:
                fn()
            except Exception:  # noqa: BLE001 - an older tree without this path: its column shows "-"
                best[case] = None
        for _ in range(rounds):
            for case, fn in suite.items():
                if case in best and best[case] is None:
                    continue
                start = time.perf_counter()
                for _ in range(calls_per_round):
                    fn()
                us = (time.perf_counter() - start) / calls_per_round * 1e6
                best[case] = us if best.get(case) is None else min(best[case], us)
    return best


def _measure_revision(rev: str, rounds: int, calls_per_round: int) -> dict:
    """measure() of git revision ``rev``'s package, exported to a temp folder, in a child process."""
    import io
    import json
    import shutil
    import tarfile
    import tempfile

    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "sglang_hicache_jit"],
                             check=True, capture_output=True).stdout
    folder = tempfile.mkdtemp(prefix="hicache-host-cost-")
    try:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(folder, filter="data")
        code = (f"import json, sys; sys.path[:0] = {[folder, str(ROOT / 'tools')]!r}; "
                f"from benchmarks import host_cost; print(json.dumps(host_cost.measure({rounds}, {calls_per_round})))")
        result = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"--baseline {rev}: timing that tree failed:\n{result.stderr[-2000:]}")
        return json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run(args, out, name: str) -> int:
    if args.baseline:  # this tree's rounds in two halves around the baseline's, so drift reaches both columns
        first = measure((args.rounds + 1) // 2, args.calls)
        columns = {args.baseline: _measure_revision(args.baseline, args.rounds, args.calls)}
        second = measure(args.rounds // 2, args.calls) if args.rounds > 1 else first
        columns["this tree"] = {case: None if first[case] is None else min(first[case], second[case])
                                for case in first}
    else:
        columns = {"this tree": measure(args.rounds, args.calls)}
    labels = list(columns)
    cases = list(dict.fromkeys(case for column in columns.values() for case in column))
    width = max(len(case) for case in cases) + 2
    print(f"{'us per call (best of ' + str(args.rounds) + ' rounds)':<{width}}" + "".join(f"{lb:>14}" for lb in labels)
          + ("   change" if len(labels) == 2 else ""))
    for case in cases:
        best = [columns[label].get(case) for label in labels]
        change = f"   {best[1] / best[0] - 1:+.0%}" if len(best) == 2 and None not in best else ""
        print(f"{case:<{width}}" + "".join("-".rjust(14) if m is None else f"{m:14.2f}" for m in best) + change)
        for label, value in zip(labels, best):
            if value is not None:
                out.row(case=case, tree=label, us_per_call=value, rounds=args.rounds, calls=args.calls)
    return 0
