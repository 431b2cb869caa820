"""Small 'direct' copies (route.small_copies) on the copying stand-in device (tests/fake_gpu.py): the routed
direct ops SGLang calls with io_backend='direct' run copies under SMALL_COPY_BYTES on the kernel at one CTA,
bit for bit, and never on the copy engines (tests/test_routed_ops_gpu.py checks the same on a GPU)."""

from __future__ import annotations

import pytest
import torch

import fake_gpu
from sglang_hicache_jit import ops
from sglang_hicache_jit.integrations.sglang import ops as routed
from sglang_hicache_jit.transfer import route

LAYERS = 4


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("indices", ["cpu", "cuda"])
def test_small_direct_copies_run_on_the_kernel_bit_for_bit(copying_stand_in, monkeypatch, page, indices):
    """SGLang's io_backend='direct' with copies under SMALL_COPY_BYTES (1152-B rows one at a time, or 18 KiB
    pages): transfer_kv_direct (layer_first) and the page_first_direct pair run the kernel at one CTA, never
    the copy engines, and land every row where torch indexing puts it, nothing else touched."""
    copier, engines = copying_stand_in

    def no_copy_engines(*args, **kwargs):
        raise AssertionError("a small 'direct' copy went to the copy engines")

    monkeypatch.setattr(route, "copy", no_copy_engines)
    dim, pages, dev_pages = 576, 24, 32
    route._verdicts[dim * 2] = True
    on = fake_gpu.cuda if indices == "cuda" else (lambda t: t)
    plain = lambda t: t.as_subclass(torch.Tensor)  # noqa: E731
    host_lf = fake_gpu.pinned(fake_gpu.random_bits((pages * page, 1, dim), 1))
    dev = [fake_gpu.cuda(fake_gpu.random_bits((dev_pages * page, 1, dim), 2 + l)) for l in range(LAYERS)]
    gen = torch.Generator().manual_seed(page)
    hp, dp = torch.randperm(pages, generator=gen)[:7], torch.randperm(dev_pages, generator=gen)[:7]
    h = (hp[:, None] * page + torch.arange(page)).reshape(-1)
    d = (dp[:, None] * page + torch.arange(page)).reshape(-1)
    want_host = plain(host_lf).clone()
    routed.transfer_kv_direct([dev[0]], [host_lf], on(d), on(h), page)  # a backup of one layer
    want_host[h] = plain(dev[0])[d]
    assert torch.equal(fake_gpu.int16_bits(plain(host_lf)), fake_gpu.int16_bits(want_host))
    want_dev = plain(dev[1]).clone()
    routed.transfer_kv_direct([host_lf], [dev[1]], on(h), on(d), page)  # and a load
    want_dev[d] = plain(host_lf)[h]
    assert torch.equal(fake_gpu.int16_bits(plain(dev[1])), fake_gpu.int16_bits(want_dev))
    assert copier.calls and not engines.copies
    if page == 1:
        return
    host_pfd = fake_gpu.pinned(fake_gpu.random_bits((pages, LAYERS, page, 1, dim), 9))
    want_pfd = plain(host_pfd).clone()
    routed.transfer_kv_all_layer_direct_lf_pf(dev, [host_pfd], on(d), on(h), page)
    for layer in range(LAYERS):
        want_pfd[hp, layer] = plain(dev[layer])[d].view(len(hp), page, 1, dim)
    assert torch.equal(fake_gpu.int16_bits(plain(host_pfd)), fake_gpu.int16_bits(want_pfd))
    want_dev = plain(dev[2]).clone()
    routed.transfer_kv_per_layer_direct_pf_lf([host_pfd], [dev[2]], on(h), on(d), 1, page)
    want_dev[d] = plain(host_pfd)[hp, 1].reshape(-1, 1, dim)
    assert torch.equal(fake_gpu.int16_bits(plain(dev[2])), fake_gpu.int16_bits(want_dev))
    ops.check_errors(synchronize=False)
