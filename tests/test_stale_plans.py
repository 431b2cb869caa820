"""Copy-engine plans that cannot go stale (issue 35): a plan is reused only for the same index bytes, read
each call, never for the same tensor object or version counter; inference tensors work; and the one plan cache
of the routed ops tells apart which side a token -> row map applies to.

On the CPU: the direct path runs CPU tensors as slice copies of the same plans, so every finding runs here
(test_stale_plans_gpu.py repeats the ones that need CUDA indices). Each test compares whole buffers, so a
row written where it should not be fails as surely as a row not written.
"""

import ctypes

import pytest
import torch
from torch.utils import dlpack

from sglang_hicache_jit.integrations.sglang import ops as routed

from test_host_pool import (LAYOUTS, as_bytes, device_caches, fill_random, get_host_rows, host_caches,
                            make_device_pool, make_host_pool, set_host_rows)

PAGE = 4
CHANNELS = ["data", "ctypes", "dlpack", "alias-copy", "numpy", "set"]


def _write_behind_torch(t: torch.Tensor, values, channel: str) -> None:
    """Writes ``values`` into the first entries of ``t`` so that its version counter does not move: the ways
    SGLang's tensors (or a caller's) change without torch noticing on the tensor the plan cache saw."""
    values = torch.as_tensor(values, dtype=t.dtype)
    version = t._version if not t.is_inference() else None
    if channel == "data":          # an alias through .data: its own version counter
        t.data[:values.numel()] = values
    elif channel == "ctypes":      # a raw write (a C extension, a DMA, a CUDA graph replay on the GPU)
        ctypes.memmove(t.data_ptr(), values.data_ptr(), values.numel() * t.element_size())
    elif channel == "dlpack":      # another framework's view of the same memory
        dlpack.from_dlpack(dlpack.to_dlpack(t))[:values.numel()] = values
    elif channel == "alias-copy":  # copy_ into another tensor over the same storage: its own version counter
        alias = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        alias[:values.numel()].copy_(values)
    elif channel == "numpy":       # a numpy view of a CPU tensor
        pytest.importorskip("numpy", reason="the numpy channel needs numpy (not a dependency of this package)")
        t.numpy()[:values.numel()] = values.numpy()
    elif channel == "set":         # the same object re-pointed at other memory (set_ moves the counter once)
        moved = t.clone()
        moved[:values.numel()] = values
        t.set_(moved.untyped_storage(), 0, t.shape, t.stride())
        return
    else:
        raise AssertionError(channel)
    assert version is None or t._version == version, "the write moved the version counter: not the attack"


