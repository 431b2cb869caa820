"""The index rule (transfer/bounds.py, docs/concepts.md) attacked on the CPU, on every path that runs there: the
direct path and its planners, the host pools, the routed SGLang ops and compat, and the kernel ops' Python
layer on tests/fake_gpu.py's stand-in device.

Each destination is a slice of a larger tensor whose rows before and after it are guard rows: a write outside
the addressed rows fails the test even where nothing raises. Every attack must end in one clear Python error
(TransferIndexError, or a ValueError/TypeError naming the argument) with nothing written, or in a no-op."""

import re

import pytest
import torch

import fake_gpu
from sglang_hicache_jit import compat, ops
from sglang_hicache_jit.errors import TransferIndexError
from sglang_hicache_jit.host_pool import MHADevicePool, MHAHostKVPool, MLADevicePool, MLAHostKVPool
from sglang_hicache_jit.integrations.sglang import ops as routed
from sglang_hicache_jit.transfer import bounds, direct, extents, launcher, plans

TOP = (1 << 63) - 1  # the largest int64
GUARD = 3


class Guarded:
    """``rows`` rows of ``row`` int32 elements inside GUARD guard rows on each side, all random."""

    def __init__(self, rows, *shape, seed=0, dtype=torch.int32):
        gen = torch.Generator().manual_seed(seed)
        self.whole = torch.randint(-1000, 1000, (rows + 2 * GUARD, *shape), generator=gen, dtype=dtype)
        self.before = self.whole.clone()
        self.t = self.whole[GUARD:GUARD + rows]

    def untouched(self) -> bool:
        return torch.equal(self.whole, self.before)


def named(error_text: str, argument: str) -> bool:
    return re.search(rf"\b{re.escape(argument)}\b", error_text) is not None


# ---------------------------------------------------------------------------
# The rule itself.

def test_check_rows_sees_runs_that_wrap_past_2_63():
    start, length = torch.tensor([TOP - 3]), torch.tensor([8])  # start + length wraps to a negative int64
    assert int((start + length).max()) < 0  # what the old check compared, and passed
    with pytest.raises(TransferIndexError, match=f"holds index {TOP - 3 + 7}, but its pool has only 16 slots"):
        bounds.check_rows("indices_dst", start, 16, length)
    with pytest.raises(TransferIndexError, match="holds index -1"):
        bounds.check_rows("indices_dst", torch.tensor([-1]), 16, torch.tensor([1]))  # a run never starts negative
    bounds.check_rows("indices_dst", torch.tensor([0, 8]), 16, torch.tensor([8, 8]))  # exactly fills the pool
    bounds.check_rows("indices_dst", torch.tensor([-5, 15]), 16)  # padding and the last slot


@pytest.mark.parametrize("small", [True, False], ids=["python-ints", "tensor-ops"])
def test_check_bounds_no_longer_wraps(monkeypatch, small):
    if not small:
        monkeypatch.setattr(direct, "SMALL_CHECK_RUNS", 0)
    runs = direct.Runs(torch.tensor([TOP - 3]), torch.tensor([0]), torch.tensor([8]))
    with pytest.raises(TransferIndexError, match="indices_dst"):
        direct.check_bounds(runs, 16, 16)


@pytest.mark.parametrize("seed", range(40))
def test_check_bounds_says_the_same_in_python_ints_as_in_tensor_ops(monkeypatch, seed):
    """A plan of a few runs is checked with Python ints (check_spans): the same runs pass, and a bad one
    raises the same error, naming the same side and index, as the tensor check."""
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 9, (1,), generator=gen))
    starts = torch.randint(-1, 15, (2, n), generator=gen)
    length = torch.randint(1, 6, (n,), generator=gen)
    if seed % 5 == 0:
        starts[0, -1] = TOP - 2  # a run whose last index would wrap in int64
    runs = direct.Runs(starts[0], starts[1], length)

    def outcome():
        try:
            direct.check_bounds(runs, 16, 18)
            return None
        except TransferIndexError as exc:
            return str(exc)

    small = outcome()
    monkeypatch.setattr(direct, "SMALL_CHECK_RUNS", 0)
    assert small == outcome()


