"""The launch plans (transfer/plans.py), without a GPU: a repeated call reuses its plan, and
anything that would change validation leads to a new one (or to the same
error as before). The device is tests/fake_gpu.py's stand-in; its launcher
records each HicacheTransfer it gets, index values included."""

import contextlib
import ctypes
import gc
import threading
import types
import weakref

import pytest
import torch

import fake_gpu
from sglang_hicache_jit import ops
from sglang_hicache_jit.transfer import extents, launcher, pointer_tables
from sglang_hicache_jit.errors import TransferIndexError


@pytest.fixture
def launches(monkeypatch):
    """A fake cuda:0 whose launcher records; yields the recorder."""
    monkeypatch.delenv("SGLANG_HICACHE_JIT_STRICT", raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_JIT_METHOD", raising=False)
    saved = dict(launcher._states)
    recorder = fake_gpu.Recorder()
    with fake_gpu.stub_cuda_runtime(ops), fake_gpu.stub_uploads():
        ops.reload_settings()  # also drops plans left by other tests
        state = fake_gpu.install(ops)
        state._launch_c = recorder
        yield recorder
    launcher._states.clear()
    launcher._states.update(saved)
    ops.reload_settings()


def dev(rows=64, row=16, dtype=torch.uint8):
    return fake_gpu.cuda(torch.zeros(rows, row, dtype=dtype))


def host(rows=64, row=16, dtype=torch.uint8):
    return fake_gpu.pinned(torch.zeros(rows, row, dtype=dtype))


def gpu_idx(*values, dtype=torch.int64):
    return fake_gpu.cuda(torch.tensor(values, dtype=dtype))


def plans():
    return ops._plan_cache()


def forbid_validation(monkeypatch):
    """From here on a cache validation fails the test: calls must hit a plan."""
    def fail(*args, **kwargs):
        raise AssertionError("validated again instead of reusing the plan")

    monkeypatch.setattr(ops, "_Side", fail)


def test_a_repeated_call_reuses_its_plan(launches, monkeypatch):
    d, h = dev(), host()
    assert ops.transfer_one_layer_mla(d, gpu_idx(1, 2), h, gpu_idx(3, 4)) == "plain"
    forbid_validation(monkeypatch)
    ops.transfer_one_layer_mla(d, gpu_idx(5, 6, 7), h, gpu_idx(8, 9, 10))
    first, second = launches.calls
    assert len(plans()) == 1
    assert (first["dst_base0"], first["src_base0"]) == (d.data_ptr(), h.data_ptr())
    assert (second["dst_index_values"], second["src_index_values"], second["num_items"]) == ([5, 6, 7], [8, 9, 10], 3)
    assert {k: v for k, v in first.items() if "ind" not in k and k != "num_items"} == \
        {k: v for k, v in second.items() if "ind" not in k and k != "num_items"}


def test_fresh_views_of_one_buffer_share_a_plan(launches, monkeypatch):
    # SGLang's routed ops cut a new view of the pool buffer on every call.
    buf, d = torch.zeros(64, 4, 16, dtype=torch.uint8), dev()
    ops.transfer_one_layer_mla(d.view(64, 16), gpu_idx(1), fake_gpu.pinned(buf[:, 2]), gpu_idx(1))
    forbid_validation(monkeypatch)
    ops.transfer_one_layer_mla(d.view(64, 16), gpu_idx(1), fake_gpu.pinned(buf[:, 2]), gpu_idx(1))
    assert launches.calls[1]["src_base0"] == buf[:, 2].data_ptr() and launches.calls[1]["src_stride"] == 64
    monkeypatch.undo()
    ops.transfer_one_layer_mla(d, gpu_idx(1), fake_gpu.pinned(buf[:, 3]), gpu_idx(1))  # another layer: its own plan
    assert launches.last["src_base0"] == buf[:, 3].data_ptr() and len(plans()) == 2


def test_a_replaced_tensor_gets_a_new_plan(launches):
    d, h = dev(), host()
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    d2 = dev()
    ops.transfer_one_layer_mla(d2, gpu_idx(1), h, gpu_idx(1))
    assert launches.last["dst_base0"] == d2.data_ptr() != d.data_ptr()


def test_set_resize_and_as_strided_on_the_same_object_are_seen(launches):
    d, h = dev(), host()
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    d.set_(torch.zeros(64, 16, dtype=torch.uint8))  # another storage
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    assert launches.last["dst_base0"] == d.data_ptr()
    d.resize_(32, 16)  # fewer slots, same storage and pointer
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    assert launches.last["dst_rows"] == 32 and launches.last["dst_base0"] == d.data_ptr()
    h.as_strided_((64, 16), (8, 1))  # only the stride changes (rows may overlap on the read side)
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    assert (launches.last["src_stride"], launches.last["src_rows"]) == (8, 64)
    h.as_strided_((32, 16), (32, 1))  # every other slot
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    assert (launches.last["src_stride"], launches.last["src_rows"]) == (32, 32)
    h.as_strided_((32, 16), (32, 1), 16)  # offset: another pointer
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    assert launches.last["src_base0"] == h.data_ptr()
    d.as_strided_((8, 16), (8, 1))  # rows overlap: refused for a destination
    with pytest.raises(ValueError, match="overlapping rows"):
        ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))


