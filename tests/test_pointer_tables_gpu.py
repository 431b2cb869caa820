"""GPU (marked ``gpu``): raw pointer tables checked against their allocations, and the index dtype rule, on the
kernel and on the copy engines, with guard rows around every buffer a table points into.

Each device layer and host layer is the middle of a larger allocation whose rows before and after hold random
bytes; the middle is registered as the SGLang plugin registers a pool's per-layer buffers
(integrations/sglang/pools.py, register_pool), so a row past it lands in a guard row unless the op refuses it.
After each case the whole allocation (guards included) is compared with what it held, with the valid pair's
row copied where the path copies the pairs it can (the kernel skips the bad row and reports it at the next op;
the copy engines refuse the whole transfer before they copy). After each test a canary round trip runs, and no
transfer error may be pending. The CPU half is tests/test_pointer_tables.py and tests/test_index_dtypes.py.
"""

import contextlib
import ctypes
import types

import pytest
import torch

from sglang_hicache_jit import ops
from sglang_hicache_jit.errors import TransferIndexError
from sglang_hicache_jit.integrations.sglang import ops as routed
from sglang_hicache_jit.integrations.sglang import pools
from sglang_hicache_jit.transfer import direct, extents, pointer_tables

pytestmark = pytest.mark.gpu

GUARD, ROWS, LAYERS, ROW = 4, 64, 3, 288  # 288-B rows (uint8)


def rand_bytes(shape, *, device="cpu", pin=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)
    return t.pin_memory() if pin else t


class Guarded:
    """``rows`` rows of shape ``row`` inside GUARD guard rows each side, random bytes throughout."""

    def __init__(self, rows, *row, device="cpu", pin=False, seed=0):
        self.whole = rand_bytes((rows + 2 * GUARD, *row), device=device, pin=pin, seed=seed)
        self.before = self.whole.clone()
        self.t = self.whole[GUARD:GUARD + rows]

    def expect(self):
        """What the whole buffer must hold: what it held, to be edited where a row is meant to change."""
        return self.before.clone()


@pytest.fixture(autouse=True)
def canary():
    extents.clear()
    pointer_tables.clear()
    yield
    torch.cuda.synchronize()
    ops.check_errors()
    src = rand_bytes((64, 256), pin=True, seed=99)
    dev = torch.zeros((64, 256), dtype=torch.uint8, device="cuda")
    back = torch.zeros((64, 256), dtype=torch.uint8, pin_memory=True)
    idx = torch.arange(64)
    ops.transfer_one_layer_mla(dev, idx.cuda(), src, idx)
    direct.copy_rows([(back, dev)], idx, idx)
    torch.cuda.synchronize()
    ops.check_errors()
    assert torch.equal(back, src), "the canary round trip came back wrong"
    extents.clear()
    pointer_tables.clear()


@pytest.fixture(params=["kernel", "copy-engines"])
def path(request):
    context = routed.copy_engines_only() if request.param == "copy-engines" else contextlib.nullcontext()
    with context:
        yield request.param


def table(guarded, device="cuda"):
    return torch.tensor([g.t.data_ptr() for g in guarded], dtype=torch.int64, device=device).view(torch.uint64)


def register(*groups):
    """As the plugin registers a pool's per-layer buffers."""
    pools.register_pool(types.SimpleNamespace(kv_buffer=[g.t for group in groups for g in group]),
                        pools.DEVICE_POOL_LAYER_LISTS)


def device_layers(seed, rows=ROWS):
    return [Guarded(rows, ROW, device="cuda", seed=seed + i) for i in range(LAYERS)]


def host_layers(seed, rows=ROWS):
    return [Guarded(rows, ROW, pin=True, seed=seed + i) for i in range(LAYERS)]