def test_whole_pages_does_not_take_a_wrapping_page_for_a_page():
    # 2**63 - 4 .. 2**63 - 1, then -2**63 .. -2**63 + 3: "consecutive" modulo 2**64.
    page = torch.tensor([TOP - 3, TOP - 2, TOP - 1, TOP, -TOP - 1, -TOP, -TOP + 1, -TOP + 2])
    assert direct.whole_pages(page, 8) is None
    assert torch.equal(direct.whole_pages(torch.arange(16, 32), 8), torch.tensor([16, 24]))


def test_token_rows_refuses_tokens_outside_the_pool_before_multiplying():
    tokens = torch.tensor([1 << 62, (1 << 62) + 1])  # times 4 layers x 4 slots wraps to rows 0 and 1
    with pytest.raises(TransferIndexError, match=f"tokens holds index {(1 << 62) + 1}, but the host pool has only 32"):
        bounds.token_rows("tokens", tokens, page_size=4, page_rows=16, slots=32)
    rows = bounds.token_rows("tokens", torch.tensor([0, 5, -1, 31]), page_size=4, page_rows=16, slots=32)
    assert rows.tolist() == [0, 17, -1, 7 * 16 + 3]
    # On a GPU (here fake_gpu's stand-in) the indices are not read; an outside token becomes a row past any pool.
    rows = bounds.token_rows("tokens", fake_gpu.cuda(torch.tensor([32, 3, -2, TOP])), page_size=4, page_rows=16,
                             slots=32)
    assert rows.tolist() == [bounds.PAST_THE_END, 3, -2, bounds.PAST_THE_END]


@pytest.mark.parametrize("value,error", [(-1, ValueError), (4, ValueError), (1.0, TypeError), ("0", TypeError)])
def test_check_layer(value, error):
    with pytest.raises(error, match="layer_id"):
        bounds.check_layer(value, 4)


# ---------------------------------------------------------------------------
# The direct path on CPU tensors.

PAIRS_ROW = 4


def _direct(dst_idx, src_idx, page_size=1, rows=16):
    dst, src = Guarded(rows, PAIRS_ROW, seed=1), Guarded(rows, PAIRS_ROW, seed=2)
    error = None
    try:
        direct.copy_rows([(dst.t, src.t)], torch.tensor(dst_idx, dtype=torch.int64),
                         torch.tensor(src_idx, dtype=torch.int64), page_size=page_size)
    except Exception as exc:  # noqa: BLE001  (the test names what it expects below)
        error = exc
    return dst, src, error


WRAPPING = {
    "top-index": ([TOP], [0], 1),
    "run-across-2^63": ([TOP - 1, TOP], [0, 1], 1),
    "whole-page-across-2^63": ([TOP - 3, TOP - 2, TOP - 1, TOP, -TOP - 1, -TOP, -TOP + 1, -TOP + 2],
                               list(range(8)), 8),
    "page-ending-at-2^63": (list(range(TOP - 7, TOP + 1)), list(range(8)), 8),
}


@pytest.mark.parametrize("side", ["dst", "src"])
@pytest.mark.parametrize("case", WRAPPING, ids=list(WRAPPING))
def test_direct_path_refuses_indices_near_2_63_and_writes_nothing(case, side):
    """Before: the top index was dropped without an error, runs across 2**63 raised a bare RuntimeError."""
    huge, small, page = WRAPPING[case]
    dst_idx, src_idx = (huge, small) if side == "dst" else (small, huge)
    dst, src, error = _direct(dst_idx, src_idx, page)
    assert isinstance(error, TransferIndexError), repr(error)
    assert named(str(error), f"indices_{side}"), str(error)
    assert dst.untouched() and src.untouched()


def test_direct_path_zero_size_is_a_no_op():
    dst, src, error = _direct([], [])
    assert error is None and dst.untouched()


def test_direct_path_refuses_a_meta_index_naming_it():
    dst, src = Guarded(8, PAIRS_ROW), Guarded(8, PAIRS_ROW)
    meta = torch.zeros(2, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="indices_dst .*meta"):
        direct.copy_rows([(dst.t, src.t)], meta, torch.arange(2))


def test_raw_rows_of_unknown_size_cannot_wrap_an_address():
    rows = direct.Rows.at(1 << 40, 1152, 1152, 0)
    assert (1 << 40) + rows.rows * 1152 <= TOP


# ---------------------------------------------------------------------------
# The host pools (CPU device pool: the direct path, run as tensor copies).

