"""Group loads through the staging area (transfer/staged_loads.py) on the CPU: every token's rows of exactly the
group's layers land in their device slots, bit for bit; every other layer and slot keeps its bytes; the same
inputs are declined or refused as a staged backup's; and loads share the area with backups without either one
seeing the other's bytes.

The area runs with ``device="cpu"`` (its copies through direct.py's CPU path, the scatter by torch indexing);
only the torch.cuda stream, event and capture queries staging makes are stubbed."""

from __future__ import annotations

import pytest
import torch

import fake_gpu
from sglang_hicache_jit.errors import TransferIndexError
from sglang_hicache_jit.transfer import staging
from sglang_hicache_jit.transfer.staged_loads import GroupLoads

LAYERS, ROW, DEVICE_ROWS, CHUNK_BLOCKS = 6, 5, 512, 4


@pytest.fixture(autouse=True)
def cpu_streams():
    with fake_gpu.stub_streams():
        yield


@pytest.fixture(params=["ints", "tensors"])
def planner(request, monkeypatch):
    if request.param == "tensors":
        monkeypatch.setattr(staging, "SMALL_BACKUP_TOKENS", 0)
    return request.param


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
def test_a_group_load_lands_bit_for_bit_in_its_layers_only(planner, page, group, case):
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
def test_a_group_load_declines_and_refuses_what_a_staged_backup_does(planner, page):
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
