"""Raw pointer tables checked against their allocations (transfer/extents.py, transfer/pointer_tables.py), on
the CPU: the registry's rules, the checked tables, the routed SGLang ops' copy-engine path (which plans, and
refuses, before it copies), the kernel ops' Python layer on tests/fake_gpu.py's stand-in device, and the
plugin's registration of the pools it hooks. No driver answers here, so every buffer a table points into is
registered, as the plugin registers a pool's per-layer buffers. The GPU half is tests/test_pointer_tables_gpu.py.

Each destination and source is the middle of a larger tensor whose rows before and after are guard rows;
only the middle is registered, so a row past it would land in a guard row, which every test checks."""

import ctypes
import gc
import types

import pytest
import torch

import fake_gpu
from sglang_hicache_jit import ops
from sglang_hicache_jit.errors import TransferIndexError
from sglang_hicache_jit.integrations import compat
from sglang_hicache_jit.integrations.sglang import ops as routed
from sglang_hicache_jit.integrations.sglang import pools
from sglang_hicache_jit.transfer import extents, launcher, pointer_tables

GUARD, ROWS, LAYERS, D = 3, 10, 3, 4  # D int32 elements: 16-byte rows


class Guarded:
    """``rows`` rows of ``row`` int32 elements inside GUARD guard rows on each side, all random."""

    def __init__(self, rows, *row, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.whole = torch.randint(-1000, 1000, (rows + 2 * GUARD, *row), generator=gen, dtype=torch.int32)
        self.before = self.whole.clone()
        self.t = self.whole[GUARD:GUARD + rows]

    def untouched(self) -> bool:
        return torch.equal(self.whole, self.before)


@pytest.fixture(autouse=True)
def registry(monkeypatch):
    """A clean registry, no driver (CPU addresses are pageable memory anyway), no tables kept."""
    monkeypatch.setattr(extents, "_driver_range", lambda address, device: None)
    extents.clear()
    pointer_tables.clear()
    yield
    extents.clear()
    pointer_tables.clear()


def table(tensors, *, cuda=False):
    t = torch.tensor([x.data_ptr() for x in tensors], dtype=torch.int64).view(torch.uint64)
    return fake_gpu.cuda(t) if cuda else t


def layers(seed, rows=ROWS):
    return [Guarded(rows, D, seed=seed + i) for i in range(LAYERS)]


def register(*groups):
    """Registers each group's inner tensors as the plugin does: as per-layer lists of a pool."""
    pool = types.SimpleNamespace(kv_buffer=[g.t for group in groups for g in group])
    pools.register_pool(pool, pools.DEVICE_POOL_LAYER_LISTS)
    return pool


# ---------------------------------------------------------------------------
# The registry.

def test_the_registry_gives_the_layer_an_address_starts_or_lies_in():
    buf = torch.zeros(LAYERS, ROWS, D, dtype=torch.int32)  # a layer_first buffer
    per_layer = [buf[i] for i in range(LAYERS)]
    narrow = buf[1][:, :2]  # a view of layer 1's first columns: it starts where layer 1 does
    for t in per_layer + [narrow]:
        extents.register(t)
    find = extents.finder(None)
    layer_bytes = ROWS * D * 4
    one = find(buf[1].data_ptr())
    assert (one.start, one.end) == (buf[1].data_ptr(), buf[1].data_ptr() + layer_bytes)  # the layer, not the view
    inside = find(buf[2, 3].data_ptr() + 4)
    assert (inside.start, inside.end) == (buf[2].data_ptr(), buf[2].data_ptr() + layer_bytes)
    assert find(buf.data_ptr() + LAYERS * layer_bytes) is None  # one past the buffer
    assert find(12345) is None


def test_a_registration_lasts_as_long_as_its_tensor():
    t = torch.zeros(8, D, dtype=torch.int32)
    address, generation = t.data_ptr(), extents.Generation.value
    extents.register(t)
    extents.register(t)  # once per tensor
    assert extents.finder(None)(address) is not None and len(extents._ranges) == 1
    del t
    gc.collect()
    assert extents.finder(None)(address) is None and extents.Generation.value > generation


# ---------------------------------------------------------------------------
# Checked tables.

def test_a_checked_table_holds_the_rows_every_layer_s_allocation_holds():
    short = Guarded(ROWS - 4, D, seed=1)
    group = layers(10) + [short]
    register(group)
    checked = pointer_tables.checked(table([g.t for g in group]), "src_layers")
    assert checked.rows(16, 16, "src_layers") == ROWS - 4  # the shortest layer bounds them all
    assert checked.rows(32, 16, "src_layers") == (ROWS - 4) // 2  # two rows' bytes apart: half as many
    with pytest.raises(ValueError, match=r"src_layers\[0\] = 0x[0-9a-f]+: a row of 2048 bytes there does not fit"):
        checked.rows(2048, 2048, "src_layers")


def test_a_table_with_an_address_in_no_known_allocation_is_refused_naming_it():
    group = layers(20)
    register(group[:2])  # the third layer is nobody's
    with pytest.raises(ValueError, match=r"dst_layers\[2\] = 0x[0-9a-f]+ lies in no allocation"):
        pointer_tables.checked(table([g.t for g in group]), "dst_layers")


def test_a_table_into_memory_torch_freed_is_refused(monkeypatch):
    group = layers(25)
    register(group[1:])
    start = group[0].t.data_ptr()
    monkeypatch.setattr(extents, "_torch_blocks", lambda: [(start, start + 64, False)])
    with pytest.raises(ValueError, match=r"src_layers\[0\] = 0x[0-9a-f]+ lies in a block torch's allocator has "
                                         r"freed"):
        pointer_tables.checked(table([g.t for g in group]), "src_layers")


@pytest.mark.parametrize("bad", [torch.zeros(2, 2, dtype=torch.uint64), torch.zeros(3, dtype=torch.float64),
                                 torch.zeros(0, dtype=torch.uint64), [1, 2], torch.zeros(3, dtype=torch.uint64,
                                                                                         device="meta")],
                         ids=["2-D", "float64", "empty", "list", "meta"])
def test_a_malformed_table_is_one_clear_error(bad):
    with pytest.raises((TypeError, ValueError), match="src_layers must be"):
        pointer_tables.checked(bad, "src_layers")


# ---------------------------------------------------------------------------
# The routed all-layer ops on the copy engines (the CPU runs the plan; a refusal comes before any copy).

def _all_layer_cases():
    """op name -> (call(dst_idx, src_idx), the guarded buffers, dst rows, src rows)."""
    cases = {}

    def mla():
        dev, host = layers(30), layers(40, rows=ROWS + 2)
        register(dev, host)
        call = lambda d, s: routed.transfer_kv_all_layer_mla(  # noqa: E731  (D2H: device tables -> host tables)
            table([g.t for g in dev]), table([g.t for g in host]), s, d, 16, LAYERS)
        return call, dev + host, ROWS + 2, ROWS

    def mha():
        k_dev, v_dev, k_host, v_host = layers(50), layers(60), layers(70, rows=ROWS + 2), layers(80, rows=ROWS + 2)
        register(k_dev, v_dev, k_host, v_host)
        call = lambda d, s: routed.transfer_kv_all_layer(  # noqa: E731
            table([g.t for g in k_dev]), table([g.t for g in k_host]), table([g.t for g in v_dev]),
            table([g.t for g in v_host]), s, d, 16, LAYERS)
        return call, k_dev + v_dev + k_host + v_host, ROWS + 2, ROWS

    def hicache_mla():
        dev, host = layers(90), layers(100, rows=ROWS + 2)
        register(dev, host)
        call = lambda d, s: routed.transfer_hicache_all_layer_mla(  # noqa: E731
            table([g.t for g in host]), d, table([g.t for g in dev]), s, cache_src_stride_bytes=16,
            cache_dst_stride_bytes=16)
        return call, dev + host, ROWS + 2, ROWS

    def lf_pf():
        dev = layers(110)
        host = Guarded(ROWS + 2, LAYERS, D, seed=120)  # a page_first host buffer: a tensor, its rows known
        register(dev)
        call = lambda d, s: routed.transfer_kv_all_layer_mla_lf_pf(  # noqa: E731
            table([g.t for g in dev]), host.t, s, d, 16, LAYERS * 16, LAYERS)
        return call, dev + [host], ROWS + 2, ROWS

    for name, make in (("all_layer_mla", mla), ("all_layer", mha), ("hicache_all_layer_mla", hicache_mla),
                       ("all_layer_mla_lf_pf", lf_pf)):
        cases[name] = make
    return cases


ALL_LAYER = _all_layer_cases()


@pytest.mark.parametrize("bad", ["rows", "rows+1", "2^40"])
@pytest.mark.parametrize("side", ["dst", "src"])
@pytest.mark.parametrize("op", ALL_LAYER)
def test_routed_all_layer_ops_refuse_an_index_past_a_table_s_allocation(op, side, bad):
    """Before: the tables carried no size, so index == rows (and 2**40) passed, and the copy went past the
    addressed rows (here the guard rows; on a GPU, 6 cases wrote outside them)."""
    call, guarded, dst_rows, src_rows = ALL_LAYER[op]()
    rows = dst_rows if side == "dst" else src_rows
    index = {"rows": rows, "rows+1": rows + 1, "2^40": 1 << 40}[bad]
    dst_idx, src_idx = torch.tensor([0, 1]), torch.tensor([0, 1])
    (dst_idx if side == "dst" else src_idx)[1] = index
    names = {"dst": ("dst_indices", "indices_dst"), "src": ("src_indices", "indices_src")}[side]
    with routed.copy_engines_only(), pytest.raises(TransferIndexError) as info:
        call(dst_idx, src_idx)
    assert any(name in str(info.value) for name in names) and f"holds index {index}" in str(info.value)
    assert all(g.untouched() for g in guarded)  # refused before any copy


@pytest.mark.parametrize("op", ALL_LAYER)
def test_routed_all_layer_ops_still_skip_padding(op):
    call, guarded, dst_rows, src_rows = ALL_LAYER[op]()
    with routed.copy_engines_only():
        call(torch.tensor([-1, -1]), torch.tensor([0, src_rows - 1]))  # every pair padded: nothing to copy
    assert all(g.untouched() for g in guarded)


def test_a_host_table_rewritten_in_place_is_checked_again():
    """Before: the copy-engine path kept a table's addresses by object and data pointer, so a table whose
    bytes changed (here through ctypes: no version counter moves) went on being read as it was."""
    dev, host, small = layers(130), layers(140), layers(150, rows=4)
    register(dev, host, small)
    dst, src = table([g.t for g in host]), table([g.t for g in dev])
    call = lambda index: routed.transfer_kv_all_layer_mla(src, dst, torch.tensor([0]), torch.tensor([index]),  # noqa
                                                          16, LAYERS)
    with routed.copy_engines_only():
        call(-1)  # checked; nothing to copy
        new = (ctypes.c_uint64 * LAYERS)(*[g.t.data_ptr() for g in small])
        ctypes.memmove(dst.data_ptr(), new, 8 * LAYERS)  # now 4 rows a layer
        with pytest.raises(TransferIndexError, match="indices_dst holds index 5, but that side has only 4 slots"):
            call(5)
        ctypes.memmove(dst.data_ptr(), (ctypes.c_uint64 * 1)(16), 8)  # layer 0 at address 16: nobody's
        with pytest.raises(ValueError, match=r"dst_layers\[0\] = 0x10 lies in no allocation"):
            call(0)
    assert all(g.untouched() for g in dev + host + small)


def test_a_fresh_view_of_one_host_buffer_on_every_call_is_checked_once():
    """SGLang 0.5.17's MHA host pool backs up into ``self.k_buffer``, a property that returns a new view of its
    buffer on every call. Before: each view built and registered a new host table, and each registration made
    every checked table be checked again (for SGLang's CUDA device tables, a read back: a device sync in its
    scheduler thread on every backup, which made a server's misses 26-28 ms slower per 8K-token chunk). Now
    the table is the buffer's (its owner, bytes and geometry), and a second call registers nothing."""
    dev_k, dev_v = layers(160), layers(170)
    register(dev_k, dev_v)
    src_k, src_v = table([g.t for g in dev_k]), table([g.t for g in dev_v])
    kv = torch.zeros((2, ROWS, LAYERS, D), dtype=torch.int32)  # the pool's page_first K and V, one tensor

    def backup(device_index, host_index):
        routed.transfer_kv_all_layer_lf_pf(src_k, kv[0], src_v, kv[1], torch.tensor([device_index]),
                                           torch.tensor([host_index]), 4 * D, LAYERS * 4 * D, LAYERS)

    with routed.copy_engines_only():  # padding pairs: every check runs, nothing is copied (no GPU here)
        backup(-1, -1)
        generation = extents.Generation.value
        tables = dict(compat._host_tables)
        backup(-1, -1)
        assert extents.Generation.value == generation, "a fresh view registered again"
        assert compat._host_tables == tables, "a fresh view built another table"
    # K's table is not V's, though both are views of one tensor; each is bounded by its own view's slots
    assert compat.host_layer_table(kv[0], LAYERS, 4 * D, "cpu") is not compat.host_layer_table(kv[1], LAYERS, 4 * D,
                                                                                                 "cpu")
    with routed.copy_engines_only(), pytest.raises(TransferIndexError, match="slots"):
        routed.transfer_kv_all_layer_lf_pf(src_k, kv[0], src_v, kv[1], torch.tensor([0]), torch.tensor([ROWS]),
                                           4 * D, LAYERS * 4 * D, LAYERS)
    # A narrower view of the same bytes, after the wide one was registered for as long as its owner lives: it
    # is still bounded by its own slots, not by the wider registration
    with routed.copy_engines_only(), pytest.raises(TransferIndexError, match="only 4 slots"):
        routed.transfer_kv_all_layer_lf_pf(src_k, kv[0][:4], src_v, kv[1][:4], torch.tensor([0]),
                                           torch.tensor([5]), 4 * D, LAYERS * 4 * D, LAYERS)
    assert all(g.untouched() for g in dev_k + dev_v)


# ---------------------------------------------------------------------------
# The kernel path's Python layer, on fake_gpu's stand-in device.

@pytest.fixture
def launches(monkeypatch):
    monkeypatch.delenv("SGLANG_HICACHE_JIT_STRICT", raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_JIT_METHOD", raising=False)
    saved = dict(launcher._states)
    recorder = fake_gpu.Recorder()
    with fake_gpu.stub_cuda_runtime(ops), fake_gpu.stub_uploads():
        ops.reload_settings()
        fake_gpu.install(ops)._launch_c = recorder
        monkeypatch.setattr(routed, "kernel_available", lambda size: True)
        yield recorder
    launcher._states.clear()
    launcher._states.update(saved)
    ops.reload_settings()


def test_the_kernel_gets_each_side_s_rows_and_the_checked_addresses(launches, monkeypatch):
    """Before: transfer_kv_all_layer_mla launched with dst_rows = src_rows = -1 (unknown: not checked)."""
    dev, host = layers(160), layers(170, rows=ROWS + 2)
    register(dev, host)
    src, dst = table([g.t for g in dev], cuda=True), table([g.t for g in host], cuda=True)
    idx = fake_gpu.cuda(torch.tensor([0, 1]))
    routed.transfer_kv_all_layer_mla(src, dst, idx, idx, 16, LAYERS)
    call = launches.last
    assert (call["dst_rows"], call["src_rows"]) == (ROWS + 2, ROWS)
    launched = list((ctypes.c_uint64 * LAYERS).from_address(call["src_table0"]))
    assert launched == [g.t.data_ptr() for g in dev] and call["src_table0"] != src.data_ptr()
    # Strict mode checks on the host before launching: index == rows never reaches the kernel.
    monkeypatch.setenv("SGLANG_HICACHE_JIT_STRICT", "1")
    ops.reload_settings()
    for bad in (ROWS, 1 << 40):
        with pytest.raises(TransferIndexError, match=f"indices_src holds index {bad}, but its pool has only {ROWS}"):
            routed.transfer_kv_all_layer_mla(src, dst, fake_gpu.cuda(torch.tensor([0, bad])), idx, 16, LAYERS)
    assert len(launches.calls) == 1


def test_the_kernel_gets_the_caller_s_cuda_tables_beside_its_checked_copies(launches):
    """Before: the kernel got only its private copies of the checked addresses, so a caller's table rewritten
    where torch could not see went on being ignored (rows copied where the caller no longer meant). Now it
    also gets the caller's tables, to compare with those copies before it copies a row."""
    dev, host = layers(160), layers(170)
    register(dev, host)
    src, dst = table([g.t for g in dev], cuda=True), table([g.t for g in host], cuda=True)
    idx = fake_gpu.cuda(torch.tensor([0, 1]))
    routed.transfer_kv_all_layer_mla(src, dst, idx, idx, 16, LAYERS)
    call = launches.last
    assert (call["src_live0"], call["dst_live0"]) == (src.data_ptr(), dst.data_ptr())
    assert call["src_table0"] not in (src.data_ptr(), None) and call["dst_table0"] not in (dst.data_ptr(), None)
    assert not call["src_live1"] and not call["dst_live1"]  # one cache: nothing there
    routed.transfer_kv_all_layer_mla(src, dst, idx, idx, 16, LAYERS)  # a plan hit carries them too
    assert (launches.last["src_live0"], launches.last["dst_live0"]) == (src.data_ptr(), dst.data_ptr())


def test_a_stale_table_reported_by_the_kernel_raises_once_and_every_table_is_read_again(launches):
    dev, host = layers(175), layers(185)
    register(dev, host)
    src, dst = table([g.t for g in dev], cuda=True), table([g.t for g in host], cuda=True)
    idx = fake_gpu.cuda(torch.tensor([0]))
    routed.transfer_kv_all_layer_mla(src, dst, idx, idx, 16, LAYERS)
    first = launches.last["src_table0"]
    launcher._states[0].error_view[3] = 1  # what the kernel stores when a CTA finds a table changed
    with pytest.raises(TransferIndexError, match="pointer table was rewritten after it was checked.*"
                                                 "write pointer tables with torch ops") as info:
        routed.transfer_kv_all_layer_mla(src, dst, idx, idx, 16, LAYERS)
    assert "STRICT" not in str(info.value)  # no index was wrong: strict mode would not have helped
    routed.transfer_kv_all_layer_mla(src, dst, idx, idx, 16, LAYERS)
    assert launches.last["src_table0"] != first  # read and checked again: a new private copy


def test_a_cuda_table_is_read_again_when_torch_changes_it(launches):
    dev, other, host = layers(180), layers(190, rows=5), layers(200)
    register(dev, other, host)
    src, dst = table([g.t for g in dev], cuda=True), table([g.t for g in host], cuda=True)
    idx = fake_gpu.cuda(torch.tensor([0]))
    routed.transfer_kv_all_layer_mla(src, dst, idx, idx, 16, LAYERS)
    torch.Tensor.copy_(src, table([g.t for g in other]))  # an in-place torch write: its version moves
    routed.transfer_kv_all_layer_mla(src, dst, idx, idx, 16, LAYERS)
    assert launches.last["src_rows"] == 5
    assert list((ctypes.c_uint64 * LAYERS).from_address(launches.last["src_table0"])) == [
        g.t.data_ptr() for g in other]


# ---------------------------------------------------------------------------
# The plugin registers what the pools it hooks build their tables from.

def test_the_plugin_registers_each_layer_of_the_pools_it_hooks(monkeypatch):
    host_buf = torch.zeros(LAYERS, ROWS, D, dtype=torch.int32)
    device_pool = types.SimpleNamespace(kv_buffer=[torch.zeros(ROWS, D, dtype=torch.int32) for _ in range(LAYERS)])
    pool = types.SimpleNamespace(layout="layer_first", data_refs=[host_buf[i] for i in range(LAYERS)],
                                 kv_buffer=host_buf, k_buffer=host_buf[..., :2], device_pool=device_pool)
    seen = []
    real = extents.register
    monkeypatch.setattr(extents, "register", lambda t, name: seen.append(name) or real(t, name))
    pools.describe_pool(None, pool)
    find = extents.finder(None)
    for i in range(LAYERS):
        host_layer, device_layer = find(host_buf[i].data_ptr()), find(device_pool.kv_buffer[i].data_ptr())
        assert host_layer.end - host_layer.start == ROWS * D * 4  # one layer, not the whole buffer
        assert (device_layer.start, device_layer.end - device_layer.start) == (device_pool.kv_buffer[i].data_ptr(),
                                                                               ROWS * D * 4)
    assert sorted(seen) == sorted([f"SimpleNamespace.data_refs[{i}]" for i in range(LAYERS)]
                                  + [f"SimpleNamespace.kv_buffer[{i}]" for i in range(LAYERS)])
    # The per-call hooks register a pool once; the pool's whole buffer and column views never.
    original = lambda self, *args: None  # noqa: E731
    for _ in range(3):
        pools.load_to_device_per_layer(original, pool, device_pool, torch.arange(2), torch.arange(2), 0, "kernel")
    assert len(seen) == 2 * LAYERS


# ---------------------------------------------------------------------------
# The driver's answer (cuMemGetAddressRange), with a stand-in driver.

class FakeDriver:
    """Mappings [base, base + size) inside reservations, as cuMemGetAddressRange and cuPointerGetAttribute
    describe them: ``address_range`` gives the mapping holding an address (or CUDA_ERROR_NOT_FOUND, 500)."""

    def __init__(self, mappings, reservations):
        self.mappings, self.reservations, self.calls = mappings, reservations, 0

    def address_range(self, address):
        self.calls += 1
        for base, size in self.mappings:
            if base <= address < base + size:
                return base, size
        return 500

    def reserved(self, address):
        for start, size in self.reservations:
            if start <= address < start + size:
                return start, size
        return None


def test_the_driver_s_allocation_and_cumemmap_pieces(monkeypatch):
    monkeypatch.undo()  # this test is about _driver_range itself
    mb = 1 << 20
    # A cudaMalloc'd allocation (its own reservation), and three 2 MiB pieces mapped back to back inside a
    # 1 GiB reservation (torch's expandable segments) followed by a gap and a piece further on.
    driver = FakeDriver([(16 * mb, 3 * mb), (1 << 30, 2 * mb), ((1 << 30) + 2 * mb, 2 * mb),
                         ((1 << 30) + 4 * mb, 2 * mb), ((1 << 30) + 10 * mb, 2 * mb)],
                        [(16 * mb, 3 * mb), (1 << 30, 1 << 30)])
    monkeypatch.setattr(extents, "_driver_state", [driver])
    plain = extents._driver_range(17 * mb, None)
    assert (plain.start, plain.end) == (16 * mb, 19 * mb)
    pieces = extents._driver_range((1 << 30) + 3 * mb, None)
    assert (pieces.start, pieces.end) == ((1 << 30) + 2 * mb, (1 << 30) + 6 * mb)  # up to the gap, not past it
    assert extents._driver_range(12345, None) is None and extents._driver_range(0, None) is None
