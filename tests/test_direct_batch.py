"""The direct path's batched submission without a GPU: what reaches the driver's cuMemcpyBatchAsync (both
of its ABIs) and the runtime's cudaMemcpy3DBatchAsync, from a stand-in driver that records every call."""

import ctypes

import pytest
import torch

from sglang_hicache_jit.transfer import direct


class FakeDriver:
    """libcuda with the entry points DriverBatch uses; copies are recorded, not made."""

    def __init__(self, version: int, v2: bool, fail_with: int = 0):
        self.version, self.calls, self.fail_with = version, [], fail_with
        # Plain functions, not methods: DriverBatch sets argtypes on them as on ctypes functions.
        if v2:
            self.cuMemcpyBatchAsync_v2 = lambda *args: self._batch(args, fail_idx=False)
        self.cuMemcpyBatchAsync = lambda *args: self._batch(args, fail_idx=True)
        self.cuDriverGetVersion = lambda ref: setattr(ref._obj, "value", self.version) or 0
        self.cuGetErrorString = lambda code, ref: setattr(ref._obj, "value", b"invalid argument") or 0

    def _batch(self, args, fail_idx):
        dsts, srcs, sizes, count, attrs, attr_idx, num_attrs = args[:7]
        assert len(args) == (9 if fail_idx else 8)
        read = lambda address: [ctypes.cast(address, ctypes.POINTER(ctypes.c_int64))[i] for i in range(count)]  # noqa
        attributes = direct.MemcpyAttributes.from_address(attrs)
        self.calls.append({"dst": read(dsts), "src": read(srcs), "size": read(sizes), "stream": args[-1],
                           "order": attributes.srcAccessOrder, "flags": attributes.flags,
                           "first": list((ctypes.c_size_t * count).from_address(attr_idx)), "attrs": num_attrs,
                           "fail_idx": fail_idx})
        return self.fail_with


@pytest.mark.parametrize("version, v2, abi", [(13000, True, "v2"), (12080, False, "12.8"), (13010, False, "12.8")])
def test_the_symbol_found_decides_the_arguments(version, v2, abi):
    driver = direct.DriverBatch(FakeDriver(version, v2))
    assert driver.available
    dst, src, size = (torch.tensor(v, dtype=torch.int64) for v in ([1 << 40, 2 << 40], [4096, 8192], [72, 144]))
    driver.copy(dst, src, size, stream=77)
    call, = driver.lib.calls
    assert call["fail_idx"] is (abi == "12.8")
    assert (call["dst"], call["src"], call["size"], call["stream"]) == ([1 << 40, 2 << 40], [4096, 8192], [72, 144], 77)
    assert (call["order"], call["flags"], call["first"], call["attrs"]) == (1, 0, [0, 0], 1)  # stream order, one set


def test_every_copy_of_a_call_has_an_attribute_index():
    """cuda.h says attrsIdxs holds numAttrs entries; crashes elsewhere were fixed by passing one per copy, as if
    the driver read `count` of them: the array the call gets holds a zero for every copy of the largest call."""
    driver = direct.DriverBatch(FakeDriver(13000, True))
    count = direct.MAX_BATCH_OPS + 5
    values = torch.arange(count, dtype=torch.int64)
    driver.copy(values * 64, values * 64, torch.full((count,), 64, dtype=torch.int64), stream=3)
    assert [len(c["first"]) for c in driver.lib.calls] == [direct.MAX_BATCH_OPS, 5]
    assert all(set(c["first"]) == {0} for c in driver.lib.calls)


def test_a_driver_without_the_call_is_not_available():
    assert not direct.DriverBatch(FakeDriver(12060, v2=False)).available


def test_more_copies_than_one_call_takes_go_out_in_chunks(monkeypatch):
    monkeypatch.setattr(direct, "MAX_BATCH_OPS", 3)
    driver = direct.DriverBatch(FakeDriver(13000, True))
    values = torch.arange(8, dtype=torch.int64)
    driver.copy(values * 1000, values * 10, values + 1, stream=5)
    assert [c["dst"] for c in driver.lib.calls] == [[0, 1000, 2000], [3000, 4000, 5000], [6000, 7000]]
    assert [c["size"] for c in driver.lib.calls] == [[1, 2, 3], [4, 5, 6], [7, 8]]


