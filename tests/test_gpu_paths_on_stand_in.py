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
from sglang_hicache_jit.transfer import extents, route

LAYERS, PAGE, DEVICE_SLOTS = 4, 16, 512


@pytest.mark.parametrize("caches", [1, 2], ids=["mla", "mha"])
@pytest.mark.parametrize("tokens", [16, 96, 192])
def test_sglangs_staged_write_back_lands_bit_for_bit(copying_stand_in, caches, tokens):
    copier, engines = copying_stand_in
    heads, dim = (1, 64) if caches == 1 else (2, 32)
    row_bytes = heads * dim * 2
    route._verdicts[row_bytes] = True
    device = [[fake_gpu.cuda(fake_gpu.random_bits((DEVICE_SLOTS, heads, dim), 10 * c + l)) for l in range(LAYERS)]
              for c in range(caches)]
    for layers in device:
        for t in layers:
            extents.register(t)
    tables = [fake_gpu.cuda(torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)) for layers in device]
    host = fake_gpu.pinned(fake_gpu.random_bits((caches, 1024, LAYERS, heads, dim), 99))
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
    assert torch.equal(fake_gpu.int16_bits(host.as_subclass(torch.Tensor)), fake_gpu.int16_bits(expected))


# ---------------------------------------------------------------------------
# The routed ops SGLang's pools call most, on the kernel's path (GPU indices, as the 'kernel' backend passes
# them), through the copying launcher.

def _tokens(pages, page=PAGE):
    return (pages[:, None] * page + torch.arange(page)).reshape(-1)


def _pick(n, total, seed):
    return torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:n]


