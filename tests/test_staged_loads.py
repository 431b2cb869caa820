"""Group loads through the staging area (transfer/staged_loads.py) on the CPU: every token's rows of exactly the
group's layers land in their device slots, bit for bit; every other layer and slot keeps its bytes; the same
inputs are declined or refused as a staged backup's; and loads share the area with backups without either one
seeing the other's bytes.

The area runs with ``device="cpu"`` (its copies through direct.py's CPU path, the scatter by torch indexing);
only the torch.cuda stream, event and capture queries staging makes are stubbed."""

from __future__ import annotations

import pytest
import torch

from sglang_hicache_jit.errors import TransferIndexError
from sglang_hicache_jit.transfer import staging
from sglang_hicache_jit.transfer.staged_loads import GroupLoads

LAYERS, ROW, DEVICE_ROWS, CHUNK_BLOCKS = 6, 5, 512, 4


pytestmark = pytest.mark.usefixtures("cpu_streams")


def _random(shape, seed):
    return torch.randint(-(1 << 30), 1 << 30, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def _setup(page: int, caches: int = 2, slots_per_page: int = 128):
    slots = slots_per_page * page
    shape = (slots, LAYERS, ROW) if page == 1 else (slots // page, LAYERS, page, ROW)
    hosts = [_random(shape, 10 + c) for c in range(caches)]
    device = [[_random((DEVICE_ROWS, ROW), 100 * c + l) for l in range(LAYERS)] for c in range(caches)]
    block_bytes = LAYERS * page * ROW * 4 * caches
    area = staging.PageStaging(hosts, budget_bytes=2 * CHUNK_BLOCKS * block_bytes, device="cpu",
                               device_rows=DEVICE_ROWS, gather=staging.torch_gather(device), page_size=page)
    return area, hosts, device, GroupLoads(area, device)


def _host_row(host, page, slot, layer):
    return host[slot, layer] if page == 1 else host[slot // page, layer, slot % page]


def _expected(hosts, device, page, host_idx, device_idx, first, count):
    out = [[t.clone() for t in layers] for layers in device]
    for h, d in zip(host_idx.tolist(), device_idx.tolist()):
        for c, host in enumerate(hosts):
            for layer in range(first, first + count):
                out[c][layer][d] = _host_row(host, page, h, layer)
    return out


def _pages(page, starts):
    return torch.cat([torch.arange(s * page, (s + 1) * page) for s in starts])


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("group", [(0, LAYERS), (0, 1), (2, 3), (4, 2), (5, 1)])
@pytest.mark.parametrize("case", ["one-run", "runs-out-of-order", "several-chunks"])
def test_a_group_load_lands_bit_for_bit_in_its_layers_only(staging_planner, page, group, case):
    area, hosts, device, loads = _setup(page)
    first, count = group
    if case == "one-run":
        blocks = list(range(5, 5 + staging.MIN_RUN + 2))
    elif case == "runs-out-of-order":
        blocks = list(range(90, 110)) + list(range(3, 20)) + list(range(40, 64))
    else:  # more blocks than both buffers hold, for any group size: the chunks alternate buffers
        blocks = list(range(7, 7 + 2 * CHUNK_BLOCKS * LAYERS + 5))
    host_idx = torch.tensor(blocks) if page == 1 else _pages(page, blocks)
    device_idx = torch.randperm(DEVICE_ROWS, generator=torch.Generator().manual_seed(len(blocks)))[:len(host_idx)]
    expected = _expected(hosts, device, page, host_idx, device_idx, first, count)
    assert loads.load(host_idx, device_idx, first, count) is True
    for c in range(len(hosts)):
        for layer in range(LAYERS):
            assert torch.equal(device[c][layer], expected[c][layer]), (c, layer)


@pytest.mark.parametrize("page", [1, 4])
def test_a_group_load_declines_and_refuses_what_a_staged_backup_does(staging_planner, page):
    area, hosts, device, loads = _setup(page)
    before = [[t.clone() for t in layers] for layers in device]
    slots = hosts[0].shape[0] * (1 if page == 1 else page)
    run, dev = torch.arange(0, 16 * page), torch.arange(16 * page)
    padded = run.clone()
    padded[3] = -1
    assert loads.load(padded, dev, 0, 2) is False
    negative_device = dev.clone()
    negative_device[0] = -1
    assert loads.load(run, negative_device, 0, 2) is False
    with pytest.raises(TransferIndexError, match=f"host_indices holds index {slots}"):
        loads.load(torch.arange(slots - 16 * page + 1, slots + 1), dev, 0, 2)
    with pytest.raises(TransferIndexError, match=f"device_indices holds index {DEVICE_ROWS}"):
        loads.load(run, torch.arange(DEVICE_ROWS - 16 * page + 1, DEVICE_ROWS + 1), 0, 2)
    for bad in ((0, 0), (-1, 2), (5, 2), (0, LAYERS + 1)):
        with pytest.raises(ValueError, match="not a range of the host buffer"):
            loads.load(run, dev, *bad)
    assert all(torch.equal(a, b) for la, lb in zip(device, before) for a, b in zip(la, lb))
    assert loads.load(run[:0], dev[:0], 0, 2) is True


def test_loads_and_backups_share_the_area_without_mixing_their_bytes():
    """A backup, a group load, a backup of other slots and another group load through one area, in turn: each
    lands exactly (the staging buffers hold the previous operation's bytes each time)."""
    area, hosts, device, loads = _setup(1)
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        host_idx = torch.arange(20 * step, 20 * step + 4 * CHUNK_BLOCKS + 1)  # several chunks, and MIN_RUN
        device_idx = torch.randperm(DEVICE_ROWS, generator=gen)[:len(host_idx)]
        if step % 2 == 0:
            expected = [h.clone() for h in hosts]
            for h, d in zip(host_idx.tolist(), device_idx.tolist()):
                for c in range(2):
                    for layer in range(LAYERS):
                        expected[c][h, layer] = device[c][layer][d]
            assert area.backup(host_idx, device_idx) is True
            assert all(torch.equal(a, b) for a, b in zip(hosts, expected))
        else:
            expected = _expected(hosts, device, 1, host_idx, device_idx, 1, 4)
            assert loads.load(host_idx, device_idx, 1, 4) is True
            assert all(torch.equal(a, b) for la, lb in zip(device, expected) for a, b in zip(la, lb))


def test_device_layers_must_match_the_host_buffer():
    area, hosts, device, _ = _setup(1)
    with pytest.raises(ValueError, match="one list of layers per cache"):
        GroupLoads(area, device[:1])
    with pytest.raises(ValueError, match="6 layers per cache"):
        GroupLoads(area, [layers[:-1] for layers in device])


# ---------------------------------------------------------------------------
# A host pool's load_to_device_per_layer with load_group (HostKVPool, transfer/host_pool.py).

def _pool(kind: str, layout: str, page: int, *, sharded: bool = False, seed: int = 0):
    from test_host_pool import fill_random, host_caches, make_device_pool, make_host_pool

    gen = torch.Generator().manual_seed(seed)
    device_pool = make_device_pool(kind, 1152 if kind == "mla" else 656, gen, sharded=sharded, layers=6)
    pool = make_host_pool(device_pool, size=1024, page_size=page, layout=layout)
    for buf in host_caches(pool):
        fill_random(buf, gen)
    pool._stages = lambda: True  # a CPU pool is never pinned, so it never stages: here it must
    pool.staging_bytes = 2 * 8 * page * pool.layer_num * pool.row_bytes * pool.num_caches  # 8 pages a buffer
    return gen, device_pool, pool


def _expected_layer(pool, device_pool, host_idx, device_idx, layer):
    from test_host_pool import device_caches, get_host_rows, host_caches

    start = pool.owned_layers[0]
    out = []
    for cache, buf in zip(device_caches(device_pool), host_caches(pool)):
        want = cache[layer].clone()
        want[device_idx] = get_host_rows(buf, pool.layout, pool.page_size, layer - start, host_idx)
        out.append(want)
    return out


@pytest.mark.parametrize("kind", ["mla", "mha"])
@pytest.mark.parametrize("layout, page", [("page_first", 16), ("page_first_direct", 16)])
@pytest.mark.parametrize("group", [2, 3, 6])
@pytest.mark.parametrize("sharded", [False, True])
def test_a_pool_loads_layer_by_layer_through_group_loads_bit_for_bit(kind, layout, page, group, sharded):
    """SGLang's loop (every owned layer in order, the same indices): each layer lands exactly, the group's
    first layer loads the group, and the others move nothing themselves."""
    from test_host_pool import device_caches

    gen, device_pool, pool = _pool(kind, layout, page, sharded=sharded, seed=group)
    pool.load_group = group
    host_idx = pool.alloc(20 * page)
    device_idx = torch.randperm(384, generator=gen)[:host_idx.numel()]
    start, end = pool.owned_layers
    expected = {layer: _expected_layer(pool, device_pool, host_idx, device_idx, layer) for layer in range(start, end)}
    ran = []
    for layer in range(6):
        pool.load_to_device_per_layer(device_pool, host_idx, device_idx, layer, "direct")
        ran.append(pool.last_direct_mode)
    for layer in range(start, end):
        for cache, want in zip(device_caches(device_pool), expected[layer]):
            assert torch.equal(cache[layer].view(torch.uint8), want.view(torch.uint8)), layer
    assert set(ran[start:end]) == {"staged"}
    # The later layers' calls order the caller's stream after the group's event on the staging area's device.
    assert pool._group_loaded.last.device == torch.device("cpu")


def test_a_later_layer_with_other_indices_or_changed_ones_is_loaded_alone():
    """The group load covers a later layer only for indices of the same values: indices changed in place
    since (no version bump needed) or other ones make that layer load by itself, from the host as it is now."""
    from test_host_pool import device_caches, fill_random, host_caches

    gen, device_pool, pool = _pool("mla", "page_first", 16, seed=5)
    pool.load_group = 3
    host_idx = pool.alloc(20 * 16)
    device_idx = torch.randperm(384, generator=gen)[:host_idx.numel()]
    pool.load_to_device_per_layer(device_pool, host_idx, device_idx, 0, "direct")
    device_idx.data[:16] = torch.randperm(384, generator=gen)[:16]  # in place, behind torch's version counter
    fill_random(host_caches(pool)[0], gen)  # the host changed too: layer 1 must read it now
    expected = _expected_layer(pool, device_pool, host_idx, device_idx, 1)
    pool.load_to_device_per_layer(device_pool, host_idx, device_idx, 1, "direct")
    assert pool.last_direct_mode != "staged"
    assert torch.equal(device_caches(device_pool)[0][1].view(torch.uint8), expected[0].view(torch.uint8))


def test_a_later_layer_without_its_group_load_is_loaded_alone():
    from test_host_pool import device_caches

    gen, device_pool, pool = _pool("mla", "page_first", 16, seed=6)
    pool.load_group = 3
    host_idx = pool.alloc(20 * 16)
    device_idx = torch.randperm(384, generator=gen)[:host_idx.numel()]
    expected = _expected_layer(pool, device_pool, host_idx, device_idx, 4)
    pool.load_to_device_per_layer(device_pool, host_idx, device_idx, 4, "direct")  # group 3-5, never loaded
    assert pool.last_direct_mode != "staged"
    assert torch.equal(device_caches(device_pool)[0][4].view(torch.uint8), expected[0].view(torch.uint8))
