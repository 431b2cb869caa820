"""The direct (copy-engine) path on a real GPU (marked ``gpu``).

Every test compares the whole destination with a reference built by plain
indexing, so rows nobody addressed must come out untouched, for every
submission mode: 'batch' (every copy, flat or strided, through
cudaMemcpy3DBatchAsync) and '2d' (one cudaMemcpy2DAsync per run).
"""

import logging

import pytest
import torch

from sglang_hicache_jit.transfer import cuda, direct
from sglang_hicache_jit.errors import TransferIndexError

pytestmark = pytest.mark.gpu

MODES = ["batch", "2d"]


def _bytes(shape, device="cpu", gen=None, pin=False):
    t = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    t = t.to(device)
    return t.pin_memory() if pin else t


def _reference(dst, dst_idx, src, src_idx):
    keep = (dst_idx >= 0) & (src_idx >= 0)
    expected = dst.cpu().clone()
    expected[dst_idx[keep].long().cpu()] = src.cpu()[src_idx[keep].long().cpu()]
    return expected


def _page_indices(pages, total_slots, page, gen, sort):
    chosen = torch.randperm(total_slots // page, generator=gen)[:pages]
    if sort:
        chosen = chosen.sort().values
    return (chosen[:, None] * page + torch.arange(page)).reshape(-1)


def test_the_batch_call_is_available_with_this_runtime():
    """The runtime's cudaMemcpy3DBatchAsync (CUDA 12.8+) takes every copy; the driver's cuMemcpyBatchAsync, which
    returned wrong rows on driver 580.159.04, is never named as a path."""
    ok, why = direct.batch_status()
    runtime = cuda.cuda_runtime()
    if runtime.version >= 12080:
        assert ok and "cudaMemcpy3DBatchAsync" in why and "for every copy" in why, why
    else:
        assert not ok and "12.8" in why
    assert "cuMemcpyBatchAsync" not in why


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("row_bytes", [1152, 576, 656, 4, 2048])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_page_first_layers_both_directions(mode, pinned, row_bytes, page):
    """Host page_first layers (strided), device layers (packed): backup then load, all layers in one call."""
    gen = torch.Generator().manual_seed(row_bytes * 131 + page)
    layers, host_slots, dev_slots = 3, 1024, 512
    host = _bytes((host_slots, layers, row_bytes), gen=gen, pin=pinned)
    dev = [_bytes((dev_slots, row_bytes), "cuda", gen) for _ in range(layers)]
    pages = dev_slots // page // 2
    h = _page_indices(pages, host_slots, page, gen, sort=True)
    d = _page_indices(pages, dev_slots, page, gen, sort=False)
    h[5 % h.numel()] = -1  # padding

    expected = host.clone()
    for l in range(layers):
        expected[:, l] = _reference(host[:, l], h, dev[l], d)
    try:
        used = direct.copy_rows([(host[:, l], dev[l]) for l in range(layers)], h, d, mode=mode)
    except RuntimeError as exc:
        if pinned or mode != "batch":
            raise
        pytest.skip(f"the batch call refuses pageable host memory here ('auto' uses 2-D copies for it): {exc}")
    torch.cuda.synchronize()
    assert used == mode and torch.equal(host, expected)

    target = [_bytes((dev_slots, row_bytes), "cuda", gen) for _ in range(layers)]
    wanted = [_reference(target[l], d, host[:, l], h) for l in range(layers)]
    direct.copy_rows([(target[l], host[:, l]) for l in range(layers)], d, h, mode=mode)
    torch.cuda.synchronize()
    for l in range(layers):
        assert torch.equal(target[l].cpu(), wanted[l])


def test_auto_mode_sends_pageable_memory_as_2d_copies():
    host, dev = torch.zeros((64, 16), dtype=torch.uint8), torch.ones((64, 16), dtype=torch.uint8, device="cuda")
    assert direct.copy_rows([(host, dev)], torch.arange(4), torch.arange(4)) == "2d"
    assert direct.copy_rows([(host.pin_memory(), dev)], torch.arange(4), torch.arange(4)) == "batch"


@pytest.mark.parametrize("mode", MODES)
def test_scattered_single_rows_and_long_runs(mode):
    gen = torch.Generator().manual_seed(3)
    host = _bytes((4096, 2, 256), gen=gen, pin=True)
    dev = _bytes((4096, 256), "cuda", gen)
    scattered_h, scattered_d = torch.randperm(4096, generator=gen)[:300], torch.randperm(4096, generator=gen)[:300]
    long_h, long_d = torch.arange(1000, 3000), torch.arange(0, 2000)
    for h, d in ((scattered_h, scattered_d), (long_h, long_d)):
        expected = _reference(dev, d, host[:, 1], h)
        direct.copy_rows([(dev, host[:, 1])], d, h, mode=mode)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), expected)


def test_more_copies_than_one_batch_call_takes():
    gen = torch.Generator().manual_seed(4)
    n = cuda.MAX_BATCH_OPS + 1234
    host = _bytes((2 * n, 64), gen=gen, pin=True)
    dev = _bytes((n, 64), "cuda", gen)
    h = torch.randperm(2 * n, generator=gen)[:n]  # single-row runs: one copy each
    d = torch.arange(n).flip(0)
    expected = _reference(dev, d, host, h)
    assert direct.copy_rows([(dev, host)], d, h, mode="batch") == "batch"
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), expected)