def test_a_failing_call_raises_with_the_driver_s_words():
    driver = direct.DriverBatch(FakeDriver(13000, True, fail_with=1))
    one = torch.ones(1, dtype=torch.int64)
    with pytest.raises(direct.DriverBatchError, match=r"cuMemcpyBatchAsync\(1 copies\) failed: invalid argument"):
        driver.copy(one, one, one, stream=5)


class FakeRuntime:
    def __init__(self):
        self.batches = []

    def memcpy_batch(self, words, stream):
        self.batches.append((words.clone(), stream))


class FakeStream:
    cuda_stream = 99


def test_flat_copies_go_to_the_driver_and_strided_ones_to_the_3d_call():
    """A page_first_direct-like packed pair (flat pages) and a page_first-like strided pair in one transfer."""
    row = 1152
    packed = (direct.Rows.at(1 << 40, row, row, 0), direct.Rows.at(1 << 41, row, row, 0))
    strided = (direct.Rows.at(1 << 42, row, row, 0), direct.Rows.at(1 << 43, 8 * row, row, 0))
    pairs = direct.Pairs([packed, strided])
    runs = direct.find_runs(torch.tensor([0, 1, 2, 10, 11]), torch.tensor([64, 65, 66, 128, 129]))
    plan = direct.CopyPlan(pairs, runs)
    words = plan.words
    driver, runtime = direct.DriverBatch(FakeDriver(13000, True)), FakeRuntime()
    direct._batch_on(runtime, driver, plan.descriptors(pairs, flat_apart=True), FakeStream(), 0)
    call, = driver.lib.calls
    assert call["dst"] == [(1 << 40) + 0 * row, (1 << 40) + 10 * row]
    assert call["src"] == [(1 << 41) + 64 * row, (1 << 41) + 128 * row]
    assert call["size"] == [3 * row, 2 * row] and call["stream"] == 99
    (strided_words, stream), = runtime.batches
    assert stream == 99 and torch.equal(strided_words, words[2:])  # the strided pair's two runs, as 3-D copies


def test_without_the_driver_every_copy_goes_to_the_3d_call():
    pairs = direct.Pairs([(direct.Rows.at(1 << 40, 64, 64, 0), direct.Rows.at(1 << 41, 64, 64, 0))])
    plan = direct.CopyPlan(pairs, direct.find_runs(torch.arange(4), torch.arange(4)))
    words = plan.words
    runtime = FakeRuntime()
    direct._batch_on(runtime, None, plan.descriptors(pairs, flat_apart=False), FakeStream(), 0)
    assert torch.equal(runtime.batches[0][0], words)


# ---------------------------------------------------------------------------
# Plans made once and rebased: what a load's later layers submit.

def _fake_pairs(dst_base, src_base, strided=False):
    row = 1152
    packed = (direct.Rows.at(dst_base, row, row, 0, rows=4096), direct.Rows.at(src_base, row, row, 0, rows=4096))
    pairs = [packed]
    if strided:
        pairs.append((direct.Rows.at(dst_base + (1 << 36), row, row, 0, rows=4096),
                      direct.Rows.at(src_base + (1 << 36), 8 * row, row, 0, rows=4096)))
    return direct.Pairs(pairs)