def test_options_each_get_their_plan(launches):
    d, h = fake_gpu.cuda(torch.zeros(64 * 16, dtype=torch.uint8)), host(128, 8)
    ops.transfer_one_layer_mla(d, gpu_idx(1), h.view(64, 16), gpu_idx(1), element_dim=16)
    assert launches.last["row_bytes"] == 16
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1), element_dim=8)
    assert (launches.last["row_bytes"], launches.last["dst_rows"]) == (8, 128)
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1), element_dim=8, method="bulk")
    assert launches.last["method"] == 2
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1), element_dim=8, method="plain", block_quota=3)
    assert (launches.last["method"], launches.last["num_blocks"]) == (1, 3)
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1), element_dim=8, method="plain")
    assert (launches.last["method"], launches.last["num_blocks"]) == (1, 0)
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1), element_dim=8)
    assert launches.last["method"] == 0  # auto, host -> GPU
    assert len(plans()) == 5


def test_a_dtype_change_on_the_same_object_is_validated(launches):
    d, h = dev(), host()
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    h.data = torch.Tensor.view(h, torch.int8)  # same object, memory, shape and strides; another dtype
    with pytest.raises(ValueError, match="dtype"):
        ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))


@pytest.mark.parametrize("call,error,words", [
    (lambda d, h: ops.transfer_one_layer_mla(d, gpu_idx(1.0, dtype=torch.float32), h, gpu_idx(1)), TypeError,
     "int32 or int64"),
    (lambda d, h: ops.transfer_one_layer_mla(d, fake_gpu.cuda(torch.zeros(2, 2, dtype=torch.int64)), h,
                                             gpu_idx(1)), ValueError, "1-D"),
    (lambda d, h: ops.transfer_one_layer_mla(d, gpu_idx(1, 2), h, gpu_idx(1)), ValueError, "same length"),
    (lambda d, h: ops.transfer_one_layer_mla(d, [1], h, gpu_idx(1)), TypeError, "indices_dst"),
    (lambda d, h: ops.transfer_one_layer_mla(d, torch.zeros(1, dtype=torch.int64, device="meta"), h,
                                             torch.zeros(1, dtype=torch.int64, device="meta")),
     ValueError, "must be on the CPU or .*meta"),
    (lambda d, h: ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1), block_quota=0), ValueError,
     "block_quota"),
    (lambda d, h: ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1), block_quota=True), ValueError,
     "block_quota"),
    (lambda d, h: ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1), method="fast"), ValueError, "method"),
    (lambda d, h: ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1), method=["plain"]), ValueError,
     "method"),
    (lambda d, h: ops.transfer_one_layer_mla(d, gpu_idx(1), "x", gpu_idx(1)), TypeError, "cache_src"),
    (lambda d, h: ops.transfer_one_layer_mla(d, gpu_idx(1), torch.zeros(64, 16, dtype=torch.uint8),
                                             gpu_idx(1)), ValueError, "pinned"),
], ids=["float-index", "2-D-index", "lengths", "list-index", "meta-index", "quota-0", "quota-bool",
        "bad-method", "unhashable-method", "str-cache", "pageable-cache"])
def test_validation_still_raises_after_a_plan_exists(launches, call, error, words):
    d, h = dev(), host()
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    with pytest.raises(error, match=words):
        call(d, h)
    assert len(launches.calls) == 2


