"""Group loads through the staging area (transfer/staged_loads.py) on a real GPU (marked ``gpu``): pinned
page_first and page_first_direct host buffers, device layers with guard slots, the kernel's scatter. Each check
compares whole device layers bit for bit, so a row written to the wrong slot or layer fails the test, not only a
missing one. The staging budget is small, so a load runs in several chunks through both buffers."""

from __future__ import annotations

import pytest
import torch

from sglang_hicache_jit import ops
from sglang_hicache_jit.errors import TransferIndexError
from sglang_hicache_jit.transfer import staging
from sglang_hicache_jit.transfer.staged_loads import GroupLoads

pytestmark = pytest.mark.gpu

LAYERS, HEADS, DIM, DEVICE_SLOTS = 8, 2, 64, 4096


def _random(shape, gen, **kwargs):
    t = torch.randint(-(1 << 15), 1 << 15, shape, generator=gen, dtype=torch.int16).view(torch.bfloat16)
    return t.to(**kwargs) if kwargs else t


def _setup(page: int, chunk_blocks: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    slots = 256 * page
    shape = (slots, LAYERS, HEADS, DIM) if page == 1 else (slots // page, LAYERS, page, HEADS, DIM)
    hosts = [_random(shape, gen).pin_memory() for _ in range(2)]
    device = [[_random((DEVICE_SLOTS, HEADS, DIM), gen, device="cuda") for _ in range(LAYERS)] for _ in range(2)]
    block_bytes = LAYERS * page * HEADS * DIM * 2 * 2
    area = staging.PageStaging(hosts, budget_bytes=2 * chunk_blocks * block_bytes, device="cuda",
                               device_rows=DEVICE_SLOTS, gather=staging.torch_gather(device), page_size=page)
    return gen, hosts, device, area, GroupLoads(area, device)


def _host_rows(host, page, slots, layer):
    if page == 1:
        return host[slots, layer]
    return host[slots // page, layer, slots % page]


@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("group", [(0, LAYERS), (0, 1), (3, 2), (4, 4)])
@pytest.mark.parametrize("indices_on", ["cpu", "cuda"])
def test_group_loads_land_bit_for_bit_in_their_layers_only(page, group, indices_on):
    gen, hosts, device, area, loads = _setup(page, chunk_blocks=3 if page > 1 else 96, seed=page + group[1])
    first, count = group
    # Runs of 16 tokens (page_first) or whole pages (page_first_direct), in random order: several runs and chunks.
    run = 16 if page == 1 else page
    starts = torch.randperm(256 * page // run, generator=gen)[:12] * run
    host_idx = (starts[:, None] + torch.arange(run)).reshape(-1)
    device_idx = torch.randperm(DEVICE_SLOTS, generator=gen)[:host_idx.numel()]
    before = [[t.clone() for t in layers] for layers in device]
    expected = [[t.clone() for t in layers] for layers in device]
    for c in range(2):
        for layer in range(first, first + count):
            expected[c][layer][device_idx.cuda()] = _host_rows(hosts[c], page, host_idx, layer).cuda()
    dev_idx = device_idx.to(indices_on)
    assert loads.load(host_idx, dev_idx, first, count) is True
    torch.cuda.synchronize()
    ops.check_errors()
    for c in range(2):
        for layer in range(LAYERS):
            want = expected[c][layer] if first <= layer < first + count else before[c][layer]
            assert torch.equal(device[c][layer].view(torch.int16), want.view(torch.int16)), (c, layer)


def test_a_gpu_device_index_past_the_pool_is_skipped_and_reported():
    gen, hosts, device, area, loads = _setup(1, chunk_blocks=64, seed=7)
    host_idx = torch.arange(10, 42)
    device_idx = torch.arange(100, 132, device="cuda")
    device_idx[5] = DEVICE_SLOTS  # one past the pool
    before = [t.clone() for t in device[0]]
    assert loads.load(host_idx, device_idx, 0, LAYERS) is True
    with pytest.raises(TransferIndexError):
        torch.cuda.synchronize()
        ops.check_errors()
    for layer in range(LAYERS):  # the other 31 rows landed; nothing outside them changed
        want = before[layer].clone()
        keep = torch.ones(32, dtype=torch.bool)
        keep[5] = False
        want[device_idx[keep.cuda()]] = hosts[0][host_idx[keep], layer].cuda()
        assert torch.equal(device[0][layer].view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("kind", ["mla", "mha"])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("group", [2, 4])
def test_a_pinned_pool_loads_layer_by_layer_through_group_loads(kind, layout, group):
    """A pool with load_group, called as SGLang's loop calls it (every layer in order, the same CPU indices,
    the calls on one stream): every layer lands exactly, through the staging area."""
    from test_host_pool import device_caches, fill_random, get_host_rows, host_caches, make_device_pool, make_host_pool

    gen = torch.Generator().manual_seed(group)
    device_pool = make_device_pool(kind, 1152, gen, device="cuda", slots=DEVICE_SLOTS)
    pool = make_host_pool(device_pool, size=4096, page_size=64, layout=layout)
    for buf in host_caches(pool):
        fill_random(buf, gen)
    pool.staging_bytes = 2 * 4 * 64 * pool.layer_num * pool.row_bytes * pool.num_caches  # 4 pages a buffer
    pool.load_group = group
    host_idx = pool.alloc(24 * 64)
    device_idx = torch.randperm(DEVICE_SLOTS, generator=gen)[:host_idx.numel()]
    expected = []
    for layer in range(pool.layer_num):
        expected.append([])
        for cache, buf in zip(device_caches(device_pool), host_caches(pool)):
            want = cache[layer].clone()
            want[device_idx.cuda()] = get_host_rows(buf, layout, 64, layer, host_idx).cuda()
            expected[-1].append(want)
    for layer in range(pool.layer_num):
        pool.load_to_device_per_layer(device_pool, host_idx, device_idx, layer, "direct")
        assert pool.last_direct_mode == "staged"
    torch.cuda.synchronize()
    ops.check_errors()
    for layer in range(pool.layer_num):
        for cache, want in zip(device_caches(device_pool), expected[layer]):
            assert torch.equal(cache[layer].view(torch.uint8), want.view(torch.uint8)), layer
