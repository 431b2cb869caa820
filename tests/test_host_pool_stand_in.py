"""The host pools' GPU paths (transfer/host_pool.py) on the copying stand-in device (tests/fake_gpu.py): a pool
whose device layers claim cuda:0 and whose host buffer claims to be pinned takes the kernel (the probe says
it works) or the copy engines per io_backend, and stages page_first and page_first_direct backups through
the kernel's gather, exactly as on a GPU; every transfer is carried out in CPU memory by the Copier and the
copying copy engines. Each cell backs up random pages, checks the host buffer bit for bit, then loads them
into other device slots layer by layer and checks every device layer (tests/test_host_pool_gpu.py checks
the same on a GPU)."""

from __future__ import annotations

import types

import pytest
import torch

import fake_gpu
from sglang_hicache_jit import ops
from sglang_hicache_jit.transfer import host_pool, route

from test_host_pool import (as_bytes, device_caches, fill_random, get_host_rows, host_caches, make_device_pool,
                            make_host_pool, shuffle_allocator)

SLOTS = 384


@pytest.fixture
def stand_in(monkeypatch):
    """The copying stand-in device; host buffers allocated as stand-in pinned memory; the probe says yes."""

    def allocate(self, device_of_pool):
        return fake_gpu.pinned(torch.empty(self._buffer_shape(), dtype=self.dtype))

    monkeypatch.setattr(host_pool.HostKVPool, "_allocate", allocate)
    monkeypatch.setattr(route, "probe", lambda row_bytes, device=None: types.SimpleNamespace(
        available=True, reason="the stand-in device", code="ok", fix=""))
    with fake_gpu.copying_device(ops) as devices:
        yield devices


def _on_stand_in(device_pool):
    """The device pool's layers dressed as cuda:0 (the same memory)."""
    for layers in device_caches(device_pool):
        layers[:] = [fake_gpu.cuda(t) for t in layers]
    return device_pool


@pytest.mark.parametrize("kind", ["mla", "mha"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_a_backup_and_a_load_land_bit_for_bit(stand_in, kind, layout, io_backend):
    copier, engines = stand_in
    gen = torch.Generator().manual_seed(len(layout) * 7 + len(kind))
    device_pool = _on_stand_in(make_device_pool(kind, 1152, gen, slots=SLOTS))
    pool = make_host_pool(device_pool, size=1024, page_size=16, layout=layout)
    assert pool.transfer_path == "kernel"
    for buf in host_caches(pool):
        fill_random(buf, gen)
    shuffle_allocator(pool, gen)
    host_idx = pool.alloc(8 * 16)
    device_idx = torch.randperm(SLOTS, generator=gen)[:host_idx.numel()]
    on = fake_gpu.cuda if io_backend == "kernel" else (lambda t: t)
    expected = [as_bytes(b).clone() for b in host_caches(pool)]
    for c, layers in enumerate(device_caches(device_pool)):
        for layer in range(pool.layer_num):
            rows = as_bytes(layers[layer].as_subclass(torch.Tensor))[device_idx]
            if layout == "layer_first":
                expected[c][layer, host_idx] = rows
            elif layout == "page_first":
                expected[c][host_idx, layer] = rows
            else:
                expected[c][host_idx // pool.page_size, layer, host_idx % pool.page_size] = rows
    pool.backup_from_device_all_layer(device_pool, on(host_idx), on(device_idx), io_backend)
    ops.check_errors(synchronize=False)
    for c, buf in enumerate(host_caches(pool)):
        assert torch.equal(as_bytes(buf.as_subclass(torch.Tensor)), expected[c]), c
    # Load them back, layer by layer, into other device slots.
    load_idx = torch.randperm(SLOTS, generator=gen)[:host_idx.numel()]
    want = []
    for c, layers in enumerate(device_caches(device_pool)):
        want.append([])
        for layer in range(pool.layer_num):
            w = as_bytes(layers[layer].as_subclass(torch.Tensor)).clone()
            w[load_idx] = get_host_rows(as_bytes(host_caches(pool)[c].as_subclass(torch.Tensor)), layout,
                                        pool.page_size, layer, host_idx)
            want[-1].append(w)
    for layer in range(pool.layer_num):
        pool.load_to_device_per_layer(device_pool, on(host_idx), on(load_idx), layer, io_backend)
    ops.check_errors(synchronize=False)
    for c, layers in enumerate(device_caches(device_pool)):
        for layer in range(pool.layer_num):
            assert torch.equal(as_bytes(layers[layer].as_subclass(torch.Tensor)), want[c][layer]), (c, layer)
    assert copier.calls or engines.copies
