"""Bit-exact transfers on a real GPU (marked ``gpu``; skipped without one).

Every test fills both pools with random bytes, copies, and compares the whole
destination against a reference computed with plain indexing, so rows that
were not addressed must come out untouched.
"""

import pytest
import torch

from sglang_hicache_jit import ops
from sglang_hicache_jit.errors import TransferIndexError

pytestmark = pytest.mark.gpu

ROW_BYTES = [1152, 576, 656, 2048, 256, 12, 4]
LAYERS, HOST_SLOTS, DEVICE_SLOTS, PAGE = 4, 2048, 1024, 64


def _random_bytes(shape, device, gen=None):
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)


def _host_pool(layout, row_bytes, caches=1):
    """Pinned host buffer in ``layout`` filled with random bytes; returns (buffer, per-layer views)."""
    shape = (LAYERS, HOST_SLOTS, row_bytes) if layout == "layer_first" else (HOST_SLOTS, LAYERS, row_bytes)
    buffers, views = [], []
    for _ in range(caches):
        buf = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        buf.copy_(_random_bytes(shape, "cuda"))
        buffers.append(buf)
        views.append([buf[l] if layout == "layer_first" else buf[:, l] for l in range(LAYERS)])
    return buffers, views


def _pages(num_pages, total_slots, gen, sort):
    pages = torch.randperm(total_slots // PAGE, generator=gen)[:num_pages]
    if sort:
        pages = pages.sort().values
    return (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


def _index_pair(num_pages, dtype, gen, *, with_skips=True):
    host = _pages(num_pages, HOST_SLOTS, gen, sort=True)
    dev = _pages(num_pages, DEVICE_SLOTS, gen, sort=False)
    if with_skips:  # a few padding entries, on either side
        host[3] = -1
        dev[70] = -1
    return host.to(dtype), dev.to(dtype)


def _reference_copy(dst, dst_idx, src, src_idx):
    keep = (dst_idx >= 0) & (src_idx >= 0)
    d, s = dst_idx[keep].long().to(dst.device), src_idx[keep].long().to(src.device)
    expected = dst.clone()
    expected[d] = src[s].to(dst.device)
    return expected


@pytest.mark.parametrize("method", ["auto", "plain", "bulk"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("row_bytes", ROW_BYTES)
def test_mla_one_layer_round_trip(row_bytes, layout, index_dtype, method):
    gen = torch.Generator().manual_seed(row_bytes * 7 + LAYERS)
    (host_buf,), (host_layers,) = _host_pool(layout, row_bytes)
    device_layer = _random_bytes((DEVICE_SLOTS, row_bytes), "cuda")
    host_idx, dev_idx = _index_pair(6, index_dtype, gen)
    layer = 2

    # device -> host (backup), compared over the whole host buffer
    expected_host = host_buf.clone()
    expected_host_view = expected_host[layer] if layout == "layer_first" else expected_host[:, layer]
    expected_host_view.copy_(_reference_copy(host_layers[layer], host_idx, device_layer.cpu(), dev_idx))
    ops.transfer_one_layer_mla(host_layers[layer], host_idx.cuda(), device_layer, dev_idx.cuda(), method=method)
    torch.cuda.synchronize()
    assert torch.equal(host_buf, expected_host)

    # host -> device (load) into a fresh random device layer at other slots
    target = _random_bytes((DEVICE_SLOTS, row_bytes), "cuda")
    _, dev_idx2 = _index_pair(6, index_dtype, gen)
    expected_dev = _reference_copy(target, dev_idx2.cuda(), host_layers[layer].cuda(), host_idx.cuda())
    ops.transfer_one_layer_mla(target, dev_idx2, host_layers[layer], host_idx, method=method)  # CPU indices
    torch.cuda.synchronize()
    assert torch.equal(target, expected_dev)
    ops.check_errors()


@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (1, 576)), (torch.float8_e4m3fn, (1, 576)),
                                         (torch.uint8, (656,)), (torch.float16, (8, 128))])
def test_mla_typed_rows_and_element_dim(dtype, shape):
    gen = torch.Generator().manual_seed(5)
    dev = _random_bytes((DEVICE_SLOTS, *shape), "cuda").view(torch.uint8)
    dev = torch.randn((DEVICE_SLOTS, *shape), device="cuda").to(dtype) if dtype != torch.uint8 else dev
    host = torch.zeros((HOST_SLOTS, LAYERS, *shape), dtype=dtype, pin_memory=True)
    host_idx, dev_idx = _index_pair(4, torch.int64, gen)
    ops.transfer_one_layer_mla(host[:, 1], host_idx, dev, dev_idx)
    back = torch.zeros_like(dev)
    ops.transfer_one_layer_mla(back.view(-1), dev_idx, host[:, 1], host_idx, element_dim=int(torch.tensor(shape).prod()))
    torch.cuda.synchronize()
    keep = (host_idx >= 0) & (dev_idx >= 0)
    assert torch.equal(back[dev_idx[keep]].view(torch.uint8), dev[dev_idx[keep]].view(torch.uint8))
    untouched = torch.ones(DEVICE_SLOTS, dtype=torch.bool)
    untouched[dev_idx[keep]] = False
    assert int(back.view(torch.uint8)[untouched.cuda()].count_nonzero()) == 0


@pytest.mark.parametrize("method", ["auto", "plain"])
@pytest.mark.parametrize("row_bytes", [2048, 256, 656])
def test_mha_one_layer_round_trip(row_bytes, method):
    gen = torch.Generator().manual_seed(row_bytes)
    (k_buf, v_buf), (k_layers, v_layers) = _host_pool("page_first", row_bytes, caches=2)
    k_dev = _random_bytes((DEVICE_SLOTS, row_bytes), "cuda")
    v_dev = _random_bytes((DEVICE_SLOTS, row_bytes), "cuda")
    host_idx, dev_idx = _index_pair(5, torch.int32, gen)
    exp_k = _reference_copy(k_layers[1], host_idx, k_dev.cpu(), dev_idx)
    exp_v = _reference_copy(v_layers[1], host_idx, v_dev.cpu(), dev_idx)
    ops.transfer_one_layer(k_layers[1], v_layers[1], host_idx, k_dev, v_dev, dev_idx, method=method)
    torch.cuda.synchronize()
    assert torch.equal(k_layers[1], exp_k) and torch.equal(v_layers[1], exp_v)
    k2, v2 = torch.zeros_like(k_dev), torch.zeros_like(v_dev)
    ops.transfer_one_layer(k2, v2, dev_idx, k_layers[1], v_layers[1], host_idx, method=method)
    torch.cuda.synchronize()
    keep = (host_idx >= 0) & (dev_idx >= 0)
    assert torch.equal(k2[dev_idx[keep].long()], k_dev[dev_idx[keep].long()])
    assert torch.equal(v2[dev_idx[keep].long()], v_dev[dev_idx[keep].long()])


@pytest.mark.parametrize("mha", [False, True])
@pytest.mark.parametrize("row_bytes", [1152, 656, 12])
def test_all_layer_backup_and_restore(row_bytes, mha):
    gen = torch.Generator().manual_seed(11)
    caches = 2 if mha else 1
    host_bufs, host_views = _host_pool("page_first", row_bytes, caches=caches)
    dev_layers = [[_random_bytes((DEVICE_SLOTS, row_bytes), "cuda") for _ in range(LAYERS)] for _ in range(caches)]
    host_idx, dev_idx = _index_pair(4, torch.int64, gen)
    expected = [b.clone() for b in host_bufs]
    for c in range(caches):
        for l in range(LAYERS):
            expected[c][:, l].copy_(_reference_copy(host_views[c][l], host_idx, dev_layers[c][l].cpu(), dev_idx))
    wrap = (lambda x: (tuple(x[0]), tuple(x[1]))) if mha else (lambda x: x[0])
    dst = ops.LayerTable(wrap(host_views), written=True)
    src = ops.LayerTable(wrap(dev_layers))
    ops.transfer_all_layer(dst, host_idx, src, dev_idx)
    torch.cuda.synchronize()
    for c in range(caches):
        assert torch.equal(host_bufs[c], expected[c])
    # and back into zeroed device layers
    back = [[torch.zeros_like(t) for t in layers] for layers in dev_layers]
    ops.transfer_all_layer(wrap(back), dev_idx, dst, host_idx)
    torch.cuda.synchronize()
    keep = ((host_idx >= 0) & (dev_idx >= 0)).cuda()
    d = dev_idx.cuda()[keep].long()
    for c in range(caches):
        for l in range(LAYERS):
            assert torch.equal(back[c][l][d], dev_layers[c][l][d])
            assert int(back[c][l].sum()) == int(back[c][l][d].sum())


@pytest.mark.parametrize("method", ["plain", "bulk"])
@pytest.mark.parametrize("side", ["src", "dst"])
def test_out_of_range_index_is_skipped_and_reported(side, method):
    dev = _random_bytes((DEVICE_SLOTS, 1152), "cuda")
    guard = torch.zeros((HOST_SLOTS + 64, 1152), dtype=torch.uint8, pin_memory=True)
    host = guard[:HOST_SLOTS]  # rows past the end exist in memory: a stray write would land there
    host_idx = torch.arange(0, 64, dtype=torch.int64)
    dev_idx = torch.arange(0, 64, dtype=torch.int64)
    if side == "dst":
        host_idx[5] = HOST_SLOTS + 3
    else:
        dev_idx[5] = DEVICE_SLOTS + 3
    ops.transfer_one_layer_mla(host, host_idx, dev, dev_idx, method=method)
    with pytest.raises(TransferIndexError, match=f"indices_{side}"):
        ops.check_errors()
    assert int(guard[HOST_SLOTS:].count_nonzero()) == 0
    ok = torch.ones(64, dtype=torch.bool)
    ok[5] = False
    assert torch.equal(host[host_idx[ok]], dev[dev_idx[ok].cuda()].cpu())
    assert int(host[5].count_nonzero()) == 0  # the refused pair copied nothing
    ops.check_errors()  # cleared after raising


@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_strict_mode_raises_before_launch(monkeypatch, where):
    monkeypatch.setenv("SGLANG_HICACHE_JIT_STRICT", "1")
    ops.reload_settings()
    try:
        dev = _random_bytes((DEVICE_SLOTS, 64), "cuda")
        host = torch.zeros((HOST_SLOTS, 64), dtype=torch.uint8, pin_memory=True)
        with pytest.raises(TransferIndexError, match="indices_dst"):
            ops.transfer_one_layer_mla(host, torch.tensor([HOST_SLOTS], device=where), dev,
                                       torch.tensor([0], device=where))
        torch.cuda.synchronize()
        assert int(host.count_nonzero()) == 0
    finally:
        monkeypatch.delenv("SGLANG_HICACHE_JIT_STRICT")
        ops.reload_settings()


def test_runs_on_the_current_stream():
    row = 1152
    dev = _random_bytes((DEVICE_SLOTS, row), "cuda")
    host = torch.zeros((HOST_SLOTS, row), dtype=torch.uint8, pin_memory=True)
    idx = torch.arange(512, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.transfer_one_layer_mla(host, idx, dev, idx)
    side.synchronize()
    assert torch.equal(host[:512], dev[:512].cpu())


def test_repeated_calls_follow_the_tensors():
    """Calls that reuse a launch plan (same tensors, fresh views of one
    buffer) and calls after set_()/resize_() on the same objects all land
    bit-exact, with GPU and CPU indices."""
    gen = torch.Generator().manual_seed(11)
    row = 576
    (host_buf,), (host_layers,) = _host_pool("page_first", row)
    dev = _random_bytes((DEVICE_SLOTS, row), "cuda")
    for round_ in range(3):
        for layer in (1, 2, 1):
            host_idx, dev_idx = _index_pair(3, torch.int64, gen)
            host_view = host_buf[:, layer]  # a fresh view per call, as SGLang's routed ops cut
            expected = _reference_copy(dev, dev_idx.cuda(), host_view.cuda(), host_idx.cuda())
            indices = (dev_idx, host_idx) if round_ == 1 else (dev_idx.cuda(), host_idx.cuda())
            ops.transfer_one_layer_mla(dev, indices[0], host_view, indices[1])
            torch.cuda.synchronize()
            assert torch.equal(dev, expected)
        if round_:
            assert torch.equal(previous, previous_before)  # copies went to the new storage only
        previous = dev[:]  # keeps the current storage alive after set_()
        previous_before = previous.clone()
        dev.set_(_random_bytes((DEVICE_SLOTS, row), "cuda"))  # same object, new storage
    dev.resize_(DEVICE_SLOTS // 2, row)  # same pointer, fewer slots: the kernel must see the new bound
    with pytest.raises(TransferIndexError):
        ops.transfer_one_layer_mla(dev, torch.tensor([DEVICE_SLOTS // 2 + 1], device="cuda"), host_layers[0],
                                   torch.tensor([0], device="cuda"))
        ops.check_errors()
    ops.check_errors()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device():
    dev = _random_bytes((DEVICE_SLOTS, 576), "cuda:1")
    host = torch.zeros((HOST_SLOTS, 576), dtype=torch.uint8, pin_memory=True)
    idx = torch.arange(256, device="cuda:1")
    ops.transfer_one_layer_mla(host, idx, dev, idx)
    torch.cuda.synchronize(1)
    assert torch.equal(host[:256], dev[:256].cpu())


def test_probe_reports_ok_on_gpu():
    from sglang_hicache_jit import probe

    result = probe.probe(576)
    assert result.available, result
    assert result.code == "ok" and result.method in ("bulk", "plain")
    assert probe.probe(6).code == "unsupported_element_size"


@pytest.mark.parametrize("tuning", [dict(bulk_warps=2, read_align=128), dict(bulk_warps=4, read_align=32),
                                    dict(bulk_warps=1, read_align=256)])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("row_bytes", [656, 576, 1152, 256])
def test_bulk_tuning_variants_stay_exact_at_pool_edges(row_bytes, layout, tuning):
    """Wider aligned reads must never leave the pool (first and last slots included)."""
    gen = torch.Generator().manual_seed(row_bytes + len(layout))
    (host_buf,), (host_layers,) = _host_pool(layout, row_bytes)
    host_idx, _ = _index_pair(6, torch.int64, gen)
    host_idx[:2] = torch.tensor([0, HOST_SLOTS - 1])  # the edges of the pool
    dev_idx = torch.randperm(DEVICE_SLOTS, generator=gen)[: host_idx.numel()]  # unique: no write races
    previous = ops.set_tuning(**tuning)
    try:
        for layer in (0, LAYERS - 1):
            target = _random_bytes((DEVICE_SLOTS, row_bytes), "cuda")
            expected = _reference_copy(target, dev_idx.cuda(), host_layers[layer].cuda(), host_idx.cuda())
            # A tuning whose stages do not fit in shared memory falls back to plain (also exact).
            ran = ops.transfer_one_layer_mla(target, dev_idx, host_layers[layer], host_idx, method="bulk")
            assert ran == "bulk" or (row_bytes * 32 * tuning["bulk_warps"] * 2 > 227 * 1024 and ran == "plain")
            torch.cuda.synchronize()
            assert torch.equal(target, expected)
    finally:
        ops.set_tuning(**previous)
    ops.check_errors()