def _pools(kind, layout, page=4, slots=32, layers=3):
    gen = torch.Generator().manual_seed(3)

    def layer_rows():
        return Guarded(slots, 1, 8, seed=int(torch.randint(0, 1 << 30, (1,), generator=gen)))

    guarded = [layer_rows() for _ in range(layers * (1 if kind == "mla" else 2))]
    tensors = [g.t for g in guarded]
    device = (MLADevicePool(tensors) if kind == "mla"
              else MHADevicePool(tensors[:layers], tensors[layers:]))
    cls = MLAHostKVPool if kind == "mla" else MHAHostKVPool
    return guarded, device, cls(device, size=slots, page_size=page, layout=layout, pin_memory=False)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_host_pool_direct_load_refuses_device_pages_across_2_63(kind, layout):
    guarded, device, pool = _pools(kind, layout)
    host_before = pool.kv_buffer.clone()
    device_idx = torch.tensor([TOP - 3, TOP - 2, TOP - 1, TOP])  # one "page" of 4 ending at 2**63 - 1
    with pytest.raises(TransferIndexError, match="indices_dst"):
        pool.load_to_device_per_layer(device, torch.arange(4), device_idx, 1, "direct")
    with pytest.raises(TransferIndexError, match="indices_src"):
        pool.backup_from_device_all_layer(device, torch.arange(4), device_idx, "direct")
    assert all(g.untouched() for g in guarded)
    assert torch.equal(pool.kv_buffer, host_before)


def test_host_pool_page_first_direct_translation_refuses_tokens_outside_the_pool():
    """The kernel path's host rows: tokens 2**62 + k multiplied by layers x page wrapped to page 0."""
    _, _, pool = _pools("mla", "page_first_direct")
    with pytest.raises(TransferIndexError, match="host_indices"):
        pool.translate_host_indices(torch.tensor([1 << 62, (1 << 62) + 1]))


# ---------------------------------------------------------------------------
# The routed SGLang ops (no GPU: their copy-engine path, run as tensor copies) and compat.

@pytest.fixture
def copy_engines():
    with routed.copy_engines_only():
        yield


L, SLOTS, D, P = 4, 16, 8, 4


def test_layer_of_refuses_a_negative_layer(copy_engines):
    """Before: layer_id=-2 loaded layer L-2 (Python's negative indexing), without an error."""
    src = Guarded(SLOTS, L, 1, D, seed=4)
    dst = Guarded(SLOTS, 1, D, seed=5)
    for layer in (-2, L):
        with pytest.raises(ValueError, match=f"layer_id {layer} is out of range"):
            routed.transfer_kv_per_layer_mla_pf_lf(src.t, dst.t, torch.arange(4), torch.arange(4), layer, D * 4,
                                                   L * D * 4)
    assert dst.untouched()