@pytest.mark.parametrize("mode", MODES)
def test_gpu_to_gpu_and_gpu_indices(mode):
    gen = torch.Generator().manual_seed(5)
    a, b = _bytes((512, 1152), "cuda", gen), _bytes((512, 1152), "cuda", gen)
    d = torch.randperm(512, generator=gen)[:200].cuda()
    s = torch.randperm(512, generator=gen)[:200].to(torch.int32).cuda()
    expected = _reference(a, d, b, s)
    direct.copy_rows([(a, b)], d, s, mode=mode)
    torch.cuda.synchronize()
    assert torch.equal(a.cpu(), expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
@pytest.mark.parametrize("page", [1, 64], ids=["per-row-plan", "per-page-plan"])
def test_copies_are_ordered_on_the_current_stream(mode, side_stream, page):
    """A long fill of the source is queued first; the copy must see its result."""
    gen = torch.Generator().manual_seed(6)
    src = torch.empty((1 << 16, 4096), dtype=torch.uint8, device="cuda")  # 256 MiB: the fill takes a while
    host = torch.zeros((1 << 10, 4096), dtype=torch.uint8, pin_memory=True)
    s = _page_indices((1 << 10) // page, 1 << 16, page, gen, sort=False)
    d = torch.arange(1 << 10)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        for value in (3, 7):
            src.fill_(value)
            direct.copy_rows([(host, src)], d, s, mode=mode, page_size=page)
            stream.synchronize()
            assert bool((host == value).all()), f"the copy ran before the fill (value {value})"


def test_out_of_range_indices_raise_before_copying():
    dev = torch.zeros((64, 16), dtype=torch.uint8, device="cuda")
    host = torch.ones((64, 16), dtype=torch.uint8, pin_memory=True)
    with pytest.raises(TransferIndexError, match="indices_dst holds index 64"):
        direct.copy_rows([(dev, host)], torch.tensor([0, 64]), torch.tensor([0, 1]))
    torch.cuda.synchronize()
    assert not dev.any()
    assert direct.copy_rows([(dev, host)], torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))


def test_a_failing_3d_call_falls_back_once_and_explicit_modes_raise(monkeypatch, caplog):
    runtime = cuda.cuda_runtime()
    monkeypatch.setattr(runtime, "_batch", lambda *args: 1)  # cudaErrorInvalidValue
    monkeypatch.setattr(direct, "_batch_failure", None)
    dev = torch.zeros((64, 16), dtype=torch.uint8, device="cuda")
    host = torch.arange(64 * 32, dtype=torch.int64).to(torch.uint8).view(64, 2, 16).pin_memory()
    layer = host[:, 1]  # strided rows: the 3-D call's copies
    idx = torch.arange(8, 24)
    with pytest.raises(RuntimeError, match="cudaMemcpy3DBatchAsync"):
        direct.copy_rows([(dev, layer)], idx, idx, mode="batch")
    with caplog.at_level(logging.WARNING, logger="sglang_hicache_jit.transfer.direct"):
        assert direct.copy_rows([(dev, layer)], idx, idx) == "2d"
        assert direct.copy_rows([(dev, layer)], idx, idx) == "2d"
    torch.cuda.synchronize()
    assert torch.equal(dev[8:24].cpu(), layer[8:24]) and not dev[:8].any() and not dev[24:].any()
    assert len([r for r in caplog.records if "cudaMemcpy3DBatchAsync" in r.getMessage()]) == 1
    assert not direct.batch_status()[0]


def test_a_captured_graph_records_2d_copies_and_replays_them():
    gen = torch.Generator().manual_seed(8)
    host = _bytes((256, 2, 64), gen=gen, pin=True)
    dev = torch.zeros((256, 64), dtype=torch.uint8, device="cuda")
    flat_host = _bytes((256, 64), gen=gen, pin=True)
    flat_dev = torch.zeros((256, 64), dtype=torch.uint8, device="cuda")
    d, h = torch.randperm(256, generator=gen)[:64], torch.randperm(256, generator=gen)[:64]
    paged_dev = torch.zeros((256, 64), dtype=torch.uint8, device="cuda")
    pd, ph = _page_indices(8, 256, 8, gen, sort=False), _page_indices(8, 256, 8, gen, sort=True)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):
        assert direct.copy_rows([(dev, host[:, 1])], d, h) == "2d"
        assert direct.copy_rows([(flat_dev, flat_host)], d, h) == "2d"
        assert direct.copy_rows([(paged_dev, flat_host)], pd, ph, page_size=8) == "2d"  # the per-page plan
        with pytest.raises(RuntimeError, match="captured"):
            direct.copy_rows([(flat_dev, flat_host)], d, h, mode="batch")
    assert not dev.any() and not flat_dev.any() and not paged_dev.any()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), _reference(torch.zeros_like(dev), d, host[:, 1], h))
    assert torch.equal(flat_dev.cpu(), _reference(torch.zeros_like(flat_dev), d, flat_host, h))
    assert torch.equal(paged_dev.cpu(), _reference(torch.zeros_like(paged_dev), pd, flat_host, ph))


@pytest.mark.parametrize("mode", MODES)
def test_long_packed_runs_are_cut_into_pieces(monkeypatch, mode):
    monkeypatch.setattr(direct, "MAX_COPY_BYTES", 1000)  # 15 rows of 64 B per piece
    gen = torch.Generator().manual_seed(7)
    host = _bytes((4096, 64), gen=gen, pin=True)
    dev = _bytes((4096, 64), "cuda", gen)
    d, s = torch.arange(100, 2100), torch.arange(7, 2007)
    expected = _reference(dev, d, host, s)
    direct.copy_rows([(dev, host)], d, s, mode=mode)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), expected)
