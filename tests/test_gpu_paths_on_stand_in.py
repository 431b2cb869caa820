"""The GPU paths of the staging area, run on the stand-in device (tests/fake_gpu.py) with a launcher and copy
engines that really copy (``fake_gpu.Copier``, ``stub_copy_engines(perform=True)``): CPU memory dressed as
cuda:0 and as pinned memory, the kernel's contract done row by row in Python, the copy descriptors carried
out as 2-D copies. So what only a GPU ran before is checked bit for bit here: the pointer tables and layer
tables the staging area builds, its views, staged rows and copy descriptors, for

* SGLang's staged write-back through the routed op (``transfer_hicache_all_layer_staged_lf_pf``), MHA and
  MLA, every chunk through both buffers.

Every check compares whole buffers, so a row written where it should not be fails the test. The GPU tests
(tests/test_staging_gpu.py) remain the proof on hardware; these catch a
wrong address before a GPU is at hand."""

from __future__ import annotations

import pytest
import torch

import fake_gpu
from sglang_hicache_jit import ops
from sglang_hicache_jit.integrations.sglang import ops as routed
from sglang_hicache_jit.transfer import extents, launcher, pointer_tables, route

LAYERS, PAGE, DEVICE_SLOTS = 4, 16, 512


@pytest.fixture
def stand_in():
    """The stand-in device with a copying launcher and copying copy engines, for one test."""
    copier = fake_gpu.Copier()
    saved = dict(launcher._states)
    with (fake_gpu.stub_cuda_runtime(ops), fake_gpu.stub_uploads(), fake_gpu.stub_streams(),
          fake_gpu.stub_device_tensors(), fake_gpu.stub_copy_engines(perform=True) as engines):
        state = fake_gpu.install(ops, handle=fake_gpu.noop_library())
        state._launch_c = copier
        try:
            yield copier, engines
        finally:
            launcher._states.clear()
            launcher._states.update(saved)
            pointer_tables.clear()
            routed._stagings.clear()
            route.reset()


def _random(shape, seed, dtype=torch.bfloat16):
    bits = torch.randint(-(1 << 15), 1 << 15, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int16)
    return bits.view(dtype)


def _bits(t):
    return t.view(torch.int16)


@pytest.mark.parametrize("caches", [1, 2], ids=["mla", "mha"])
@pytest.mark.parametrize("tokens", [16, 96, 192])
def test_sglangs_staged_write_back_lands_bit_for_bit(stand_in, caches, tokens):
    copier, engines = stand_in
    heads, dim = (1, 64) if caches == 1 else (2, 32)
    row_bytes = heads * dim * 2
    route._verdicts[row_bytes] = True
    device = [[fake_gpu.cuda(_random((DEVICE_SLOTS, heads, dim), 10 * c + l)) for l in range(LAYERS)]
              for c in range(caches)]
    for layers in device:
        for t in layers:
            extents.register(t)
    tables = [fake_gpu.cuda(torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)) for layers in device]
    host = fake_gpu.pinned(_random((caches, 1024, LAYERS, heads, dim), 99))
    before = host.clone()
    # SGLang's staging buffers: 4 pages of every layer per cache, so 32-token halves and several chunks.
    memory = [fake_gpu.cuda(torch.zeros(4 * PAGE, LAYERS, heads, dim, dtype=torch.bfloat16)) for _ in range(caches)]
    for m in memory:
        extents.register(m)
    gen = torch.Generator().manual_seed(tokens)
    pages = torch.randperm(1024 // PAGE, generator=gen)[:-(-tokens // PAGE)]
    host_idx = (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:tokens]
    device_idx = fake_gpu.cuda(torch.randperm(DEVICE_SLOTS, generator=gen)[:tokens])
    route_min = route.WRITE_BACK_MIN_CHUNK_TOKENS
    route.WRITE_BACK_MIN_CHUNK_TOKENS = 16  # SGLang's buffers here are small; the rule is tested elsewhere
    try:
        if caches == 2:
            routed.transfer_hicache_all_layer_staged_lf_pf(
                k_ptr_src=tables[0], v_ptr_src=tables[1], src_indices=device_idx, dst_indices=host_idx,
                staging_k=memory[0], staging_v=memory[1], dst_k=fake_gpu.pinned(host[0]),
                dst_v=fake_gpu.pinned(host[1]), page_size=PAGE)
        else:
            routed.transfer_hicache_all_layer_mla_staged_lf_pf(
                ptr_src=tables[0], src_indices=device_idx, dst_indices=host_idx, staging=memory[0],
                dst=fake_gpu.pinned(host[0]), page_size=PAGE)
    finally:
        route.WRITE_BACK_MIN_CHUNK_TOKENS = route_min
    assert routed._stagings and copier.calls and engines.copies, "the write-back did not go through the staging area"
    ops.check_errors(synchronize=False)
    expected = before.clone()
    for c in range(caches):
        for layer in range(LAYERS):
            expected[c][host_idx, layer] = device[c][layer][device_idx.as_subclass(torch.Tensor)]
    assert torch.equal(_bits(host.as_subclass(torch.Tensor)), _bits(expected))