def test_unusual_indices_are_converted_on_a_plan(launches):
    d, h = dev(), host()
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    ops.transfer_one_layer_mla(d, gpu_idx(1, 2, dtype=torch.int32), h, gpu_idx(3, 4))  # mixed dtypes: both int64
    assert (launches.last["index_bytes"], launches.last["dst_index_values"]) == (8, [1, 2])
    ops.transfer_one_layer_mla(d, gpu_idx(1, 2, dtype=torch.int32), h, gpu_idx(3, 4, dtype=torch.int32))
    assert (launches.last["index_bytes"], launches.last["src_index_values"]) == (4, [3, 4])
    strided = fake_gpu.cuda(torch.arange(8)[::2])  # not contiguous: copied
    ops.transfer_one_layer_mla(d, strided, h, strided)
    assert launches.last["dst_index_values"] == [0, 2, 4, 6]
    ops.transfer_one_layer_mla(d, gpu_idx(), h, gpu_idx())
    assert launches.last["num_items"] == 0


def test_cpu_indices_are_staged_together(launches):
    d, h = dev(), host()
    for _ in range(2):
        ops.transfer_one_layer_mla(d, torch.tensor([5, 6], dtype=torch.int32), h, torch.tensor([7, 8],
                                                                                                  dtype=torch.int32))
        call = launches.last
        assert (call["dst_index_values"], call["src_index_values"], call["index_bytes"]) == ([5, 6], [7, 8], 4)
        assert call["indices_src"] == call["indices_dst"] + 8  # one staging buffer
    ops.transfer_one_layer_mla(d, torch.tensor([5]), h, fake_gpu.cuda(torch.tensor([7])))  # CPU and GPU: each moved
    assert (launches.last["dst_index_values"], launches.last["src_index_values"]) == ([5], [7])


def test_a_pending_error_raises_on_a_plan(launches):
    d, h = dev(), host()
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    state = launcher._states[0]
    state.error_view[1] = 1  # as the kernel does for an index past the destination pool
    with pytest.raises(TransferIndexError, match="indices_dst"):
        ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    assert list(state.error_view) == [0, 0, 0, 0]
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    assert len(launches.calls) == 2


def test_setting_the_same_tuning_keeps_the_plans(launches, monkeypatch):
    """The benchmark sets a provider's tuning before measuring it; unchanged values must not cost a rebuild."""
    d, h = dev(), host()
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    ops.set_tuning(bulk_warps=0, read_align=0)
    forbid_validation(monkeypatch)
    ops.transfer_one_layer_mla(d, gpu_idx(2), h, gpu_idx(2))
    assert len(plans()) == 1 and launches.last["dst_index_values"] == [2]


def test_tuning_and_settings_drop_plans(launches, monkeypatch):
    d, h = dev(), host()
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    previous = ops.set_tuning(bulk_warps=2, read_align=64)
    try:
        ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
        assert (launches.last["bulk_warps"], launches.last["read_align"]) == (2, 64)
    finally:
        ops.set_tuning(**previous)
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    assert (launches.last["bulk_warps"], launches.last["read_align"]) == (0, 0)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_METHOD", "bulk")
    ops.reload_settings()
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    assert launches.last["method"] == 2
    monkeypatch.setenv("SGLANG_HICACHE_JIT_STRICT", "1")
    ops.reload_settings()
    with pytest.raises(TransferIndexError, match="only 64 slots"):
        ops.transfer_one_layer_mla(d, torch.tensor([64]), h, torch.tensor([1]))


def test_the_torch_op_fallback_runs_from_a_plan(launches):
    d, h = dev(), host()
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    seen = []
    state = launcher._states[0]
    state._launch_c, state.transfer = None, lambda idx_src, idx_dst, *args: seen.append(
        (idx_src.tolist(), idx_dst.tolist(), args)) or 2
    assert ops.transfer_one_layer_mla(d, gpu_idx(1, 2), h, gpu_idx(3, 4)) == "bulk"
    assert ops.transfer_one_layer_mla(d, torch.tensor([5]), h, torch.tensor([6])) == "bulk"  # staged CPU indices
    assert [(s, t) for s, t, _ in seen] == [([3, 4], [1, 2]), ([6], [5])]
    args = seen[0][2]
    assert (args[0], args[2], args[10], args[11], args[12]) == (h.data_ptr(), d.data_ptr(), 16, 16, 16)


