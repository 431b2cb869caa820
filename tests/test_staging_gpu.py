"""page_first and page_first_direct backups through the device staging area (transfer/staging.py), on a real GPU (marked ``gpu``).

Every check compares whole host buffers bit for bit, so a page written where it should not be (or a
stale staged page) fails the test, not only a missing one. The budget is set small so that a backup
runs in several chunks and both staging buffers are reused.
"""

import zlib

import pytest
import torch

from sglang_hicache_jit import ops
from sglang_hicache_jit.transfer import route, staging

from test_host_pool import (as_bytes, device_caches, fill_random, get_host_rows, host_caches, make_device_pool,
                            make_host_pool, set_host_rows, shuffle_allocator)

pytestmark = pytest.mark.gpu

LAYERS, SLOTS = 4, 512


LAYOUTS = ("page_first", "page_first_direct")


def _pool(kind, page, *, sharded=False, gather="kernel", chunk_pages=1, seed=0, layout="page_first"):
    gen = torch.Generator().manual_seed(seed)
    dp = make_device_pool(kind, 1152, gen, device="cuda", sharded=sharded, slots=SLOTS)
    pool = make_host_pool(dp, size=1024, page_size=page, layout=layout)
    if gather == "torch":  # the gather the pool takes where the JIT kernel is unavailable
        pool.transfer_path = "direct"
    pool.staging_bytes = 2 * chunk_pages * page * pool.layer_num * pool.row_bytes * pool.num_caches
    shuffle_allocator(pool, gen)
    return gen, dp, pool


def _backup_and_check(gen, dp, pool, host, dev):
    for buf in host_caches(pool):
        fill_random(buf, gen)
    start, end = pool.owned_layers
    keep = (host.cpu() >= 0) & (dev.cpu() >= 0)  # a negative index on either side skips its pair
    kh, kd = host.cpu().long()[keep], dev.cpu().long()[keep]
    expected = [as_bytes(b).clone() for b in host_caches(pool)]
    for c, layers in enumerate(device_caches(dp)):
        for l in range(start, end):
            set_host_rows(expected[c], pool.layout, pool.page_size, l - start, kh, as_bytes(layers[l]).cpu()[kd])
    pool.backup_from_device_all_layer(dp, host, dev, "direct")
    torch.cuda.synchronize()
    ops.check_errors()
    for c, buf in enumerate(host_caches(pool)):
        assert torch.equal(as_bytes(buf), expected[c]), f"cache {c}"


