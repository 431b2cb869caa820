"""GPU: every op SGLang's pools call, on the kernel path and the copy-engine path,
bit for bit against torch indexing (no sglang needed)."""

import contextlib

import pytest
import torch

from sglang_hicache_jit import compat
from sglang_hicache_jit.integrations.sglang import ops as sglang_ops

pytestmark = pytest.mark.gpu

PAGE, LAYERS, HOST_PAGES, DEV_PAGES = 16, 3, 40, 20


def rand(shape, dtype=torch.bfloat16, *, pin=False, device="cpu"):
    t = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
    t.view(torch.uint8).random_(0, 256)
    return t


def tokens(pages):
    return (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


def pick(n, total, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(total, generator=g)[:n]


def same(a, b):
    return torch.equal(a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu())


@pytest.fixture(params=["kernel", "direct"])
def path(request):
    ctx = sglang_ops.copy_engines_only() if request.param == "direct" else contextlib.nullcontext()
    with ctx:
        yield request.param


def table(ts):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64, device="cuda")


def test_one_layer_mla_page_first_view(path):
    dim = 288  # 576 B of bf16
    host = rand((HOST_PAGES * PAGE, LAYERS, 1, dim), pin=True)
    dev = rand((DEV_PAGES * PAGE, 1, dim), device="cuda")
    h, d = tokens(pick(6, HOST_PAGES, 1)), tokens(pick(6, DEV_PAGES, 2)).cuda()
    before = host.clone()
    sglang_ops.transfer_hicache_one_layer_mla(cache_dst=host.transpose(0, 1)[2], indices_dst=h, cache_src=dev,
                                              indices_src=d, element_dim=dim, page_size=PAGE)
    torch.cuda.synchronize()
    expect = before.clone()
    expect[h, 2] = dev[d].cpu()
    assert same(host, expect)


def test_all_layer_mha_pointer_tables(path):
    heads, dim = 2, 64
    dev_k = [rand((DEV_PAGES * PAGE, heads, dim), device="cuda") for _ in range(LAYERS)]
    dev_v = [rand((DEV_PAGES * PAGE, heads, dim), device="cuda") for _ in range(LAYERS)]
    host = rand((2, LAYERS, HOST_PAGES * PAGE, heads, dim), pin=True)
    before = host.clone()
    h, d = tokens(pick(5, HOST_PAGES, 3)), tokens(pick(5, DEV_PAGES, 4)).cuda()
    row = heads * dim * 2
    sglang_ops.transfer_hicache_all_layer(table(host[0]), table(host[1]), h.cuda(), table(dev_k), table(dev_v), d,
                                          kv_cache_src_stride_bytes=row, kv_cache_dst_stride_bytes=row,
                                          element_size=row)
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        before[0, layer, h] = dev_k[layer][d].cpu()
        before[1, layer, h] = dev_v[layer][d].cpu()
    assert same(host, before)


@pytest.mark.parametrize("routed", [False, True], ids=["compat", "routed"])
def test_staged_write_back_mla(path, routed):  # 656-B DSA rows
    if path == "direct" and not routed:
        pytest.skip("compat is the kernel only")
    dev = [rand((DEV_PAGES * PAGE, 1, 656), torch.uint8, device="cuda") for _ in range(LAYERS)]
    host = rand((HOST_PAGES * PAGE, LAYERS, 1, 656), torch.uint8, pin=True)
    staging = torch.empty((4 * PAGE, LAYERS, 1, 656), dtype=torch.uint8, device="cuda")
    before = host.clone()
    h, d = tokens(pick(7, HOST_PAGES, 5)), tokens(pick(7, DEV_PAGES, 6)).cuda()
    fn = sglang_ops if routed else compat
    fn.transfer_hicache_all_layer_mla_staged_lf_pf(table(dev), d, h.cuda(), staging, host, page_size=PAGE)
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        before[h, layer] = dev[layer][d].cpu()
    assert same(host, before)


def test_page_unified_mha_round_trip():
    groups, layers, heads_in_group, dim = 2, LAYERS, 2, 64
    heads = groups * heads_in_group
    dev_k = [rand((DEV_PAGES * PAGE, heads, dim), device="cuda") for _ in range(layers)]
    dev_v = [rand((DEV_PAGES * PAGE, heads, dim), device="cuda") for _ in range(layers)]
    host = rand((HOST_PAGES, groups, layers, 2, PAGE, heads_in_group, dim), pin=True)
    staging = torch.empty((2, *host.shape[1:]), dtype=host.dtype, device="cuda")
    before = host.clone()
    hp, dp = pick(6, HOST_PAGES, 7), pick(6, DEV_PAGES, 8)
    compat.transfer_hicache_all_layer_staged_lf_page_unified(table(dev_k), table(dev_v), dp.cuda(), hp, staging, host)
    torch.cuda.synchronize()
    for layer in range(layers):
        for kv, src in ((0, dev_k[layer]), (1, dev_v[layer])):
            rows = src[tokens(dp).cuda()].view(len(dp), PAGE, groups, heads_in_group, dim).cpu()
            before[hp, :, layer, kv] = rows.permute(0, 2, 1, 3, 4)
    assert same(host, before)
    # Load layer 1 back into other device slots.
    load = tokens(pick(6, DEV_PAGES, 9)).cuda()
    k_before, v_before = dev_k[1].clone(), dev_v[1].clone()
    compat.transfer_hicache_one_layer_page_unified_lf(dev_k[1], dev_v[1], host, tokens(hp).cuda(), load, 1)
    torch.cuda.synchronize()
    for kv, dst, old in ((0, dev_k[1], k_before), (1, dev_v[1], v_before)):
        expect = old.clone()
        expect[load] = host[hp, :, 1, kv].permute(0, 2, 1, 3, 4).reshape(-1, heads, dim).cuda()
        assert same(dst, expect)


def test_page_unified_mla_round_trip():
    dim = 288
    dev = [rand((DEV_PAGES * PAGE, 1, dim), device="cuda") for _ in range(LAYERS)]
    host = rand((HOST_PAGES, LAYERS, PAGE, dim), pin=True)
    staging = torch.empty((3, LAYERS, PAGE, dim), dtype=host.dtype, device="cuda")
    before = host.clone()
    hp, dp = pick(5, HOST_PAGES, 10), pick(5, DEV_PAGES, 11)
    compat.transfer_hicache_all_layer_mla_staged_lf_page_unified(table(dev), dp.cuda(), hp, staging, host)
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        before[hp, layer] = dev[layer][tokens(dp).cuda()].view(len(dp), PAGE, dim).cpu()
    assert same(host, before)
    load = tokens(pick(5, DEV_PAGES, 12)).cuda()
    old = dev[2].clone()
    compat.transfer_hicache_one_layer_mla_page_unified_lf(dev[2], host, tokens(hp).cuda(), load, 2)
    torch.cuda.synchronize()
    old[load] = host[hp, 2].reshape(-1, 1, dim).cuda()
    assert same(dev[2], old)


def test_kvcacheio_per_layer_pf_lf_and_all_layer_lf_pf(path):
    heads, dim = 2, 64
    row = heads * dim * 2
    host_k = rand((HOST_PAGES * PAGE, LAYERS, heads, dim), pin=True)
    host_v = rand((HOST_PAGES * PAGE, LAYERS, heads, dim), pin=True)
    dev_k = [rand((DEV_PAGES * PAGE, heads, dim), device="cuda") for _ in range(LAYERS)]
    dev_v = [rand((DEV_PAGES * PAGE, heads, dim), device="cuda") for _ in range(LAYERS)]
    h, d = tokens(pick(4, HOST_PAGES, 13)), tokens(pick(4, DEV_PAGES, 14)).cuda()
    kb, vb = host_k.clone(), host_v.clone()
    sglang_ops.transfer_kv_all_layer_lf_pf(table(dev_k), host_k, table(dev_v), host_v, d, h.cuda(), row,
                                           LAYERS * row, LAYERS)
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        kb[h, layer] = dev_k[layer][d].cpu()
        vb[h, layer] = dev_v[layer][d].cpu()
    assert same(host_k, kb) and same(host_v, vb)
    load = tokens(pick(4, DEV_PAGES, 15)).cuda()
    ok, ov = dev_k[1].clone(), dev_v[1].clone()
    sglang_ops.transfer_kv_per_layer_pf_lf(host_k, dev_k[1], host_v, dev_v[1], h, load, 1, row, LAYERS * row)
    torch.cuda.synchronize()
    ok[load], ov[load] = host_k[h, 1].cuda(), host_v[h, 1].cuda()
    assert same(dev_k[1], ok) and same(dev_v[1], ov)


def test_kvcacheio_page_head(path):
    heads, dim = 4, 32
    row = heads * dim * 2
    host_k = rand((HOST_PAGES, heads, PAGE, LAYERS, dim), pin=True)
    host_v = rand((HOST_PAGES, heads, PAGE, LAYERS, dim), pin=True)
    dev_k = [rand((DEV_PAGES * PAGE, heads, dim), device="cuda") for _ in range(LAYERS)]
    dev_v = [rand((DEV_PAGES * PAGE, heads, dim), device="cuda") for _ in range(LAYERS)]
    hp, dp = pick(3, HOST_PAGES, 16), pick(3, DEV_PAGES, 17)
    h, d = tokens(hp), tokens(dp).cuda()
    kb, vb = host_k.clone(), host_v.clone()
    sglang_ops.transfer_kv_all_layer_lf_ph(table(dev_k), host_k, table(dev_v), host_v, d, h, row, 0, LAYERS, PAGE,
                                           heads)
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        for dst, src in ((kb, dev_k[layer]), (vb, dev_v[layer])):
            dst[hp, :, :, layer] = src[d].view(len(hp), PAGE, heads, dim).permute(0, 2, 1, 3).cpu()
    assert same(host_k, kb) and same(host_v, vb)
    load = tokens(pick(3, DEV_PAGES, 18)).cuda()
    ok, ov = dev_k[2].clone(), dev_v[2].clone()
    sglang_ops.transfer_kv_per_layer_ph_lf(host_k, dev_k[2], host_v, dev_v[2], h, load, 2, row, 0, PAGE, heads)
    torch.cuda.synchronize()
    ok[load] = host_k[hp, :, :, 2].permute(0, 2, 1, 3).reshape(-1, heads, dim).cuda()
    ov[load] = host_v[hp, :, :, 2].permute(0, 2, 1, 3).reshape(-1, heads, dim).cuda()
    assert same(dev_k[2], ok) and same(dev_v[2], ov)


def test_kvcacheio_direct_page_first_direct():
    dim = 288
    host = rand((HOST_PAGES, LAYERS, PAGE, 1, dim), pin=True)
    dev = [rand((DEV_PAGES * PAGE, 1, dim), device="cuda") for _ in range(LAYERS)]
    hp, dp = pick(5, HOST_PAGES, 19), pick(5, DEV_PAGES, 20)
    h, d = tokens(hp), tokens(dp).cuda()
    before = host.clone()
    sglang_ops.transfer_kv_all_layer_direct_lf_pf(dev, [host], d, h, PAGE)
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        before[hp, layer] = dev[layer][d].view(len(hp), PAGE, 1, dim).cpu()
    assert same(host, before)
    load = tokens(pick(5, DEV_PAGES, 21)).cuda()
    old = dev[1].clone()
    sglang_ops.transfer_kv_per_layer_direct_pf_lf([host], [dev[1]], h, load, 1, PAGE)
    torch.cuda.synchronize()
    old[load] = host[hp, 1].reshape(-1, 1, dim).cuda()
    assert same(dev[1], old)


@pytest.mark.parametrize("kind", ["mla", "mha"])
@pytest.mark.parametrize("budget", ["3-pages", "default"])
def test_kvcacheio_all_layer_lf_pf_with_cpu_indices_is_staged(path, kind, budget, monkeypatch):
    """SGLang's copy-engine backend hands CPU indices: page_first backups go through the staging area (a
    kernel gather, then flat page copies), in chunks when the budget is small; bit-exact either way."""
    heads, dim = (1, 288) if kind == "mla" else (2, 64)
    row = heads * dim * 2
    if budget != "default":
        monkeypatch.setenv("SGLANG_HICACHE_JIT_STAGING", str(2 * 3 * PAGE * LAYERS * row * (1 if kind == "mla" else 2)))
    sglang_ops.reset()
    hosts = [rand((HOST_PAGES * PAGE, LAYERS, heads, dim), pin=True) for _ in range(1 if kind == "mla" else 2)]
    devs = [[rand((DEV_PAGES * PAGE, heads, dim), device="cuda") for _ in range(LAYERS)] for _ in hosts]
    h, d = tokens(pick(9, HOST_PAGES, 31)), tokens(pick(9, DEV_PAGES, 32))
    expected = [host.clone() for host in hosts]
    if kind == "mla":
        sglang_ops.transfer_kv_all_layer_mla_lf_pf(table(devs[0]), hosts[0], d, h, row, LAYERS * row, LAYERS)
    else:
        sglang_ops.transfer_kv_all_layer_lf_pf(table(devs[0]), hosts[0], table(devs[1]), hosts[1], d, h, row,
                                               LAYERS * row, LAYERS)
    torch.cuda.synchronize()
    for host, want, layers in zip(hosts, expected, devs):
        for layer in range(LAYERS):
            want[h, layer] = layers[layer][d].cpu()
        assert same(host, want)
    areas = [entry[2] for entry in sglang_ops._stagings.values()]
    assert areas and all(a is not None for a in areas), "the backup did not go through the staging area"
    sglang_ops.reset()


def test_a_per_layer_direct_load_is_planned_once_for_all_layers(monkeypatch):
    dim = 288
    host = rand((HOST_PAGES, LAYERS, PAGE, 1, dim), pin=True)
    dev = [rand((DEV_PAGES * PAGE, 1, dim), device="cuda") for _ in range(LAYERS)]
    hp = pick(6, HOST_PAGES, 41)
    h, d = tokens(hp), tokens(pick(6, DEV_PAGES, 42)).cuda()
    made = []
    real = sglang_ops.direct.CopyPlan
    monkeypatch.setattr(sglang_ops.direct, "CopyPlan", lambda *a: made.append(1) or real(*a))
    expected = [t.clone() for t in dev]
    for layer in range(LAYERS):
        with sglang_ops.copy_engines_only():  # 9 KiB pages would take the kernel at one CTA (the next tests)
            sglang_ops.transfer_kv_per_layer_direct_pf_lf([host], [dev[layer]], h, d, layer, PAGE)
        expected[layer][d] = host[hp, layer].reshape(-1, 1, dim).cuda()
    torch.cuda.synchronize()
    assert len(made) == 1
    for layer in range(LAYERS):
        assert same(dev[layer], expected[layer]), f"layer {layer}"


def _write_back(kind, h, d, memory_pages, monkeypatch, *, min_chunk=None):
    """SGLang's staged write-back of ``kind`` ('mla' or 'mha') with CPU host indices ``h`` and device indices
    ``d``, through the routed op, with staging buffers of ``memory_pages`` pages as SGLang allocates them."""
    if min_chunk is not None:
        monkeypatch.setattr(sglang_ops.route, "WRITE_BACK_MIN_CHUNK_TOKENS", min_chunk)
    sglang_ops.reset()
    heads, dim = (1, 288) if kind == "mla" else (2, 64)
    hosts = [rand((HOST_PAGES * PAGE, LAYERS, heads, dim), pin=True) for _ in range(1 if kind == "mla" else 2)]
    devs = [[rand((DEV_PAGES * PAGE, heads, dim), device="cuda") for _ in range(LAYERS)] for _ in hosts]
    memory = [torch.empty((memory_pages * PAGE, LAYERS, heads, dim), dtype=torch.bfloat16, device="cuda")
              for _ in hosts]
    expected = [host.clone() for host in hosts]
    if kind == "mla":
        sglang_ops.transfer_hicache_all_layer_mla_staged_lf_pf(table(devs[0]), d, h, memory[0], hosts[0],
                                                               page_size=PAGE)
    else:
        sglang_ops.transfer_hicache_all_layer_staged_lf_pf(table(devs[0]), table(devs[1]), d, h, memory[0],
                                                           memory[1], hosts[0], hosts[1], page_size=PAGE)
    return hosts, devs, memory, expected


@pytest.mark.parametrize("kind", ["mla", "mha"])
@pytest.mark.parametrize("memory", ["staged", "too-small"])
def test_staged_write_back_with_cpu_host_indices_goes_through_sglangs_staging_buffers(kind, memory, monkeypatch):
    """SGLang's staged write-back (can_use_write_back_jit True: host indices on the CPU, device indices on the
    GPU): the routed op stages the backup in SGLang's own staging buffers (here 4 pages, so 9 pages take 5
    chunks through both halves); buffers whose halves hold fewer than route.WRITE_BACK_MIN_CHUNK_TOKENS tokens are left alone
    and the kernel writes the rows. Bit-exact either way."""
    h, d = tokens(pick(9, HOST_PAGES, 51)), tokens(pick(9, DEV_PAGES, 52)).cuda()
    hosts, devs, staging, expected = _write_back(kind, h, d, 4, monkeypatch,
                                                 min_chunk=2 * PAGE if memory == "staged" else 2 * PAGE + 1)
    torch.cuda.synchronize()
    for host, want, layers in zip(hosts, expected, devs):
        for layer in range(LAYERS):
            want[h, layer] = layers[layer][d.cpu()].cpu()
        assert same(host, want)
    areas = [entry[2] for entry in sglang_ops._stagings.values()]
    if memory == "staged":
        assert len(areas) == 1 and areas[0] is not None, "the write-back did not go through the staging area"
        for c, m in enumerate(staging):  # the halves are SGLang's buffers, not an allocation of the package
            start, end = m.data_ptr(), m.data_ptr() + m.numel() * m.element_size()
            assert [start <= areas[0].buffers[b][c].data_ptr() < end for b in (0, 1)] == [True, True]
    else:
        assert areas == []
    sglang_ops.reset()


@pytest.mark.parametrize("bad", [-1, "past-the-end"])
def test_a_staged_write_back_with_a_device_index_outside_the_pool_raises(bad, monkeypatch):
    """The device indices of a staged write-back stay on the GPU (reading them would sync SGLang's scheduler):
    the gather's kernel refuses one outside the pool, and a negative one, which a block copy cannot skip as
    padding; the next op (here check_errors) raises."""
    from sglang_hicache_jit.errors import TransferIndexError
    from sglang_hicache_jit.transfer import ops as transfer_ops

    h, d = tokens(pick(9, HOST_PAGES, 53)), tokens(pick(9, DEV_PAGES, 54))
    d[17] = -1 if bad == -1 else DEV_PAGES * PAGE + 3
    with pytest.raises(TransferIndexError, match="skipped rows"):
        try:  # the next chunk's gather in the same call may be the op that reports it
            _write_back("mla", h, d.cuda(), 4, monkeypatch, min_chunk=2 * PAGE)
        finally:
            assert sglang_ops._stagings and all(e[2] is not None for e in sglang_ops._stagings.values())
        transfer_ops.check_errors()
    sglang_ops.reset()


def test_can_use_write_back_jit_kernel_answers_whether_staging_serves(monkeypatch):
    assert sglang_ops.can_use_write_back_jit_kernel(element_size=576) is True
    monkeypatch.setenv("SGLANG_HICACHE_JIT_STAGING", "0")
    assert sglang_ops.can_use_write_back_jit_kernel(element_size=576) is False


def test_two_pools_sharing_one_staging_memory_back_up_without_loss(monkeypatch):
    """From 0.5.23 SGLang may hand several host pools slices of one staging allocation (its
    ``write_back_staging``): each pool's staging area then lives in the same memory. Backups of both on one
    stream, alternating, each in several chunks, must leave both host pools exact."""
    monkeypatch.setattr(sglang_ops.route, "WRITE_BACK_MIN_CHUNK_TOKENS", 2 * PAGE)
    sglang_ops.reset()
    dim = 288
    shared = torch.empty((4 * PAGE, LAYERS, 1, dim), dtype=torch.bfloat16, device="cuda")
    hosts = [rand((HOST_PAGES * PAGE, LAYERS, 1, dim), pin=True) for _ in range(2)]
    devs = [[rand((DEV_PAGES * PAGE, 1, dim), device="cuda") for _ in range(LAYERS)] for _ in range(2)]
    tables = [table(layers) for layers in devs]  # a pool's pointer table lives as long as the pool, as in SGLang
    expected = [h.clone() for h in hosts]
    for step in range(6):
        pool = step % 2
        h, d = tokens(pick(9, HOST_PAGES, 60 + step)), tokens(pick(9, DEV_PAGES, 70 + step)).cuda()
        sglang_ops.transfer_hicache_all_layer_mla_staged_lf_pf(tables[pool], d, h, shared, hosts[pool],
                                                               page_size=PAGE)
        for layer in range(LAYERS):  # a pool whose copies read the other pool's gather gets its rows
            expected[pool][h, layer] = devs[pool][layer][d.cpu()].cpu()
    torch.cuda.synchronize()
    assert len(sglang_ops._stagings) == 2 and all(e[2] is not None for e in sglang_ops._stagings.values())
    for host, want in zip(hosts, expected):
        assert same(host, want)
    sglang_ops.reset()


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("indices", ["cpu", "cuda"])
def test_small_direct_copies_run_on_the_kernel_bit_for_bit(page, indices, monkeypatch):
    """SGLang's io_backend='direct' with copies under SMALL_COPY_BYTES (1152-B rows one at a time, or 18 KiB
    pages): transfer_kv_direct (layer_first) and the page_first_direct pair run the kernel at one CTA, never the
    copy engines, and land every row where torch indexing puts it, nothing else touched."""
    from sglang_hicache_jit.transfer import route

    def no_copy_engines(*args, **kwargs):
        raise AssertionError("a small 'direct' copy went to the copy engines")

    monkeypatch.setattr(route, "copy", no_copy_engines)
    dim, pages = 576, 24
    on = (lambda t: t.cuda()) if indices == "cuda" else (lambda t: t)
    host_lf = rand((pages * page, 1, dim), pin=True)
    dev = [rand((DEV_PAGES * page, 1, dim), device="cuda") for _ in range(LAYERS)]
    hp, dp = pick(7, pages, 51), pick(7, DEV_PAGES, 52)
    h = (hp[:, None] * page + torch.arange(page)).reshape(-1)
    d = (dp[:, None] * page + torch.arange(page)).reshape(-1)
    want_host = host_lf.clone()
    sglang_ops.transfer_kv_direct([dev[0]], [host_lf], on(d), on(h), page)   # a backup of one layer
    torch.cuda.synchronize()
    want_host[h] = dev[0][d.cuda()].cpu()
    assert same(host_lf, want_host)
    want_dev = dev[1].clone()
    sglang_ops.transfer_kv_direct([host_lf], [dev[1]], on(h), on(d), page)   # and a load
    torch.cuda.synchronize()
    want_dev[d.cuda()] = host_lf[h].cuda()
    assert same(dev[1], want_dev)
    if page == 1:
        return
    host_pfd = rand((pages, LAYERS, page, 1, dim), pin=True)
    want_pfd = host_pfd.clone()
    sglang_ops.transfer_kv_all_layer_direct_lf_pf(dev, [host_pfd], on(d), on(h), page)
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        want_pfd[hp, layer] = dev[layer][d.cuda()].view(len(hp), page, 1, dim).cpu()
    assert same(host_pfd, want_pfd)
    want_dev = dev[2].clone()
    sglang_ops.transfer_kv_per_layer_direct_pf_lf([host_pfd], [dev[2]], on(h), on(d), 1, page)
    torch.cuda.synchronize()
    want_dev[d.cuda()] = host_pfd[hp, 1].reshape(-1, 1, dim).cuda()
    assert same(dev[2], want_dev)
