"""Group loads (transfer/staged_loads.py) on the copying stand-in device (tests/fake_gpu.py): the copy
engines' 2-D copies of each run's part of the host blocks and the kernel's scatter, bit for bit, every other
layer and slot untouched (tests/test_staged_loads_gpu.py checks the same on a GPU)."""

from __future__ import annotations

import pytest
import torch

import fake_gpu
from sglang_hicache_jit import ops
from sglang_hicache_jit.transfer import staging
from sglang_hicache_jit.transfer.staged_loads import GroupLoads

LAYERS, PAGE, DEVICE_SLOTS = 4, 16, 512


@pytest.mark.parametrize("page", [1, PAGE], ids=["page_first", "page_first_direct"])
@pytest.mark.parametrize("group", [(0, LAYERS), (1, 2), (3, 1)])
def test_group_loads_land_bit_for_bit_through_the_kernel_scatter(copying_stand_in, page, group):
    copier, engines = copying_stand_in
    heads, dim = 2, 32
    slots = 64 * PAGE
    shape = (slots, LAYERS, heads, dim) if page == 1 else (slots // page, LAYERS, page, heads, dim)
    hosts = [fake_gpu.pinned(fake_gpu.random_bits(shape, 50 + c)) for c in range(2)]
    device = [[fake_gpu.cuda(fake_gpu.random_bits((DEVICE_SLOTS, heads, dim), 70 + 10 * c + l)) for l in range(LAYERS)]
              for c in range(2)]
    before = [[t.as_subclass(torch.Tensor).clone() for t in layers] for layers in device]
    memory = [fake_gpu.cuda(torch.zeros((6,) + shape[1:], dtype=torch.bfloat16)) for _ in range(2)]  # 3 a half
    area = staging.PageStaging(hosts, budget_bytes=1 << 30, device="cuda:0", device_rows=DEVICE_SLOTS, gather=None,
                               page_size=page, memory=memory)
    loads = GroupLoads(area, device)
    gen = torch.Generator().manual_seed(page * 10 + group[1])
    starts = torch.randperm(slots // 16, generator=gen)[:8] * 16  # runs of 16 tokens (one page when page = 16)
    host_idx = (starts[:, None] + torch.arange(16)).reshape(-1)
    device_idx = fake_gpu.cuda(torch.randperm(DEVICE_SLOTS, generator=gen)[:host_idx.numel()])
    first, count = group
    assert loads.load(host_idx, device_idx, first, count) is True
    assert copier.calls and engines.copies
    ops.check_errors(synchronize=False)
    idx = device_idx.as_subclass(torch.Tensor)
    for c in range(2):
        host = hosts[c].as_subclass(torch.Tensor)
        for layer in range(LAYERS):
            want = before[c][layer].clone()
            if first <= layer < first + count:
                want[idx] = host[host_idx, layer] if page == 1 else host[host_idx // page, layer, host_idx % page]
            got = device[c][layer].as_subclass(torch.Tensor)
            assert torch.equal(fake_gpu.int16_bits(got), fake_gpu.int16_bits(want)), (c, layer)


@pytest.mark.parametrize("kind", ["mla", "mha"])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("group", [2, 4])
def test_a_pool_with_load_group_loads_layer_by_layer_bit_for_bit(monkeypatch, kind, layout, group):
    """HostKVPool.load_group on the stand-in: the pool stages (its host buffer is stand-in pinned memory), the
    group's first layer loads the group through the copy engines and the kernel's scatter, and the others
    only wait; every layer lands exactly."""
    import types

    from sglang_hicache_jit.transfer import host_pool, route
    from test_host_pool import as_bytes, device_caches, fill_random, get_host_rows, host_caches, make_device_pool, \
        make_host_pool

    monkeypatch.setattr(host_pool.HostKVPool, "_allocate", lambda self, device_of_pool: fake_gpu.pinned(
        torch.empty(self._buffer_shape(), dtype=self.dtype)))
    monkeypatch.setattr(route, "probe", lambda row_bytes, device=None: types.SimpleNamespace(
        available=True, reason="the stand-in device", code="ok", fix=""))
    with fake_gpu.copying_device(ops) as (copier, engines):
        gen = torch.Generator().manual_seed(group)
        device_pool = make_device_pool(kind, 1152, gen, slots=DEVICE_SLOTS)
        for layers in device_caches(device_pool):
            layers[:] = [fake_gpu.cuda(t) for t in layers]
        pool = make_host_pool(device_pool, size=1024, page_size=PAGE, layout=layout)
        for buf in host_caches(pool):
            fill_random(buf, gen)
        pool.staging_bytes = 2 * 3 * PAGE * pool.layer_num * pool.row_bytes * pool.num_caches  # 3 pages a buffer
        pool.load_group = group
        host_idx = pool.alloc(10 * PAGE)
        device_idx = torch.randperm(DEVICE_SLOTS, generator=gen)[:host_idx.numel()]
        want = []
        for c, layers in enumerate(device_caches(device_pool)):
            host = as_bytes(host_caches(pool)[c].as_subclass(torch.Tensor))
            want.append([])
            for layer in range(pool.layer_num):
                w = as_bytes(layers[layer].as_subclass(torch.Tensor)).clone()
                w[device_idx] = get_host_rows(host, layout, PAGE, layer, host_idx)
                want[-1].append(w)
        for layer in range(pool.layer_num):
            pool.load_to_device_per_layer(device_pool, host_idx, device_idx, layer, "direct")
            assert pool.last_direct_mode == "staged"
        ops.check_errors(synchronize=False)
        assert engines.copies and len(copier.calls) >= -(-pool.layer_num // group)
        for c, layers in enumerate(device_caches(device_pool)):
            for layer in range(pool.layer_num):
                assert torch.equal(as_bytes(layers[layer].as_subclass(torch.Tensor)), want[c][layer]), (c, layer)
