"""PageStaging.backup on the CPU (transfer/staging.py): a backup of up to SMALL_BACKUP_TOKENS host indices
reads and plans them as Python ints, a larger one with tensor ops. Both must land every token's rows of every
layer in its host slot, bit for bit, write nothing else, and refuse or decline the same inputs.

The area runs with ``device="cpu"`` (its gathers through staging.torch_gather, its copies through direct.py's
CPU path); only the torch.cuda stream, event and capture queries it makes are stubbed."""

from __future__ import annotations

import pytest
import torch

from sglang_hicache_jit.errors import TransferIndexError
from sglang_hicache_jit.transfer import staging

LAYERS, ROW, DEVICE_ROWS, CHUNK_BLOCKS = 3, 6, 512, 8


pytestmark = pytest.mark.usefixtures("cpu_streams")


def _area(page: int, slots: int):
    gen = torch.Generator().manual_seed(page * 1000 + slots)
    layers = [torch.randint(-(1 << 30), 1 << 30, (DEVICE_ROWS, ROW), generator=gen, dtype=torch.int32)
              for _ in range(LAYERS)]
    shape = (slots, LAYERS, ROW) if page == 1 else (slots // page, LAYERS, page, ROW)
    host = torch.randint(-(1 << 30), 1 << 30, shape, generator=gen, dtype=torch.int32)  # old bytes: never zeros
    block_bytes = LAYERS * page * ROW * host.element_size()
    area = staging.PageStaging([host], budget_bytes=2 * CHUNK_BLOCKS * block_bytes, device="cpu",
                               device_rows=DEVICE_ROWS, gather=staging.torch_gather([layers]), page_size=page)
    return area, host, layers


def _expected(host: torch.Tensor, layers: list, page: int, host_idx, device_idx) -> torch.Tensor:
    out = host.clone()
    for h, d in zip(host_idx.tolist(), device_idx.tolist()):
        for layer in range(LAYERS):
            if page == 1:
                out[h, layer] = layers[layer][d]
            else:
                out[h // page, layer, h % page] = layers[layer][d]
    return out


def _pages(page: int, starts: list) -> torch.Tensor:
    return torch.cat([torch.arange(s * page, (s + 1) * page) for s in starts])


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("case", ["one-run", "runs-out-of-order", "several-chunks"])
def test_a_backup_lands_bit_for_bit_and_nowhere_else(staging_planner, page, case):
    slots = 128 * page
    area, host, layers = _area(page, slots)
    # page_first stages runs of at least staging.MIN_RUN tokens on average (a block is a token there).
    if case == "one-run":
        blocks = list(range(5, 5 + staging.MIN_RUN + 3))
    elif case == "runs-out-of-order":
        blocks = list(range(90, 110)) + list(range(3, 20)) + list(range(40, 64))
    else:  # more blocks than both buffers: the chunks go through buffers 0, 1, 0, ...
        blocks = list(range(10, 10 + 5 * CHUNK_BLOCKS + 3))
    host_idx = torch.tensor(blocks) if page == 1 else _pages(page, blocks)
    device_idx = torch.randperm(DEVICE_ROWS, generator=torch.Generator().manual_seed(len(blocks)))[:len(host_idx)]
    expected = _expected(host, layers, page, host_idx, device_idx)
    assert area.backup(host_idx, device_idx) is True
    assert torch.equal(host, expected)


@pytest.mark.parametrize("page", [1, 4])
def test_both_planners_decline_and_refuse_the_same_inputs(staging_planner, page):
    slots = 64 * page
    area, host, _ = _area(page, slots)
    before = host.clone()
    run = torch.arange(0, 16 * page)
    dev = torch.arange(16 * page)
    with_padding = run.clone()
    with_padding[3] = -1
    assert area.backup(with_padding, dev) is False  # a negative host slot skips its pair: rows one by one
    scattered = torch.arange(0, 32 * page, 2) if page == 1 else torch.arange(0, 16 * page)[torch.randperm(16 * page)]
    assert area.backup(scattered, dev) is False  # runs too short (page_first) or not whole pages (direct)
    negative_device = dev.clone()
    negative_device[0] = -1
    assert area.backup(run, negative_device) is False  # a negative device index on the CPU skips its pair
    with pytest.raises(TransferIndexError, match=f"host_indices holds index {slots}"):
        area.backup(torch.arange(slots - 16 * page + 1, slots + 1), dev)
    with pytest.raises(TransferIndexError, match=f"device_indices holds index {DEVICE_ROWS}"):
        area.backup(run, torch.arange(DEVICE_ROWS - 16 * page + 1, DEVICE_ROWS + 1))
    assert torch.equal(host, before)  # nothing was written by any of them
    assert area.backup(run[:0], dev[:0]) is True  # nothing to copy