def test_mha_and_all_layer_plans(launches, monkeypatch):
    kd, vd, kh, vh = dev(), dev(), host(), host()
    ops.transfer_one_layer(kd, vd, gpu_idx(1), kh, vh, gpu_idx(2))
    forbid_validation(monkeypatch)
    ops.transfer_one_layer(kd, vd, gpu_idx(1), kh, vh, gpu_idx(2))
    assert (launches.last["dst_base1"], launches.last["num_caches"]) == (vd.data_ptr(), 2)
    monkeypatch.undo()
    vd.set_(torch.zeros(64, 16, dtype=torch.uint8))
    ops.transfer_one_layer(kd, vd, gpu_idx(1), kh, vh, gpu_idx(2))
    assert launches.last["dst_base1"] == vd.data_ptr()

    dev_table = ops.LayerTable(([kd, kd], [vd, vd]), written=True)
    host_table = ops.LayerTable(([kh, kh], [vh, vh]))
    for table in (dev_table, host_table):  # LayerTable.tables() uploads them on a GPU
        table._tables[0] = [torch.tensor([s.ptr for s in sides], dtype=torch.uint64) for sides in table.sides]
    ops.transfer_all_layer(dev_table, gpu_idx(1), host_table, gpu_idx(2))
    forbid_validation(monkeypatch)
    monkeypatch.setattr(ops, "_Plan", None)  # a hit builds nothing
    ops.transfer_all_layer(dev_table, gpu_idx(1), host_table, gpu_idx(2))
    assert launches.last["dst_table0"] == dev_table._tables[0][0].data_ptr()
    assert launches.last["num_layers"] == 2


def test_plans_keep_nothing_alive(launches):
    d, h = dev(), host()
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    refs = [weakref.ref(d), weakref.ref(h), weakref.ref(d._base), weakref.ref(h._base)]
    del d, h
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_each_thread_has_its_own_plans(launches):
    d, h = dev(), host()
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1))
    theirs = []

    def other():
        ops.transfer_one_layer_mla(d, gpu_idx(2), h, gpu_idx(2))
        theirs.extend(ops._plan_cache().values())

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(theirs) == 1 and theirs[0] is not next(iter(plans().values()))
    assert launches.last["dst_index_values"] == [2]
    previous = ops.set_tuning(bulk_warps=2)  # drops every thread's plans, this one's too
    assert not plans()
    ops.set_tuning(**previous)


def test_resident_plans_submit_to_the_queue(launches, monkeypatch):
    d, h = dev(), host()
    state = launcher._states[0]
    queued = []
    monkeypatch.setattr(state, "_submit_resident", lambda spec: queued.append(
        (spec.method, spec.num_items, spec.dst_base0)) or 17)
    for _ in range(2):
        assert ops.transfer_one_layer_mla(d, gpu_idx(1, 2), h, gpu_idx(3, 4), method="resident") == "resident-plain"
    assert queued == [(0, 2, d.data_ptr())] * 2  # the struct holds the method without the resident flag
    assert not launches.calls


class _FakeResidentLibrary:
    """The resident entry points of the C library, in Python: records the calls; submit can be held."""

    def __init__(self):
        self.events = []
        self.inside, self.release = threading.Event(), threading.Event()
        self.release.set()
        # Plain functions, as ctypes functions take argtypes/restype attributes (bound methods do not).
        self.handle = types.SimpleNamespace(
            hicache_resident_create=lambda *a: self.create(*a), hicache_resident_submit=lambda *a: self.submit(*a),
            hicache_resident_destroy=lambda *a: self.destroy(*a), hicache_resident_stats=lambda queue, out: None,
            hicache_error_string=lambda err: b"fake error")
        self.next_queue = 1000

    def create(self, blocks, slots, idle_us, out):
        self.next_queue += 1
        out._obj.value = self.next_queue
        self.events.append(("create", self.next_queue, blocks))
        return 0

    def submit(self, queue, spec, stream, method_used):
        self.events.append(("submit", queue))
        self.inside.set()
        self.release.wait(10)
        method_used._obj.value = 18
        return 0

    def destroy(self, queue, timeout_ms):
        self.events.append(("destroy", queue))
        return 0