def _cases():
    """op -> make() -> (call(dst_idx, src_idx), dst groups, src groups, dst rows, src rows)."""

    def mla_d2h():
        dev, host = device_layers(10), host_layers(20, ROWS + 8)
        register(dev, host)
        return (lambda d, s: routed.transfer_kv_all_layer_mla(table(dev), table(host), s, d, ROW, LAYERS),
                [host], [dev], ROWS + 8, ROWS)

    def mla_h2d():
        dev, host = device_layers(30), host_layers(40, ROWS + 8)
        register(dev, host)
        return (lambda d, s: routed.transfer_kv_all_layer_mla(table(host), table(dev), s, d, ROW, LAYERS),
                [dev], [host], ROWS, ROWS + 8)

    def mha_d2h():
        k_dev, v_dev, k_host, v_host = device_layers(50), device_layers(60), host_layers(70, ROWS + 8), \
            host_layers(80, ROWS + 8)
        register(k_dev, v_dev, k_host, v_host)
        return (lambda d, s: routed.transfer_kv_all_layer(table(k_dev), table(k_host), table(v_dev), table(v_host),
                                                          s, d, ROW, LAYERS),
                [k_host, v_host], [k_dev, v_dev], ROWS + 8, ROWS)

    def hicache_mla_d2h():
        dev, host = device_layers(90), host_layers(100, ROWS + 8)
        register(dev, host)
        return (lambda d, s: routed.transfer_hicache_all_layer_mla(table(host), d, table(dev), s,
                                                                   cache_src_stride_bytes=ROW,
                                                                   cache_dst_stride_bytes=ROW),
                [host], [dev], ROWS + 8, ROWS)

    def hicache_mha_d2h():
        k_dev, v_dev, k_host, v_host = device_layers(110), device_layers(120), host_layers(130, ROWS + 8), \
            host_layers(140, ROWS + 8)
        register(k_dev, v_dev, k_host, v_host)
        return (lambda d, s: routed.transfer_hicache_all_layer(table(k_host), table(v_host), d, table(k_dev),
                                                               table(v_dev), s, kv_cache_src_stride_bytes=ROW,
                                                               kv_cache_dst_stride_bytes=ROW),
                [k_host, v_host], [k_dev, v_dev], ROWS + 8, ROWS)

    def lf_pf_d2h():  # the page_first backup: the host side a tensor (its slots known), the device side a table
        dev = device_layers(150)
        register(dev)
        host = Guarded(ROWS + 8, LAYERS, ROW, pin=True, seed=160)
        return (lambda d, s: routed.transfer_kv_all_layer_mla_lf_pf(table(dev), host.t, s, d, ROW, LAYERS * ROW,
                                                                    LAYERS),
                [[host]], [dev], ROWS + 8, ROWS)

    return {"all_layer_mla-d2h": mla_d2h, "all_layer_mla-h2d": mla_h2d, "all_layer-d2h": mha_d2h,
            "hicache_all_layer_mla-d2h": hicache_mla_d2h, "hicache_all_layer-d2h": hicache_mha_d2h,
            "all_layer_mla_lf_pf-d2h": lf_pf_d2h}


CASES = _cases()


def _refused(index, side):
    """What refusing ``index`` on ``side`` says: the host-side check names the index; the kernel, which gets each
    side's row count from the checked tables, skips the row and reports it at the next op (ops.check_errors)."""
    pool = "destination" if side == "dst" else "source"
    return f"holds index {index}, but|an index in indices_{side} was past the end of the {pool} pool"


def _row_of(group, layer, row):
    """Row ``row`` of layer ``layer`` of a group (a page_first host buffer is one Guarded of all layers)."""
    if len(group) == 1 and group[0].t.dim() == 3:
        return group[0].t[row, layer]
    return group[layer].t[row]