@pytest.mark.parametrize("strided", [False, True], ids=["packed", "packed+strided"])
def test_a_plan_rebased_to_other_layers_equals_a_fresh_plan(strided):
    runs = direct.find_runs(torch.tensor([0, 1, 2, 10, 11, 40]), torch.tensor([64, 65, 66, 128, 129, 7]))
    first = _fake_pairs(1 << 40, 1 << 41, strided)
    plan = direct.CopyPlan(first, runs)
    for dst_base, src_base in ((1 << 40, 1 << 41), (3 << 40, 5 << 41), ((1 << 40) - 4096, 1 << 42)):
        other = _fake_pairs(dst_base, src_base, strided)
        fresh = direct.CopyPlan(other, runs)
        assert torch.equal(plan.descriptors(other, flat_apart=False)[3], fresh.words)
        got, want = plan.descriptors(other, flat_apart=True), fresh.descriptors(other, flat_apart=True)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    # The plan itself is unchanged by rebasing (later layers must not see earlier shifts).
    assert torch.equal(plan.words, direct.CopyPlan(first, runs).words)


def test_a_plan_refuses_pairs_of_another_geometry():
    runs = direct.find_runs(torch.arange(4), torch.arange(4))
    plan = direct.CopyPlan(_fake_pairs(1 << 40, 1 << 41), runs)
    assert not plan.fits(_fake_pairs(1 << 40, 1 << 41, strided=True))
    with pytest.raises(ValueError, match="pairs differ"):
        plan.run(_fake_pairs(1 << 40, 1 << 41, strided=True))


def test_the_plan_cache_keys_on_identity_and_version():
    cache, made = direct.PlanCache(capacity=2), []
    make = lambda: made.append(1) or len(made)  # noqa: E731
    a, b = torch.arange(8), torch.arange(8)
    assert cache.get((a, b), "x", make) == 1
    assert cache.get((a, b), "x", make) == 1          # the same tensors, unchanged: reused
    assert cache.get((a, b), "y", make) == 2          # another transfer on the same indices
    a.add_(0)                                         # written in place: its version moves on
    assert cache.get((a, b), "x", make) == 3
    assert cache.get((b.clone(), b), "x", make) == 4  # equal values in another tensor: planned again
    assert len(cache._entries) == 2                   # bounded


def test_a_pool_plans_a_load_once_for_all_its_layers(monkeypatch):
    from test_host_pool import as_bytes, fill_random, get_host_rows, make_device_pool, make_host_pool

    gen = torch.Generator().manual_seed(7)
    dp = make_device_pool("mla", 1152, gen)
    pool = make_host_pool(dp, page_size=16, layout="page_first_direct")
    fill_random(pool.kv_buffer, gen)
    calls = []
    plan_direct = pool._plan_direct
    monkeypatch.setattr(pool, "_plan_direct", lambda *a: calls.append(1) or plan_direct(*a))
    host, dev = pool.alloc(64), torch.arange(64, 128)

    def check(layers):
        for layer in layers:
            want = get_host_rows(as_bytes(pool.kv_buffer), "page_first_direct", 16, layer, host)
            assert torch.equal(as_bytes(dp.kv_buffer[layer])[dev], want), f"layer {layer}"

    layers = range(len(dp.kv_buffer))
    for layer in layers:
        pool.load_to_device_per_layer(dp, host, dev, layer, "direct")
    assert len(calls) == 1
    check(layers)  # every layer got its own rows from the one plan
    dev.add_(1)    # the caller rewrote its indices in place: the next load plans again
    pool.load_to_device_per_layer(dp, host, dev, 0, "direct")
    assert len(calls) == 2
    check([0])


# ---- issue 26: SGLANG_HICACHE_JIT_DRIVER_BATCH, off unless 1 (the driver's call failed a soak) --------------------

direct_driver_batch = direct.DriverBatch


@pytest.fixture
def fresh_lookup(monkeypatch):
    """driver_batch() looks again, and finds a stand-in driver that has the call; what it built is counted."""
    built = []
    monkeypatch.setattr(direct, "_driver", None)
    monkeypatch.setattr(direct, "_driver_failure", None)
    monkeypatch.setattr(direct, "DriverBatch", lambda: built.append(1) or direct_driver_batch(FakeDriver(13000, True)))
    monkeypatch.delenv("SGLANG_HICACHE_JIT_DRIVER_BATCH", raising=False)
    return built