def test_resident_stop_waits_for_a_submit_in_flight(launches, monkeypatch):
    """stop_resident frees the queue: it must never run while another thread is inside submit."""
    state = launcher._states[0]
    fake = _FakeResidentLibrary()
    monkeypatch.setattr(state, "library", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    d, h = dev(), host()
    assert ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(2), method="resident") == "resident-bulk"
    first = fake.events[0][1]
    assert fake.events == [("create", first, 4), ("submit", first)]

    fake.inside.clear()
    fake.release.clear()
    submitter = threading.Thread(target=lambda: ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(2),
                                                                            method="resident"))
    submitter.start()
    assert fake.inside.wait(10)
    stopper = threading.Thread(target=ops.stop_resident)
    stopper.start()
    stopper.join(0.2)
    assert stopper.is_alive() and ("destroy", first) not in fake.events  # held back by the submit
    fake.release.set()
    submitter.join(10)
    stopper.join(10)
    assert fake.events[-2:] == [("submit", first), ("destroy", first)]
    assert ops.resident_stats(0) is None

    # The next resident transfer makes a new queue.
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(2), method="resident")
    assert fake.events[-2:] == [("create", first + 1, 4), ("submit", first + 1)]
    ops.stop_resident(0)
    assert fake.events[-1] == ("destroy", first + 1)


def ptr_table(*addresses):
    return fake_gpu.cuda(torch.tensor(addresses, dtype=torch.uint64))


@pytest.fixture
def known(monkeypatch):
    """Fake allocations (transfer/extents.py's registry) for the made-up addresses of these tests' tables:
    4 KiB from each of 4096, 8192, 16384, 32768, 1 MiB and 2 MiB, and nothing else (the driver is not asked)."""
    for start in (4096, 8192, 16384, 32768, 1 << 20, 1 << 21):
        extents.register_range(start, 4096, "a test range")
    monkeypatch.setattr(extents, "_driver_range", lambda address, device: None)
    yield
    extents.clear()
    pointer_tables.clear()


def launched_table(address: int, layers: int) -> list:
    return list((ctypes.c_uint64 * layers).from_address(address))