def _pool(kind, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    dp = make_device_pool(kind, 1152, gen)
    pool = make_host_pool(dp, page_size=PAGE, layout=layout)
    for buf in host_caches(pool):
        fill_random(buf, gen)
    return gen, dp, pool


def _expect_load(dp, pool, layer, host_idx, dev_idx):
    """The device caches after loading host layer ``layer`` at ``host_idx`` to ``dev_idx`` (plain indexing)."""
    keep = (host_idx >= 0) & (dev_idx >= 0)
    out = []
    for c, layers in enumerate(device_caches(dp)):
        want = as_bytes(layers[layer]).clone()
        want[dev_idx[keep].long()] = get_host_rows(as_bytes(host_caches(pool)[c]), pool.layout, PAGE, layer,
                                                    host_idx[keep].long())
        out.append(want)
    return out


def _check_layer(dp, layer, expected):
    for c, layers in enumerate(device_caches(dp)):
        assert torch.equal(as_bytes(layers[layer]), expected[c]), f"cache {c} layer {layer}: a stale plan's rows"


# ---------------------------------------------------------------------------
# The host pools.

@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize("side", ["host", "device"])
@pytest.mark.parametrize("kind", ["mla", "mha"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_load_sees_indices_changed_behind_torch_between_layers(layout, kind, side, channel):
    """Load layer 0, rewrite the first page of one index tensor without a version bump, load layer 1: layer 1
    must get the rows the indices name now. Before: the plan made for layer 0 was reused (identity and version
    unchanged) and layer 1 got the old page's rows."""
    gen, dp, pool = _pool(kind, layout, seed=hash((layout, kind, side, channel)) % 1000)
    host = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23])
    dev = torch.tensor([4, 5, 6, 7, 40, 41, 42, 43])
    pool.load_to_device_per_layer(dp, host, dev, 0, "direct")
    target = host if side == "host" else dev
    _write_behind_torch(target, [0, 1, 2, 3] if side == "host" else [60, 61, 62, 63], channel)
    expected = _expect_load(dp, pool, 1, host, dev)
    pool.load_to_device_per_layer(dp, host, dev, 1, "direct")
    _check_layer(dp, 1, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_issue_s_example_load_layer_0_then_h_data_0_then_layer_1(layout):
    gen, dp, pool = _pool("mla", layout, seed=35)
    h, d = torch.tensor([1, 2, 3]), torch.tensor([10, 11, 12])
    pool.load_to_device_per_layer(dp, h, d, 0, "direct")
    h.data[0] = 6
    expected = _expect_load(dp, pool, 1, h, d)
    pool.load_to_device_per_layer(dp, h, d, 1, "direct")
    _check_layer(dp, 1, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_backup_sees_indices_changed_behind_torch(layout):
    gen, dp, pool = _pool("mha", layout, seed=7)
    host = torch.arange(8, 16)
    dev = torch.arange(100, 108)
    pool.backup_from_device_all_layer(dp, host, dev, "direct")
    dev.data[:4] = torch.tensor([200, 201, 202, 203])
    expected = [as_bytes(b).clone() for b in host_caches(pool)]
    for c, layers in enumerate(device_caches(dp)):
        for layer, t in enumerate(layers):
            set_host_rows(expected[c], layout, PAGE, layer, host, as_bytes(t)[dev])
    pool.backup_from_device_all_layer(dp, host, dev, "direct")
    for c, buf in enumerate(host_caches(pool)):
        assert torch.equal(as_bytes(buf), expected[c]), f"cache {c}: the old device rows were backed up"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inference_tensors_load_and_back_up(layout):
    """SGLang makes its index tensors under torch.inference_mode() (SGLANG_ENABLE_TORCH_INFERENCE_MODE=1).
    Before: every copy-engine load and backup raised 'Inference tensors do not track version counter'."""
    gen, dp, pool = _pool("mla", layout, seed=11)
    with torch.inference_mode():
        host, dev = torch.arange(4, 12), torch.arange(20, 28)
    assert host.is_inference() and dev.is_inference()
    pool.backup_from_device_all_layer(dp, host, dev, "direct")
    for layer, t in enumerate(dp.kv_buffer):
        assert torch.equal(get_host_rows(as_bytes(pool.kv_buffer), layout, PAGE, layer, host), as_bytes(t)[dev])
    for layers in device_caches(dp):
        for t in layers:
            fill_random(t, gen)
    for layer in range(len(dp.kv_buffer)):
        expected = _expect_load(dp, pool, layer, host, dev)
        pool.load_to_device_per_layer(dp, host, dev, layer, "direct")
        _check_layer(dp, layer, expected)
        if layer == 0:
            with torch.inference_mode():  # changed in place where SGLang would: its version is not tracked
                host[:4] = torch.arange(12, 16)


# ---------------------------------------------------------------------------
# The routed ops (SGLang's direct backend; CPU tensors run the copy engines' plan).

LAYERS, DIM, HOST_PAGES = 2, 8, 4


def _pfd_host(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1000, (HOST_PAGES, LAYERS, PAGE, 1, DIM), generator=gen, dtype=torch.int32)


def test_one_index_tensor_as_both_arguments_is_planned_per_side():
    """transfer_kv_per_layer_direct_pf_lf maps the source side's tokens to rows, transfer_kv_all_layer_direct_lf_pf
    the destination side's. With one idx tensor as both index arguments and pairs of the same geometry, the
    backup reused the load's plan (its map on the wrong side) and overwrote host rows of another layer."""
    host = _pfd_host(1)
    span = (HOST_PAGES - 1) * LAYERS * PAGE + PAGE  # a layer's flat rows: device layers of that many slots
    gen = torch.Generator().manual_seed(2)
    dev = torch.randint(-1000, 1000, (span, 1, DIM), generator=gen, dtype=torch.int32)
    idx = torch.arange(PAGE, 2 * PAGE)  # page 1 on both sides
    loaded = dev.clone()
    routed.transfer_kv_per_layer_direct_pf_lf([host], [loaded], idx, idx, 0, PAGE)
    want = dev.clone()
    want[idx] = host[1, 0]
    assert torch.equal(loaded, want)
    expected = host.clone()
    expected[1, 0] = dev[idx]  # host layer 0, page 1; layer 1 untouched
    routed.transfer_kv_all_layer_direct_lf_pf([dev], [host], idx, idx, PAGE)
    assert torch.equal(host, expected), "host rows of another layer were written"


@pytest.mark.parametrize("channel", CHANNELS)
def test_a_routed_per_layer_load_sees_indices_changed_behind_torch(channel):
    host = _pfd_host(3)
    gen = torch.Generator().manual_seed(4)
    dev = [torch.zeros((6 * PAGE, 1, DIM), dtype=torch.int32) for _ in range(LAYERS)]
    h = torch.arange(2 * PAGE, 3 * PAGE)
    d = torch.arange(PAGE, 2 * PAGE)
    routed.transfer_kv_per_layer_direct_pf_lf([host], [dev[0]], h, d, 0, PAGE)
    _write_behind_torch(h, torch.arange(3 * PAGE, 4 * PAGE), channel)
    routed.transfer_kv_per_layer_direct_pf_lf([host], [dev[1]], h, d, 1, PAGE)
    assert torch.equal(dev[1][d], host[3, 1]), "layer 1 got the old page"
    assert not dev[1][:PAGE].any() and not dev[1][2 * PAGE:].any()
    del gen


def test_routed_one_layer_ops_see_indices_changed_behind_torch():
    """The kvcacheio per-layer op on the copy engines (SGLang's load loop, one index pair for every layer)."""
    gen = torch.Generator().manual_seed(5)
    host = [torch.randint(0, 100, (16, 1, DIM), generator=gen, dtype=torch.int32) for _ in range(LAYERS)]
    dev = [torch.zeros((16, 1, DIM), dtype=torch.int32) for _ in range(LAYERS)]
    h, d = torch.arange(0, 4), torch.arange(8, 12)
    item = DIM * 4
    with routed.copy_engines_only():
        routed.transfer_kv_per_layer_mla(host[0], dev[0], h, d, item)
        h.data[:] = torch.arange(4, 8)
        routed.transfer_kv_per_layer_mla(host[1], dev[1], h, d, item)
    assert torch.equal(dev[1][d], host[1][4:8]), "layer 1 got the rows the old indices named"


def test_routed_ops_take_inference_tensors():
    host = _pfd_host(6)
    dev = [torch.zeros((6 * PAGE, 1, DIM), dtype=torch.int32) for _ in range(LAYERS)]
    with torch.inference_mode():
        h, d = torch.arange(PAGE, 2 * PAGE), torch.arange(0, PAGE)
    for layer in range(LAYERS):
        routed.transfer_kv_per_layer_direct_pf_lf([host], [dev[layer]], h, d, layer, PAGE)
        assert torch.equal(dev[layer][d], host[1, layer])
    routed.transfer_kv_all_layer_direct_lf_pf(dev, [host], d, h, PAGE)