@pytest.mark.parametrize("where", ["cuda", "cpu"], ids=["gpu-indices", "cpu-indices"])
@pytest.mark.parametrize("bad", ["rows", "rows+1", "2^40"])
@pytest.mark.parametrize("side", ["dst", "src"])
@pytest.mark.parametrize("op", CASES)
def test_routed_all_layer_ops_refuse_an_index_past_a_table_s_allocation(path, op, side, bad, where):
    """Before: the tables carried no size, so index == rows (6 cases on the H200) wrote past the addressed
    rows, and a device index of 2**40 lost its row in silence."""
    call, dst_groups, src_groups, dst_rows, src_rows = CASES[op]()
    rows = dst_rows if side == "dst" else src_rows
    index = {"rows": rows, "rows+1": rows + 1, "2^40": 1 << 40}[bad]
    dst_idx, src_idx = [5, 7], [2, 3]
    (dst_idx if side == "dst" else src_idx)[1] = index
    with pytest.raises(TransferIndexError, match=_refused(index, side)):
        call(torch.tensor(dst_idx, device=where), torch.tensor(src_idx, device=where))
        ops.check_errors()  # the kernel skips the row and reports it at the next op
    torch.cuda.synchronize()
    # The kernel copies the valid pair (src row 2 -> dst row 5) of every layer and skips the other. The page_first
    # backup with CPU indices first tries the staging area, which checks the host indices itself and refuses
    # the whole backup; the copy engines refuse every transfer before copying.
    copied = path == "kernel" and not (op.startswith("all_layer_mla_lf_pf") and where == "cpu" and side == "dst")
    for g, group in enumerate(dst_groups):
        for guarded in group:
            expected = guarded.expect()
            if copied:
                for layer in range(LAYERS):
                    if len(group) == 1 and guarded.t.dim() == 3:
                        expected[GUARD + 5, layer] = _row_of(src_groups[g], layer, 2).cpu()
                    elif guarded is group[layer]:
                        expected[GUARD + 5] = _row_of(src_groups[g], layer, 2).cpu()
            assert torch.equal(guarded.whole.cpu(), expected.cpu()), f"{op}: a row outside the valid pair changed"
    for group in src_groups:
        assert all(torch.equal(g.whole.cpu(), g.before.cpu()) for g in group)