def _table(tensors):
    return fake_gpu.cuda(torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64))


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_one_layer_loads_of_an_mha_pool_land_bit_for_bit(copying_stand_in, layout):
    """SGLang 0.5.17+'s MHA load: transfer_hicache_one_layer with per-layer views of the host buffer (a strided
    view of page_first, a plain layer of layer_first), device slots and host slots on the GPU."""
    copier, _ = copying_stand_in
    heads, dim, host_slots = 2, 64, 40 * PAGE
    route._verdicts[heads * dim * 2] = True
    shape = (2, host_slots, LAYERS, heads, dim) if layout == "page_first" else (2, LAYERS, host_slots, heads, dim)
    host = fake_gpu.pinned(fake_gpu.random_bits(shape, 3))
    layers = [(host[0][:, l], host[1][:, l]) if layout == "page_first" else (host[0][l], host[1][l])
              for l in range(LAYERS)]
    dev = [(fake_gpu.cuda(fake_gpu.random_bits((DEVICE_SLOTS, heads, dim), 20 + l)),
            fake_gpu.cuda(fake_gpu.random_bits((DEVICE_SLOTS, heads, dim), 40 + l))) for l in range(LAYERS)]
    h, d = _tokens(_pick(6, 40, 1)), _tokens(_pick(6, DEVICE_SLOTS // PAGE, 2))
    plain = lambda t: t.as_subclass(torch.Tensor)  # noqa: E731
    before = [(plain(k).clone(), plain(v).clone()) for k, v in dev]
    for l in range(LAYERS):
        routed.transfer_hicache_one_layer(k_cache_dst=dev[l][0], v_cache_dst=dev[l][1], indices_dst=fake_gpu.cuda(d),
                                          k_cache_src=layers[l][0], v_cache_src=layers[l][1],
                                          indices_src=fake_gpu.cuda(h), element_dim=heads * dim)
    ops.check_errors(synchronize=False)
    assert len(copier.calls) == LAYERS
    for l in range(LAYERS):
        for c in range(2):
            want = before[l][c].clone()
            want[d] = plain(layers[l][c])[h]
            assert torch.equal(fake_gpu.int16_bits(plain(dev[l][c])), fake_gpu.int16_bits(want)), (l, c)


def test_all_layer_backups_through_pointer_tables_land_bit_for_bit(copying_stand_in):
    """SGLang's layer_first MHA backup: transfer_hicache_all_layer from the device pool's tables to the host
    pool's, with the buffers registered as the plugin registers a pool's."""
    copier, _ = copying_stand_in
    heads, dim, host_slots = 2, 64, 40 * PAGE
    row = heads * dim * 2
    route._verdicts[row] = True
    dev_k = [fake_gpu.cuda(fake_gpu.random_bits((DEVICE_SLOTS, heads, dim), 60 + l)) for l in range(LAYERS)]
    dev_v = [fake_gpu.cuda(fake_gpu.random_bits((DEVICE_SLOTS, heads, dim), 80 + l)) for l in range(LAYERS)]
    host = fake_gpu.pinned(fake_gpu.random_bits((2, LAYERS, host_slots, heads, dim), 5))
    host_layers = [[host[c][l] for l in range(LAYERS)] for c in range(2)]
    for t in [*dev_k, *dev_v, *host_layers[0], *host_layers[1]]:
        extents.register(t)
    plain = lambda t: t.as_subclass(torch.Tensor)  # noqa: E731
    before = plain(host).clone()
    h, d = _tokens(_pick(5, 40, 3)), _tokens(_pick(5, DEVICE_SLOTS // PAGE, 4))
    routed.transfer_hicache_all_layer(_table(host_layers[0]), _table(host_layers[1]), fake_gpu.cuda(h),
                                      _table(dev_k), _table(dev_v), fake_gpu.cuda(d), kv_cache_src_stride_bytes=row,
                                      kv_cache_dst_stride_bytes=row, element_size=row)
    ops.check_errors(synchronize=False)
    assert len(copier.calls) == 1  # one launch for every layer and both caches
    for l in range(LAYERS):
        before[0, l, h] = plain(dev_k[l])[d]
        before[1, l, h] = plain(dev_v[l])[d]
    assert torch.equal(fake_gpu.int16_bits(plain(host)), fake_gpu.int16_bits(before))


@pytest.mark.parametrize("caches", [1, 2], ids=["mla", "mha"])
def test_sgl_kernels_page_first_ops_land_bit_for_bit(copying_stand_in, caches):
    """sgl-kernel's names as releases before the JIT ops call them: a page_first load of one layer from the
    whole host buffer (transfer_kv_per_layer[_mla]_pf_lf) and a backup of every layer into it through the
    device pool's pointer tables (transfer_kv_all_layer[_mla]_lf_pf), host indices on the GPU."""
    copier, engines = copying_stand_in
    heads, dim, host_slots = 1, 64, 40 * PAGE
    row = heads * dim * 2
    route._verdicts[row] = True
    host = [fake_gpu.pinned(fake_gpu.random_bits((host_slots, LAYERS, heads, dim), 7 + c)) for c in range(caches)]
    dev = [[fake_gpu.cuda(fake_gpu.random_bits((DEVICE_SLOTS, heads, dim), 100 + 10 * c + l)) for l in range(LAYERS)]
           for c in range(caches)]
    for layers in dev:
        for t in layers:
            extents.register(t)
    plain = lambda t: t.as_subclass(torch.Tensor)  # noqa: E731
    h, d = _tokens(_pick(6, 40, 5)), _tokens(_pick(6, DEVICE_SLOTS // PAGE, 6))
    # A load of layer 2.
    before = [plain(layers[2]).clone() for layers in dev]
    if caches == 2:
        routed.transfer_kv_per_layer_pf_lf(host[0], dev[0][2], host[1], dev[1][2], fake_gpu.cuda(h), fake_gpu.cuda(d),
                                           2, row, LAYERS * row)
    else:
        routed.transfer_kv_per_layer_mla_pf_lf(host[0], dev[0][2], fake_gpu.cuda(h), fake_gpu.cuda(d), 2, row,
                                               LAYERS * row)
    ops.check_errors(synchronize=False)
    for c in range(caches):
        before[c][d] = plain(host[c])[h, 2]
        assert torch.equal(fake_gpu.int16_bits(plain(dev[c][2])), fake_gpu.int16_bits(before[c])), c
    # A backup of every layer into other host slots.
    h2 = _tokens(_pick(6, 40, 7))
    wants = [plain(buf).clone() for buf in host]
    if caches == 2:
        routed.transfer_kv_all_layer_lf_pf(_table(dev[0]), host[0], _table(dev[1]), host[1], fake_gpu.cuda(d),
                                           fake_gpu.cuda(h2), row, LAYERS * row, LAYERS)
    else:
        routed.transfer_kv_all_layer_mla_lf_pf(_table(dev[0]), host[0], fake_gpu.cuda(d), fake_gpu.cuda(h2), row,
                                               LAYERS * row, LAYERS)
    ops.check_errors(synchronize=False)
    for c in range(caches):
        for l in range(LAYERS):
            wants[c][h2, l] = plain(dev[c][l])[d]
        assert torch.equal(fake_gpu.int16_bits(plain(host[c])), fake_gpu.int16_bits(wants[c])), c
    assert len(copier.calls) == 2 and not engines.copies  # the kernel, once each way


def test_page_unified_round_trips_land_bit_for_bit(copying_stand_in):
    """compat's page_unified layouts (SGLang's unified host pages), MHA (page, head group, layer, K/V, page
    tokens, heads, dim) and MLA (page, layer, page tokens, dim): a staged backup of whole pages, then one layer
    loaded back into other device slots. Their host tables come from layout.layer_offsets and the one-layer
    loads' rows from layout.page_first_direct_map."""
    from sglang_hicache_jit.integrations import compat

    copier, _ = copying_stand_in
    plain = lambda t: t.as_subclass(torch.Tensor)  # noqa: E731
    host_pages, dev_pages = 40, DEVICE_SLOTS // PAGE
    groups, heads_in_group, dim = 2, 2, 32
    heads = groups * heads_in_group
    dev_k = [fake_gpu.cuda(fake_gpu.random_bits((DEVICE_SLOTS, heads, dim), 200 + l)) for l in range(LAYERS)]
    dev_v = [fake_gpu.cuda(fake_gpu.random_bits((DEVICE_SLOTS, heads, dim), 220 + l)) for l in range(LAYERS)]
    for t in [*dev_k, *dev_v]:
        extents.register(t)
    host = fake_gpu.pinned(fake_gpu.random_bits((host_pages, groups, LAYERS, 2, PAGE, heads_in_group, dim), 11))
    extents.register(host)
    staging_mha = fake_gpu.cuda(torch.zeros((2, *host.shape[1:]), dtype=host.dtype))
    before = plain(host).clone()
    hp, dp = _pick(6, host_pages, 7), _pick(6, dev_pages, 8)
    compat.transfer_hicache_all_layer_staged_lf_page_unified(_table(dev_k), _table(dev_v), fake_gpu.cuda(dp), hp,
                                                             staging_mha, host)
    ops.check_errors(synchronize=False)
    for layer in range(LAYERS):
        for kv, src in ((0, dev_k[layer]), (1, dev_v[layer])):
            rows = plain(src)[_tokens(dp)].view(len(dp), PAGE, groups, heads_in_group, dim)
            before[hp, :, layer, kv] = rows.permute(0, 2, 1, 3, 4)
    assert torch.equal(fake_gpu.int16_bits(plain(host)), fake_gpu.int16_bits(before))
    load = _tokens(_pick(6, dev_pages, 9))
    k_before, v_before = plain(dev_k[1]).clone(), plain(dev_v[1]).clone()
    compat.transfer_hicache_one_layer_page_unified_lf(dev_k[1], dev_v[1], host, fake_gpu.cuda(_tokens(hp)),
                                                      fake_gpu.cuda(load), 1)
    ops.check_errors(synchronize=False)
    for kv, dst, old in ((0, dev_k[1], k_before), (1, dev_v[1], v_before)):
        old[load] = plain(host)[hp, :, 1, kv].permute(0, 2, 1, 3, 4).reshape(-1, heads, dim)
        assert torch.equal(fake_gpu.int16_bits(plain(dst)), fake_gpu.int16_bits(old)), kv
    # MLA
    mla_dim = 64
    dev = [fake_gpu.cuda(fake_gpu.random_bits((DEVICE_SLOTS, 1, mla_dim), 300 + l)) for l in range(LAYERS)]
    for t in dev:
        extents.register(t)
    host_mla = fake_gpu.pinned(fake_gpu.random_bits((host_pages, LAYERS, PAGE, mla_dim), 13))
    extents.register(host_mla)
    staging_mla = fake_gpu.cuda(torch.zeros((3, LAYERS, PAGE, mla_dim), dtype=host_mla.dtype))
    before = plain(host_mla).clone()
    hp, dp = _pick(5, host_pages, 10), _pick(5, dev_pages, 11)
    compat.transfer_hicache_all_layer_mla_staged_lf_page_unified(_table(dev), fake_gpu.cuda(dp), hp, staging_mla,
                                                                 host_mla)
    ops.check_errors(synchronize=False)
    for layer in range(LAYERS):
        before[hp, layer] = plain(dev[layer])[_tokens(dp)].view(len(dp), PAGE, mla_dim)
    assert torch.equal(fake_gpu.int16_bits(plain(host_mla)), fake_gpu.int16_bits(before))
    load = _tokens(_pick(5, dev_pages, 12))
    old = plain(dev[2]).clone()
    compat.transfer_hicache_one_layer_mla_page_unified_lf(dev[2], host_mla, fake_gpu.cuda(_tokens(hp)),
                                                          fake_gpu.cuda(load), 2)
    ops.check_errors(synchronize=False)
    old[load] = plain(host_mla)[hp, 2].reshape(-1, 1, mla_dim)
    assert torch.equal(fake_gpu.int16_bits(plain(dev[2])), fake_gpu.int16_bits(old))
    assert copier.calls