@pytest.mark.parametrize("value", ["", "0", "false", "no", "off", " OFF "])
def test_unset_or_off_the_setting_keeps_copies_off_the_driver_call(fresh_lookup, monkeypatch, caplog, value):
    import logging

    monkeypatch.setenv("SGLANG_HICACHE_JIT_DRIVER_BATCH", value)
    with caplog.at_level(logging.INFO, logger="sglang_hicache_jit.direct"):
        assert direct.driver_batch() is None
        assert direct.driver_batch() is None
    assert fresh_lookup == []  # libcuda's call is never even looked up
    assert direct._driver_failure == "SGLANG_HICACHE_JIT_DRIVER_BATCH is not 1"
    assert "flat copies go through cudaMemcpy3DBatchAsync: SGLANG_HICACHE_JIT_DRIVER_BATCH is not 1" in caplog.text


@pytest.mark.parametrize("value", ["1", "on", "yes", " TRUE "])
def test_on_the_driver_call_is_used(fresh_lookup, monkeypatch, value):
    monkeypatch.setenv("SGLANG_HICACHE_JIT_DRIVER_BATCH", value)
    assert direct.driver_batch() is not None and direct.driver_batch().available and fresh_lookup == [1]


@pytest.mark.parametrize("value", ["disable", "2", "none"])
def test_a_value_that_is_neither_on_nor_off_is_refused(fresh_lookup, monkeypatch, value):
    from sglang_hicache_jit import settings
    from sglang_hicache_jit.errors import BadSettingError

    monkeypatch.setenv("SGLANG_HICACHE_JIT_DRIVER_BATCH", value)
    with pytest.raises(BadSettingError, match="SGLANG_HICACHE_JIT_DRIVER_BATCH"):
        direct.driver_batch()
    shown, = [s for s in settings.effective() if s["variable"] == "SGLANG_HICACHE_JIT_DRIVER_BATCH"]
    assert shown["error"] and fresh_lookup == []


def test_info_lists_the_setting(monkeypatch):
    from sglang_hicache_jit import settings

    monkeypatch.setenv("SGLANG_HICACHE_JIT_DRIVER_BATCH", "0")
    shown, = [s for s in settings.effective() if s["variable"] == "SGLANG_HICACHE_JIT_DRIVER_BATCH"]
    assert shown["value"] is False and shown["source"] == "env"


@pytest.mark.gpu
def test_with_the_setting_off_batched_copies_never_reach_the_driver(monkeypatch):
    """On the GPU: mode 'batch' and 'auto' still copy bit-exactly, all through cudaMemcpy3DBatchAsync."""
    if not direct.batch_status()[0]:
        pytest.skip(direct.batch_status()[1])
    monkeypatch.setattr(direct, "_driver", None)
    monkeypatch.setattr(direct, "_driver_failure", None)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_DRIVER_BATCH", "0")

    def never(*args, **kwargs):
        raise AssertionError("cuMemcpyBatchAsync was called with SGLANG_HICACHE_JIT_DRIVER_BATCH=0")

    monkeypatch.setattr(direct.DriverBatch, "copy", never)
    gen = torch.Generator().manual_seed(26)
    host = torch.randint(0, 256, (512, 1152), dtype=torch.uint8, generator=gen).pin_memory()
    idx = (torch.randperm(8, generator=gen)[:4, None] * 64 + torch.arange(64)).reshape(-1)
    for mode in ("batch", "auto"):
        dev = torch.zeros((512 + 2, 1152), dtype=torch.uint8, device="cuda")  # a guard row either side
        assert direct.copy_rows([(dev[1:-1], host)], idx, idx, mode=mode, page_size=64) == "batch"
        torch.cuda.synchronize()
        expected = torch.zeros_like(host)
        expected[idx] = host[idx]
        assert torch.equal(dev[1:-1].cpu(), expected) and not dev[0].any() and not dev[-1].any()
    assert "SGLANG_HICACHE_JIT_DRIVER_BATCH is not 1" in direct.batch_status()[1]