def test_pointer_table_plans(launches, known, monkeypatch):
    # What SGLang's all-layer backups pass on every call: the same pointer tables.
    d, h = ptr_table(4096, 8192), ptr_table(16384, 32768)
    call = lambda **kw: ops.transfer_pointer_tables(  # noqa: E731
        h, gpu_idx(1), d, gpu_idx(2), **{"dst_stride_bytes": 64, "src_stride_bytes": 16, "element_size": 16, **kw})
    call()
    monkeypatch.setattr(pointer_tables, "_check", None)  # a hit neither reads the tables again ...
    monkeypatch.setattr(ops, "_Plan", None)  # ... nor builds a plan
    call()
    # The kernel reads a private copy of the addresses that were checked, never the caller's table.
    dst_table, src_table = launches.last["dst_table0"], launches.last["src_table0"]
    assert dst_table not in (h.data_ptr(), 0) and src_table not in (d.data_ptr(), 0)
    assert launched_table(dst_table, 2) == [16384, 32768] and launched_table(src_table, 2) == [4096, 8192]
    # Each side's rows are what every layer's allocation holds: 4096 B at 64 and 16 B apart.
    assert (launches.last["dst_rows"], launches.last["src_rows"]) == (4096 // 64, 4096 // 16)
    assert launches.last["dst_index_values"] == [1] and len(plans()) == 1
    # The integers are checked on every call, a hit or not (True == 1 and hashes alike).
    for bad in (dict(element_size=True), dict(element_size=6), dict(dst_stride_bytes=-4), dict(src_stride_bytes=2.0)):
        with pytest.raises(ValueError, match="multiple of 4|positive"):
            call(**bad)
    with pytest.raises(TypeError, match="int32 or int64"):
        ops.transfer_pointer_tables(h, gpu_idx(1.0, dtype=torch.float32), d, gpu_idx(2), dst_stride_bytes=64,
                                    src_stride_bytes=16, element_size=16)
    monkeypatch.undo()
    h.set_(torch.tensor([1 << 20, 1 << 21], dtype=torch.uint64))  # the same object, another table
    call()
    assert launched_table(launches.last["dst_table0"], 2) == [1 << 20, 1 << 21]
    torch.Tensor.view(d, torch.int64).data[0] = 1 << 40  # a write torch does not count: the checked copy runs
    call()
    assert launched_table(launches.last["src_table0"], 2) == [4096, 8192]
    d.resize_(1)  # torch counts this: read again, where it finds the write above, and refuses it
    with pytest.raises(ValueError, match=r"tables_src\[0\] = 0x10000000000 lies in no allocation"):
        call()
    torch.Tensor.view(d, torch.int64)[0] = 4096
    with pytest.raises(ValueError, match="same number of layers"):  # another layer count, as on a first call
        call()
    assert len(launches.calls) == 4


def test_a_pointer_table_is_refused_where_a_row_leaves_its_allocation(launches, known):
    # 4 KiB at 16384: rows of 64 B fit 64 times; an address 32 B before the end holds no 64-B row.
    d = ptr_table(4096, 8192)
    with pytest.raises(ValueError, match=r"tables_dst\[1\] = 0x8fe0: a row of 64 bytes"):
        ops.transfer_pointer_tables(ptr_table(16384, 32768 + 4096 - 32), gpu_idx(1), d, gpu_idx(2),
                                    dst_stride_bytes=64, src_stride_bytes=64, element_size=64)
    with pytest.raises(ValueError, match=r"tables_src\[0\] = 0x3000 lies in no allocation"):
        ops.transfer_pointer_tables(ptr_table(16384, 32768), gpu_idx(1), ptr_table(12288, 8192), gpu_idx(2),
                                    dst_stride_bytes=64, src_stride_bytes=64, element_size=64)
    assert not launches.calls


def test_a_non_contiguous_pointer_table_runs_from_its_checked_copy(launches, known):
    d = fake_gpu.cuda(torch.tensor([4096, 0, 8192, 0], dtype=torch.uint64)[::2])
    h = ptr_table(16384, 32768)
    for _ in range(2):
        ops.transfer_pointer_tables(h, gpu_idx(1), d, gpu_idx(2), dst_stride_bytes=64, src_stride_bytes=16,
                                    element_size=16)
    assert launched_table(launches.last["src_table0"], 2) == [4096, 8192]
    assert len(plans()) == 1  # the copy lives with the checked table, so the plan is kept


def test_pointer_table_plans_keep_nothing_alive(launches, known):
    d, h = ptr_table(4096, 8192), ptr_table(16384, 32768)
    ops.transfer_pointer_tables(h, gpu_idx(1), d, gpu_idx(2), dst_stride_bytes=64, src_stride_bytes=16,
                                element_size=16)
    refs = [weakref.ref(d), weakref.ref(h)]
    del d, h
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_host_to_gpu_copies_carry_the_destination_hint(launches):
    """HICACHE_HINT_DST_DEVICE tunes the bulk pipeline for stores into GPU memory: set for host -> GPU
    only (a GPU -> host copy keeps a store to the host in flight instead)."""
    d, h = dev(), host()
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(2))
    ops.transfer_one_layer_mla(h, gpu_idx(1), d, gpu_idx(2))
    ops.transfer_one_layer(d, dev(), gpu_idx(1), h, host(), gpu_idx(2))
    ops.transfer_one_layer(h, host(), gpu_idx(1), d, dev(), gpu_idx(2))
    assert [c["hints"] for c in launches.calls] == [1, 0, 1, 0]


def test_transfers_into_host_memory_default_to_the_measured_cta_budget(launches):
    """Beside compute 2 CTAs give the most link per point of matmul slowdown for GPU -> host copies
    (abi.D2H_BLOCK_QUOTA, tools/bench.py cta): the ops pass it where the caller gives none."""
    d, h = fake_gpu.cuda(torch.zeros(64 * 16, dtype=torch.uint8)), host(128, 8)
    ops.transfer_one_layer_mla(h, gpu_idx(1), d, gpu_idx(1), element_dim=8)  # GPU -> host
    assert launches.last["num_blocks"] == ops.D2H_BLOCK_QUOTA == 2
    ops.transfer_one_layer_mla(h, gpu_idx(1), d, gpu_idx(1), element_dim=8, block_quota=8)
    assert launches.last["num_blocks"] == 8  # the caller's choice stands
    ops.transfer_one_layer_mla(d, gpu_idx(1), h, gpu_idx(1), element_dim=8)  # host -> GPU: the kernel's default
    assert launches.last["num_blocks"] == 0
    ops.transfer_one_layer(h, h, gpu_idx(1), d, d, gpu_idx(1), element_dim=8)  # K and V, GPU -> host
    assert launches.last["num_blocks"] == 2