def _whole_pages(pool, gen, pages):
    host = pool.alloc(pages * pool.page_size)
    dev_pages = torch.randperm(SLOTS // pool.page_size, generator=gen)[:pages]
    dev = (dev_pages[:, None] * pool.page_size + torch.arange(pool.page_size)).reshape(-1)
    return host, dev


@pytest.mark.parametrize("chunk_pages", [1, 3, 64], ids=["1-page-chunks", "3-page-chunks", "one-chunk"])
@pytest.mark.parametrize("gather", ["kernel", "torch"])
@pytest.mark.parametrize("kind", ["mla", "mha"])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_staged_backups_are_bit_exact(layout, page, kind, gather, chunk_pages):
    gen, dp, pool = _pool(kind, page, gather=gather, chunk_pages=chunk_pages, layout=layout,
                          seed=zlib.crc32(repr((layout, page, kind, gather, chunk_pages)).encode()))
    for pages, dtype, where in ((5, torch.int64, "cpu"), (7, torch.int32, "cuda"), (1, torch.int64, "cuda")):
        host, dev = _whole_pages(pool, gen, pages)
        _backup_and_check(gen, dp, pool, host.to(dtype), dev.to(dtype).to(where))
        assert pool.last_direct_mode == "staged"
        pool.free(host)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_pools_stage_their_owned_layers(layout):
    gen, dp, pool = _pool("mla", 16, sharded=True, chunk_pages=2, seed=3, layout=layout)
    host, dev = _whole_pages(pool, gen, 6)
    _backup_and_check(gen, dp, pool, host, dev.cuda())
    assert pool.last_direct_mode == "staged"


@pytest.mark.parametrize("direct_mode", [None, "batch"], ids=["one-cta-kernel", "copy-engines"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scattered_or_padded_rows_take_the_row_copies(layout, direct_mode):
    """Backups staging does not take go row by row (route.unstaged_backup_path): their copies (one 1152-B row,
    or a 16-token page of a layer) are under SMALL_COPY_BYTES, so io_backend='direct' runs them on the
    one-CTA kernel (last_direct_mode None), or on the copy engines where the pool names their submission."""
    gen, dp, pool = _pool("mla", 16, seed=4, layout=layout)
    assert pool.copy_bytes < route.SMALL_COPY_BYTES
    pool.direct_mode = direct_mode or pool.direct_mode
    host, dev = _whole_pages(pool, gen, 3)
    _backup_and_check(gen, dp, pool, host[::2], dev[::2])  # every other slot: runs of one token
    assert pool.last_direct_mode == direct_mode
    padded = dev.clone()
    padded[5] = -1  # a skipped pair: its host row must stay as it was, which a whole-page copy cannot do
    _backup_and_check(gen, dp, pool, host, padded)
    assert pool.last_direct_mode == direct_mode


@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
def test_a_staged_backup_sees_what_the_stream_wrote_before_it(side_stream):
    """The producer writes the device rows behind a long sleep on the caller's stream; the gather runs on the
    staging area's own stream and must wait for it."""
    gen, dp, pool = _pool("mla", 64, chunk_pages=2, seed=5)
    host, dev = _whole_pages(pool, gen, 8)
    dev = dev.cuda()
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    fresh = [torch.randint(0, 256, as_bytes(t).shape, dtype=torch.uint8, generator=gen).cuda()
             for t in dp.kv_buffer]
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU time before the producer's writes
        for t, new in zip(dp.kv_buffer, fresh):
            as_bytes(t).copy_(new)
        pool.backup_from_device_all_layer(dp, host, dev, "direct")
    stream.synchronize()
    assert pool.last_direct_mode == "staged"
    for l, new in enumerate(fresh):
        assert torch.equal(as_bytes(pool.kv_buffer)[host, l], new[dev].cpu()), f"layer {l}"


def test_out_of_range_indices_raise_before_anything_is_copied():
    gen, dp, pool = _pool("mla", 16, seed=6)
    host, dev = _whole_pages(pool, gen, 2)
    before = pool.kv_buffer.clone()
    bad = dev.clone()
    bad[-1] = SLOTS
    with pytest.raises(Exception, match="device_indices"):
        pool.backup_from_device_all_layer(dp, host, bad.cuda(), "direct")
    torch.cuda.synchronize()
    assert torch.equal(as_bytes(pool.kv_buffer), as_bytes(before))  # bytes: random bf16 holds NaNs


def test_a_budget_too_small_for_one_page_is_refused_by_the_staging_area():
    host = torch.empty((64, 4, 1, 576), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="holds no host block"):
        staging.PageStaging([host], budget_bytes=1024, device="cuda", device_rows=64, gather=None)


def test_a_backup_captured_into_a_cuda_graph_takes_the_row_copies_and_replays():
    """Staging reads the indices on the host, which a capture forbids: under capture the pool records the
    row copies instead, and the graph's replay backs up bit for bit."""
    gen, dp, pool = _pool("mla", 16, seed=7)
    host, dev = _whole_pages(pool, gen, 4)  # CPU indices: the copies are planned on the host during the capture
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        pool.backup_from_device_all_layer(dp, host, dev, "direct")  # warm-up outside the capture
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            pool.backup_from_device_all_layer(dp, host, dev, "direct")
    assert pool.last_direct_mode == "2d"
    for t in dp.kv_buffer:
        fill_random(t, gen)
    graph.replay()
    torch.cuda.synchronize()
    for l, t in enumerate(dp.kv_buffer):
        assert torch.equal(as_bytes(pool.kv_buffer)[host, l], as_bytes(t)[dev].cpu()), f"layer {l}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_page_first_direct_backup_of_pages_out_of_order_or_partial_takes_the_row_copies(layout):
    """Staging moves whole host blocks: page_first_direct host slots that are not whole aligned pages (a page
    cut short, or its tokens out of order) must go row by row, and still land bit for bit."""
    gen, dp, pool = _pool("mla", 16, seed=8, layout=layout)
    host, dev = _whole_pages(pool, gen, 4)
    cut = slice(0, 4 * 16 - 3)  # the last page is not whole
    _backup_and_check(gen, dp, pool, host[cut], dev[cut])
    if layout == "page_first_direct":
        assert pool.last_direct_mode != "staged"
    swapped = host.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # page 0's first two tokens out of order
    _backup_and_check(gen, dp, pool, swapped, dev)
    if layout == "page_first_direct":
        assert pool.last_direct_mode != "staged"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_threads_on_two_streams_share_one_staging_area_without_loss(layout):
    """Two threads, each on its own stream, make 10 staged backups each through the same pool (one staging
    area, chunks of one page so both buffers are reused all the time). Every host page must end up holding
    the device rows its backup named."""
    import threading

    gen, dp, pool = _pool("mla", 16, chunk_pages=1, seed=9, layout=layout)
    jobs = [[_whole_pages(pool, gen, 3) for _ in range(10)] for _ in range(2)]  # 960 of the pool's 1024 slots
    assert all(host is not None for backups in jobs for host, _ in backups)
    errors = []

    def worker(backups):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for host, dev in backups:
                    pool.backup_from_device_all_layer(dp, host, dev.cuda(), "direct")
                    assert pool.last_direct_mode == "staged"
            stream.synchronize()
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(b,)) for b in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    ops.check_errors()
    assert not errors, errors
    for backups in jobs:
        for host, dev in backups:
            for l, layer in enumerate(dp.kv_buffer):
                got = get_host_rows(as_bytes(pool.kv_buffer), pool.layout, pool.page_size, l, host)
                assert torch.equal(got, as_bytes(layer)[dev].cpu()), f"layer {l}"