def test_tables_of_unregistered_memory_are_bounded_by_its_allocation(path):
    """No registration: torch's allocator gives each device layer's block, the driver each pinned block
    (sizes chosen so that the allocation is the layer exactly: 512-B multiples on the GPU, a power of two
    pinned)."""
    rows, row = 16, 256  # 4096 B a layer
    dev = [torch.randint(0, 256, (rows, row), dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
    host = [torch.zeros((rows, row), dtype=torch.uint8, pin_memory=True) for _ in range(LAYERS)]
    dev_table = torch.tensor([t.data_ptr() for t in dev], device="cuda").view(torch.uint64)
    host_table = torch.tensor([t.data_ptr() for t in host], device="cuda").view(torch.uint64)
    for side, dst_idx, src_idx in (("dst", [rows], [0]), ("src", [0], [rows])):
        with pytest.raises(TransferIndexError, match=_refused(rows, side)):
            routed.transfer_kv_all_layer_mla(dev_table, host_table, torch.tensor(src_idx, device="cuda"),
                                             torch.tensor(dst_idx, device="cuda"), row, LAYERS)
            ops.check_errors()
    torch.cuda.synchronize()
    assert all(not bool(t.any()) for t in host)
    routed.transfer_kv_all_layer_mla(dev_table, host_table, torch.arange(rows, device="cuda"),
                                     torch.arange(rows, device="cuda"), row, LAYERS)
    torch.cuda.synchronize()
    assert all(torch.equal(h, d.cpu()) for h, d in zip(host, dev))


def test_a_host_pointer_table_rewritten_in_place_is_noticed():
    """Before: the copy engines kept a table's addresses by object and data pointer, so a CPU table whose
    bytes were rewritten (here through ctypes: no version counter moves) went on copying to the old rows."""
    dev, first, second = device_layers(200), host_layers(210), host_layers(220)
    register(dev, first, second)
    host_table = table(first, device="cpu")  # host addresses, kept in host memory
    idx = torch.tensor([1])
    with routed.copy_engines_only():
        routed.transfer_kv_all_layer_mla(table(dev), host_table, idx, idx, ROW, LAYERS)
        torch.cuda.synchronize()
        ctypes.memmove(host_table.data_ptr(), (ctypes.c_uint64 * LAYERS)(*[g.t.data_ptr() for g in second]),
                       8 * LAYERS)
        routed.transfer_kv_all_layer_mla(table(dev), host_table, idx, torch.tensor([2]), ROW, LAYERS)
        torch.cuda.synchronize()
        expected_firsts = []
        for layer in range(LAYERS):
            expected_first, expected_second = first[layer].expect(), second[layer].expect()
            expected_first[GUARD + 1] = dev[layer].t[1].cpu()
            expected_second[GUARD + 2] = dev[layer].t[1].cpu()
            assert torch.equal(first[layer].whole, expected_first) and torch.equal(second[layer].whole,
                                                                                    expected_second)
            expected_firsts.append(expected_first)
        # An address 8 bytes before the end of its allocation (the pinned block), then one in pageable memory:
        # refused, naming the table and the layer.
        end = extents.finder(0)(second[0].whole.data_ptr() + second[0].whole.numel()).end - 8
        ctypes.memmove(host_table.data_ptr(), (ctypes.c_uint64 * 1)(end), 8)
        with pytest.raises(ValueError, match=r"dst_layers\[0\] = 0x[0-9a-f]+: a row of 288 bytes"):
            routed.transfer_kv_all_layer_mla(table(dev), host_table, idx, idx, ROW, LAYERS)
        pageable = torch.zeros(4096, dtype=torch.uint8)
        ctypes.memmove(host_table.data_ptr(), (ctypes.c_uint64 * 1)(pageable.data_ptr()), 8)
        with pytest.raises(ValueError, match=r"dst_layers\[0\] = 0x[0-9a-f]+ lies in no allocation"):
            routed.transfer_kv_all_layer_mla(table(dev), host_table, idx, idx, ROW, LAYERS)
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(first[layer].whole, expected_firsts[layer])


@pytest.mark.parametrize("method, to_host", [("plain", True), ("plain", False), ("bulk", False)])
def test_a_cuda_table_rewritten_behind_torch_s_back_copies_nothing_and_raises(method, to_host):
    """Before: a write torch does not count (through .data) went unnoticed, and the kernel went on copying
    through its private copy of the old addresses: rows went where the caller no longer meant, silently. Now
    each CTA compares the caller's table with that copy first: nothing is copied, the next op raises, and
    the call after that reads the table again and copies through the new addresses."""
    if method == "bulk" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the bulk method needs sm_90+ (this GPU has none)")
    dev, host, other = device_layers(230), host_layers(240), host_layers(250)
    if not to_host:  # the host rows are the source: the destinations are device rows
        dev, host, other = host_layers(230), device_layers(240), device_layers(250)
    register(dev, host, other)
    src, dst = table(dev), table(host)

    def copy(dst_row):
        ops.transfer_pointer_tables(dst, torch.tensor([dst_row], device="cuda"), src,
                                    torch.tensor([3], device="cuda"), dst_stride_bytes=ROW, src_stride_bytes=ROW,
                                    element_size=ROW, method=method)
    copy(3)
    dst.data.view(torch.int64).copy_(table(other).view(torch.int64))  # through .data: no version bump
    copy(4)
    with pytest.raises(TransferIndexError, match="pointer table was rewritten after it was checked"):
        ops.check_errors()
    for layer in range(LAYERS):
        expected = host[layer].expect().cpu()
        expected[GUARD + 3] = dev[layer].t[3].cpu()
        assert torch.equal(host[layer].whole.cpu(), expected)  # row 4 of the old rows: not written
        assert torch.equal(other[layer].whole.cpu(), other[layer].before.cpu())  # nor anything of the new ones
    copy(5)  # the error made every table be read again: the new addresses are checked and used
    ops.check_errors()
    for layer in range(LAYERS):
        expected = other[layer].expect().cpu()
        expected[GUARD + 5] = dev[layer].t[3].cpu()
        assert torch.equal(other[layer].whole.cpu(), expected)


@pytest.mark.parametrize("bad", ["float", "nan", "uint64-2^63"])
def test_the_staged_page_first_backup_refuses_non_integer_host_indices(bad):
    """Before: the staging area read the host indices with .to(int64): [1.9, 2.2] backed up into host rows 1
    and 2, NaN and 2**63 became padding."""
    dev = device_layers(260)
    register(dev)
    host = Guarded(ROWS, LAYERS, ROW, pin=True, seed=270)
    dst = {"float": torch.tensor([1.9, 2.2]), "nan": torch.tensor([float("nan"), 2.0]),
           "uint64-2^63": torch.tensor([1 << 63, 2], dtype=torch.uint64)}[bad]
    with routed.copy_engines_only(), pytest.raises(TypeError, match="dst_indices must be int32 or int64"):
        routed.transfer_kv_all_layer_mla_lf_pf(table(dev), host.t, torch.tensor([4, 5]), dst, ROW, LAYERS * ROW,
                                               LAYERS)
    torch.cuda.synchronize()
    assert torch.equal(host.whole, host.before)