def test_page_first_direct_refuses_layer_l():
    """Before: layer_id=L viewed from L*page_size and loaded the next page's layer 0."""
    host = Guarded(SLOTS // P, L, P, 1, D, seed=6)
    dev = Guarded(SLOTS, 1, D, seed=7)
    with pytest.raises(ValueError, match=f"layer_id {L} is out of range"):
        routed.transfer_kv_per_layer_direct_pf_lf([host.t], [dev.t], torch.arange(P), torch.arange(P), L, P)
    assert dev.untouched()


def test_page_head_refuses_layer_l(copy_engines):
    heads = 2
    host = [Guarded(SLOTS // P, heads, P, L, D, seed=s) for s in (8, 9)]
    dev = [Guarded(SLOTS, heads, D, seed=s) for s in (10, 11)]
    with pytest.raises(ValueError, match=f"layer_id {L} is out of range"):
        routed.transfer_kv_per_layer_ph_lf(host[0].t, dev[0].t, host[1].t, dev[1].t, torch.arange(P), torch.arange(P),
                                           L, heads * D * 4, 0, P, heads)
    assert dev[0].untouched() and dev[1].untouched()


BIG = (1 << 62) + torch.arange(P)  # a page of tokens whose rows wrap to page 0 when multiplied


def test_direct_write_back_refuses_tokens_past_the_pool():
    """Before: tokens 2**62 + [0..3] overwrote host page 0 of every layer."""
    host = Guarded(SLOTS // P, L, P, 1, D, seed=12)
    dev = [Guarded(SLOTS, 1, D, seed=13 + i) for i in range(L)]
    with pytest.raises(TransferIndexError, match="dst_indices"):
        routed.transfer_kv_all_layer_direct_lf_pf([d.t for d in dev], [host.t], torch.arange(P), BIG, P)
    assert host.untouched()
    target = Guarded(SLOTS, 1, D, seed=20)
    with pytest.raises(TransferIndexError, match="src_indices"):
        routed.transfer_kv_per_layer_direct_pf_lf([host.t], [target.t], BIG, torch.arange(P), 1, P)
    assert target.untouched()


def test_page_head_refuses_tokens_past_the_pool(copy_engines):
    heads = 2
    host = [Guarded(SLOTS // P, heads, P, L, D, seed=s) for s in (21, 22)]
    dev = [Guarded(SLOTS, heads, D, seed=s) for s in (23, 24)]
    with pytest.raises(TransferIndexError, match="src_indices"):
        routed.transfer_kv_per_layer_ph_lf(host[0].t, dev[0].t, host[1].t, dev[1].t, BIG, torch.arange(P), 1,
                                           heads * D * 4, 0, P, heads)
    assert dev[0].untouched() and dev[1].untouched()


def _rows(rows=SLOTS):
    return torch.zeros(rows, 1, D, dtype=torch.int32)


IDX = torch.arange(4)
DEGENERATE = {
    "head_num-0": (lambda: routed.transfer_kv_per_layer_ph_lf(
        torch.zeros(4, 2, P, L, D), _rows(), torch.zeros(4, 2, P, L, D), _rows(), IDX, IDX, 0, 64, 0, P, 0),
        ValueError, "head_num"),
    "ph-page_size-0": (lambda: routed.transfer_kv_per_layer_ph_lf(
        torch.zeros(4, 2, P, L, D), _rows(), torch.zeros(4, 2, P, L, D), _rows(), IDX, IDX, 0, 64, 0, 0, 2),
        ValueError, "page_size"),
    "direct-page_size-0": (lambda: routed.transfer_kv_direct([_rows()], [_rows()], IDX, IDX, 0), ValueError,
                           "page_size"),
    "cache-list": (lambda: routed.transfer_hicache_one_layer_mla([[0]], IDX, _rows(), IDX), TypeError, "cache_dst"),
    "cache-None": (lambda: routed.transfer_hicache_one_layer_mla(_rows(), IDX, None, IDX), TypeError, "cache_src"),
    "cache-0-rows": (lambda: routed.transfer_hicache_one_layer_mla(_rows(0), IDX, _rows(), IDX), ValueError,
                     "cache_dst"),
    "mha-cache-None": (lambda: routed.transfer_hicache_one_layer(_rows(), None, IDX, _rows(), _rows(), IDX),
                       TypeError, "v_cache_dst"),
    "element_dim-not-dividing": (lambda: routed.transfer_hicache_one_layer_mla(_rows(), IDX, _rows(), IDX,
                                                                               element_dim=3), ValueError,
                                 "element_dim"),
    "element_dim-2.5": (lambda: routed.transfer_hicache_one_layer_mla(_rows(), IDX, _rows(), IDX, element_dim=2.5),
                        ValueError, "element_dim"),
    "element_dim-str": (lambda: routed.transfer_hicache_one_layer(_rows(), _rows(), IDX, _rows(), _rows(), IDX,
                                                                  element_dim="288"), ValueError, "element_dim"),
    "item_size-0": (lambda: routed.transfer_kv_per_layer_mla(_rows(), _rows(), IDX, IDX, 0), ValueError,
                    "item_size"),
    "packed-cache-list": (lambda: routed.transfer_kv_per_layer_mla([1], _rows(), IDX, IDX, 32), TypeError, "src"),
    "direct-layers-None": (lambda: routed.transfer_kv_direct(None, [_rows()], IDX, IDX, 1), TypeError, "src_layers"),
    "meta-index": (lambda: routed.transfer_hicache_one_layer_mla(_rows(), torch.zeros(4, dtype=torch.int64,
                                                                                      device="meta"), _rows(), IDX),
                   ValueError, "indices_dst"),
    "compat-cache-0-rows": (lambda: compat.transfer_hicache_one_layer_mla(_rows(0), IDX, _rows(), IDX), ValueError,
                            "cache_dst"),
    "compat-element_size-2.5": (lambda: compat.transfer_hicache_all_layer_mla(IDX, IDX, IDX, IDX,
                                                                              cache_src_stride_bytes=4,
                                                                              cache_dst_stride_bytes=4,
                                                                              element_size=2.5),
                                ValueError, "element_size"),
}


@pytest.mark.parametrize("case", DEGENERATE, ids=list(DEGENERATE))
def test_degenerate_geometry_is_one_clear_error(copy_engines, case):
    call, error, argument = DEGENERATE[case]
    with pytest.raises(error) as info:
        call()
    assert named(str(info.value), argument), str(info.value)


def test_routed_ops_zero_size_is_a_no_op(copy_engines):
    dst = Guarded(SLOTS, 1, D)
    empty = torch.empty(0, dtype=torch.int64)
    routed.transfer_hicache_one_layer_mla(dst.t, empty, _rows(), empty)
    routed.transfer_kv_per_layer_mla_pf_lf(torch.zeros(SLOTS, L, 1, D, dtype=torch.int32), dst.t, empty, empty, 1,
                                           D * 4, L * D * 4)
    assert dst.untouched()


# ---------------------------------------------------------------------------
# The kernel ops' Python layer, on fake_gpu's stand-in device.

def _strict_launcher(calls):
    """hicache_transfer_launch as far as Python can see it: it refuses a null index pointer (the C
    validate()), else records the call."""
    def launch(spec, stream, method_used):
        from sglang_hicache_jit.transfer.abi import _CTransfer

        spec = _CTransfer.from_address(spec) if isinstance(spec, int) else spec._obj
        if not spec.indices_src or not spec.indices_dst:
            return -1  # kErrInvalid: "invalid transfer arguments"
        calls.append({name: getattr(spec, name) for name, _ in _CTransfer._fields_})
        (ctypes_int_at(method_used)).value = 1
        return 0
    return launch


def ctypes_int_at(method_used):
    import ctypes

    return ctypes.c_int.from_address(method_used) if isinstance(method_used, int) else method_used._obj


@pytest.fixture
def fake_device(monkeypatch):
    monkeypatch.delenv("SGLANG_HICACHE_JIT_STRICT", raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_JIT_METHOD", raising=False)
    saved = dict(launcher._states)
    calls = []
    with fake_gpu.stub_cuda_runtime(ops), fake_gpu.stub_uploads():
        ops.reload_settings()
        state = fake_gpu.install(ops)
        state._launch_c = _strict_launcher(calls)
        state.error_flags.zero_()
        yield calls
    launcher._states.clear()
    launcher._states.update(saved)
    ops.reload_settings()


def _dev(rows=64):
    return fake_gpu.cuda(torch.zeros(rows, 16, dtype=torch.uint8))


def _host(rows=64):
    return fake_gpu.pinned(torch.zeros(rows, 16, dtype=torch.uint8))


def _table(caches, **kwargs):
    """A LayerTable whose pointer tables are made on the CPU (LayerTable.tables() uploads them to a GPU)."""
    table = ops.LayerTable(caches, **kwargs)
    table._tables[0] = [torch.tensor([s.ptr for s in sides], dtype=torch.uint64) for sides in table.sides]
    return table


EMPTY = {"cpu": lambda: torch.empty(0, dtype=torch.int64), "gpu": lambda: fake_gpu.cuda(torch.empty(0, dtype=torch.int64))}


@pytest.mark.parametrize("where", EMPTY)
@pytest.mark.parametrize("op", ["one-layer-mla", "one-layer-mha", "all-layer-mla", "all-layer-mha"])
def test_zero_size_kernel_transfers_are_no_ops(fake_device, op, where):
    """Before: the empty index tensors' address (0) reached the launcher, which refused it as
    "invalid transfer arguments" (host to GPU, one-layer and all-layer, MLA and MHA)."""
    d, h = _dev(), _host()
    for _ in range(2):  # the first call builds the plan, the second runs from it
        empty = EMPTY[where]()
        if op == "one-layer-mla":
            method = ops.transfer_one_layer_mla(d, empty, h, empty)
        elif op == "one-layer-mha":
            method = ops.transfer_one_layer(d, _dev(), empty, h, _host(), empty)
        elif op == "all-layer-mla":
            method = ops.transfer_all_layer(_table([d, _dev()], written=True), empty, _table([h, _host()]), empty)
        else:
            method = ops.transfer_all_layer(_table(([d], [_dev()]), written=True), empty, _table(([h], [_host()])),
                                            empty)
        assert method == "plain"
    assert all(call["num_items"] == 0 for call in fake_device)


def test_an_empty_cache_is_refused_naming_it(fake_device):
    with pytest.raises(ValueError, match="cache_src must hold at least one slot"):
        ops.transfer_one_layer_mla(_dev(), torch.arange(2), fake_gpu.pinned(torch.zeros(0, 16, dtype=torch.uint8)),
                                   torch.arange(2))


@pytest.mark.parametrize("value", [2.5, "288", 0, True])
def test_ops_refuse_a_bad_element_dim_naming_it(fake_device, value):
    with pytest.raises(ValueError, match="element_dim"):
        ops.transfer_one_layer_mla(_dev(), torch.arange(2), _host(), torch.arange(2), element_dim=value)


@pytest.mark.parametrize("op", ["one-layer-mla", "one-layer-mha", "all-layer"])
def test_a_plan_whose_host_memory_was_unpinned_refuses_to_launch(fake_device, monkeypatch, op):
    """SGLang's teardown unregisters its host pool; a plan cached for it would launch into memory the
    GPU can no longer reach (an illegal memory access, which ends the process)."""
    d, h = _dev(), _host()
    tables = (_table([d, _dev()], name="device"), _table([h, _host()], name="host_pool", written=True))
    run = {"one-layer-mla": lambda: ops.transfer_one_layer_mla(d, torch.arange(2), h, torch.arange(2)),
           "one-layer-mha": lambda: ops.transfer_one_layer(d, d, torch.arange(2), h, h, torch.arange(2)),
           "all-layer": lambda: ops.transfer_all_layer(tables[1], torch.arange(2), tables[0], torch.arange(2))}[op]
    run()
    assert len(fake_device) == 1
    pinned = {h.data_ptr()}
    monkeypatch.setattr(plans, "_host_registered", lambda address: address not in pinned)
    pinned.clear()
    run()  # still pinned: the plan runs
    pinned.add(h.data_ptr())
    with pytest.raises(ValueError, match="no longer pinned") as info:
        run()
    assert str(info.value).startswith({"one-layer-mla": "cache_src ", "one-layer-mha": "k_src ",
                                       "all-layer": "host_pool[0] "}[op]), str(info.value)
    assert len(fake_device) == 2


def test_staged_write_back_tells_the_kernel_the_host_buffer_s_size(fake_device, monkeypatch):
    """compat's staged write-back knows dst (a tensor), so its slot count reaches the kernel, which
    refuses an index equal to it (here in strict mode, checked on the host before launching).
    Before: the pointer tables went out with no size, and index == slots wrote past dst."""
    slots, layers, row = 64, 3, 16
    dst = fake_gpu.pinned(torch.zeros(slots, layers, row, dtype=torch.uint8))
    staging = fake_gpu.cuda(torch.zeros(4, layers, row, dtype=torch.uint8))
    device_layers = [torch.zeros(8, row, dtype=torch.uint8) for _ in range(layers)]  # CPU memory as device layers
    for t in device_layers + [dst]:
        extents.register(t)  # what the plugin does for a pool's buffers (no driver to ask here)
    table = fake_gpu.cuda(torch.tensor([t.data_ptr() for t in device_layers]).view(torch.uint64))
    monkeypatch.setattr(compat, "host_layer_table", lambda buffer, n, size, device: fake_gpu.cuda(
        torch.tensor([buffer.data_ptr() + layer * size for layer in range(n)]).view(torch.uint64)))
    compat.transfer_hicache_all_layer_mla_staged_lf_pf(table, fake_gpu.cuda(torch.arange(2)),
                                                       fake_gpu.cuda(torch.tensor([0, slots - 1])), staging, dst,
                                                       page_size=1)
    assert (fake_device[-1]["dst_rows"], fake_device[-1]["src_rows"]) == (slots, 8)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_STRICT", "1")
    ops.reload_settings()
    for bad in (slots, slots + 2, TOP):
        with pytest.raises(TransferIndexError, match=f"dst_indices|indices_dst holds index {bad}"):
            compat.transfer_hicache_all_layer_mla_staged_lf_pf(table, fake_gpu.cuda(torch.arange(1)),
                                                               fake_gpu.cuda(torch.tensor([bad])), staging, dst,
                                                               page_size=1)
    assert len(fake_device) == 1
