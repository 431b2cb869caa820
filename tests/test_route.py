"""transfer/route.py: the path decisions in one place, and the copy engines' one plan cache (CPU).

The plan cache's attacks (indices changed behind torch, inference tensors, one tensor as both index
arguments) are in test_stale_plans.py; here: what the cache keys on, that a load is planned once for all its
layers wherever it comes from (host pools, routed ops, SGLang pool hooks), that indices are checked once per
operation, and the decision tables.
"""

import pytest
import torch

from sglang_hicache_jit.errors import TransferIndexError
from sglang_hicache_jit.integrations.sglang import ops as routed
from sglang_hicache_jit.integrations.sglang import pools as hooks
from sglang_hicache_jit.transfer import bounds, checks, direct, host_pool, layout, route

from test_host_pool import as_bytes, fill_random, get_host_rows, make_device_pool, make_host_pool


@pytest.fixture
def plans_made(monkeypatch):
    """Counts the copy plans made (route.copy makes one per miss), from a clean cache."""
    route.PLANS.clear()
    made = []
    real = direct.CopyPlan
    monkeypatch.setattr(direct, "CopyPlan", lambda *a: made.append(1) or real(*a))
    yield made
    route.PLANS.clear()


def test_the_plan_cache_keys_on_index_bytes_not_on_tensors():
    cache, made = route.PlanCache(capacity=3), []
    make = lambda dst, src: made.append((dst.tolist(), src.tolist())) or len(made)  # noqa: E731
    a, b = torch.arange(8), torch.arange(8, 16)
    assert cache.get(a, b, "x", make) == 1
    assert cache.get(a, b, "x", make) == 1                       # the same bytes: reused
    assert cache.get(a.clone(), b.to(torch.int32), "x", make) == 1  # other tensors, same values: reused
    assert cache.get(a, b, "y", make) == 2                       # another transfer on the same indices
    a.data[3] = 99                                               # behind torch: the version does not move
    assert cache.get(a, b, "x", make) == 3 and made[-1][0][3] == 99
    b[::2] = 0                                                   # in place through a view
    assert cache.get(a, b, "x", make) == 4
    assert cache.get(a[:4], b[:4], "x", make) == 5               # a prefix of the same bytes is another plan
    assert len(cache._entries) == 3                              # bounded
    assert cache.get(torch.arange(0), torch.arange(0), "x", make) == 6  # empty indices plan (nothing to copy)


def test_the_cache_keeps_copies_of_the_indices_it_planned():
    """A plan is filed under a copy of its indices: writing the caller's tensor later cannot make the entry
    look like the new values."""
    cache = route.PlanCache()
    a = torch.arange(4)
    plan = cache.get(a, a, "x", lambda dst, src: object())
    entry = cache._entries[-1]
    assert entry[2].data_ptr() != a.data_ptr() and entry[3].data_ptr() != a.data_ptr()
    a[0] = 3
    assert cache.get(a, a, "x", lambda dst, src: object()) is not plan


def test_a_pool_plans_a_load_once_for_all_its_layers(plans_made):
    gen = torch.Generator().manual_seed(7)
    dp = make_device_pool("mla", 1152, gen)
    pool = make_host_pool(dp, page_size=16, layout="page_first_direct")
    fill_random(pool.kv_buffer, gen)
    host, dev = pool.alloc(64), torch.arange(64, 128)

    def check(layers):
        for layer in layers:
            want = get_host_rows(as_bytes(pool.kv_buffer), "page_first_direct", 16, layer, host)
            assert torch.equal(as_bytes(dp.kv_buffer[layer])[dev], want), f"layer {layer}"

    layers = range(len(dp.kv_buffer))
    for layer in layers:
        pool.load_to_device_per_layer(dp, host, dev, layer, "direct")
    assert len(plans_made) == 1
    check(layers)  # every layer got its own rows from the one plan
    dev.add_(1)    # the caller rewrote its indices: the next load plans again
    pool.load_to_device_per_layer(dp, host, dev, 0, "direct")
    assert len(plans_made) == 2
    check([0])
    pool.load_to_device_per_layer(dp, host.clone(), dev.clone(), 1, "direct")  # new tensors, same indices
    assert len(plans_made) == 2
    check([1])


def test_the_hooks_plan_a_layer_sharded_backup_once(plans_made):
    """SGLang's layer-sharded backups copy one layer per call through pools._copy_layer, with index tensors made
    anew for each layer (the DSA pool's _get_indexer_page_indices): one plan serves every layer. Before, every
    call planned again (direct.copy_rows)."""
    gen = torch.Generator().manual_seed(3)
    host = torch.randint(0, 256, (64, 4, 96), dtype=torch.uint8, generator=gen)  # page_first: 4 layers
    dev = [torch.randint(0, 256, (32, 96), dtype=torch.uint8, generator=gen) for _ in range(4)]
    for layer in range(4):
        h, d = torch.arange(16, 32), torch.arange(0, 16)
        hooks._copy_layer(host[:, layer], h, dev[layer], d, io_backend="direct", row_bytes=96)
        assert torch.equal(host[16:32, layer], dev[layer][:16])
    assert len(plans_made) == 1


def test_the_routed_ops_and_the_pools_share_the_one_cache(plans_made):
    gen = torch.Generator().manual_seed(5)
    dp = make_device_pool("mla", 1152, gen)
    pool = make_host_pool(dp, page_size=16, layout="layer_first")
    pool.load_to_device_per_layer(dp, torch.arange(16), torch.arange(16), 0, "direct")
    host = torch.zeros((4, 8, 1, 8), dtype=torch.int32)
    routed.transfer_kv_per_layer_direct_pf_lf([host], [torch.zeros((8, 1, 8), dtype=torch.int32)],
                                              torch.arange(4), torch.arange(4), 0, 4)
    assert len(route.PLANS._entries) == 2 == len(plans_made)


@pytest.mark.parametrize("how", ["pool load", "pool backup", "routed", "hook"])
def test_indices_are_checked_once_per_operation(how, monkeypatch):
    """The outer layer checks each index tensor once (the index contract); what it calls trusts it. Before, a
    pool's copy-engine load checked each tensor twice or three times (the pool, plan_runs, find_runs)."""
    seen = []
    real = checks.check_index_tensor

    def counting(name, idx, device=None):
        seen.append(name)
        return real(name, idx, device)

    for module in (host_pool, direct, bounds):  # bounds: where the routed ops call it, under their own names
        monkeypatch.setattr(module, "check_index_tensor", counting)
    route.PLANS.clear()
    h, d = torch.tensor([5, 1, 9, 2]), torch.tensor([0, 7, 3, 4])  # not whole pages: the per-row plan
    if how.startswith("pool"):
        dp = make_device_pool("mha", 1152, torch.Generator().manual_seed(1))
        pool = make_host_pool(dp, page_size=4, layout="page_first_direct")
        if how == "pool load":
            pool.load_to_device_per_layer(dp, h, d, 1, "direct")
        else:
            pool.backup_from_device_all_layer(dp, h, d, "direct")
    elif how == "routed":
        with route.copy_engines_only():
            routed.transfer_kv_per_layer_mla(torch.zeros((16, 8), dtype=torch.int32),
                                             torch.zeros((16, 8), dtype=torch.int32), h, d, 32)
    else:
        hooks._copy_layer(torch.zeros((16, 8), dtype=torch.int32), h, torch.zeros((16, 8), dtype=torch.int32), d,
                          io_backend="direct", row_bytes=32)
    assert len(seen) == 2, seen


# ---------------------------------------------------------------------------
# The decisions.

def test_io_path_for_every_backend():
    for pool_path in ("kernel", "direct"):
        assert route.io_path("direct", "load", pool_path=pool_path, copy_bytes=1 << 20) == "direct"
        assert route.io_path("kernel", "load", pool_path=pool_path, copy_bytes=0) == pool_path
        assert route.io_path("auto", "backup", pool_path=pool_path, copy_bytes=0) == "direct"
    assert route.io_path("resident", "load", pool_path="kernel", copy_bytes=0) == "resident"
    assert route.io_path("resident", "load", pool_path="direct", copy_bytes=0) == "direct"
    assert route.io_path("auto", "load", pool_path="kernel", copy_bytes=1 << 20) == "kernel"
    # copies under SMALL_COPY_BYTES: the kernel at one CTA, where it works
    assert route.io_path("direct", "load", pool_path="kernel", copy_bytes=1152) == "kernel-small"
    assert route.io_path("direct", "load", pool_path="direct", copy_bytes=1152) == "direct"
    assert route.io_path("direct", "backup", pool_path="kernel", copy_bytes=1152, staged=True) == "direct"
    with pytest.raises(ValueError, match="Unsupported IO backend: 'kernel_ascend'"):
        route.io_path("kernel_ascend", "load", pool_path="kernel", copy_bytes=0)


def test_the_hooks_take_the_kernel_only_where_asked_and_available(monkeypatch):
    monkeypatch.setattr(route, "_verdicts", {1152: True, 656: False})
    assert route.hook_path("kernel", 1152) == "kernel"
    assert route.hook_path("direct", 1152) == "direct"
    assert route.hook_path("kernel", 656) == "direct"
    with route.copy_engines_only():
        assert route.hook_path("kernel", 1152) == "direct" and not route.kernel_available(1152)
        assert route.kernel_works(1152)  # the verdict itself ignores the scope (staging's gather uses it)
    asked = []
    monkeypatch.setattr(route, "probe", lambda size: asked.append(size) or type("R", (), {"available": True})())
    assert route.kernel_works(4096, before_probe=lambda: asked.append("before")) and asked == ["before", 4096]
    assert route.kernel_works(4096, before_probe=lambda: asked.append("again")) and asked == ["before", 4096]


@pytest.mark.parametrize("where, pages", [("page_first", True), ("layer_first", False), ("page_first_direct", True)])
def test_which_pool_backups_are_staged(where, pages):
    one_page = 64 * 8 * 1152
    assert route.pool_stages(where, layers=8, pinned=True, budget_bytes=2 * one_page, page_bytes=one_page) is pages
    assert not route.pool_stages(where, layers=8, pinned=True, budget_bytes=2 * one_page - 1, page_bytes=one_page)
    assert not route.pool_stages(where, layers=1, pinned=True, budget_bytes=1 << 30, page_bytes=one_page)
    assert not route.pool_stages(where, layers=8, pinned=False, budget_bytes=1 << 30, page_bytes=one_page)


def test_which_routed_backups_are_staged(monkeypatch):
    monkeypatch.setattr(route, "_verdicts", {1152: True, 656: False})
    cpu, host = torch.arange(4), torch.zeros(8, 4 * 1152, dtype=torch.uint8)
    stages = lambda **kw: route.routed_stages(**{"num_layers": 4, "layout_dim": 4 * 1152, "item_size": 1152,  # noqa
                                                  "indices": (cpu, cpu), "hosts": (host,), **kw})
    assert stages()
    assert not stages(num_layers=1, layout_dim=1152)
    assert not stages(layout_dim=5 * 1152)                 # not a packed page_first token
    assert not stages(item_size=656, layout_dim=4 * 656)   # the gather needs the kernel
    assert not stages(hosts=(host[:, ::2],))               # not one block


def test_layout_maps_are_plan_keys():
    """Two token -> row maps are one map exactly when their fields are equal (they are part of a plan's key)."""
    a = layout.token_rows("page_first_direct", layers=4, page_size=16, slots=1024)
    assert a == layout.TokenRows(16, 64, 1024) and hash(a) == hash(layout.TokenRows(16, 64, 1024))
    assert a != layout.token_rows("page_first_direct", layers=2, page_size=16, slots=1024)
    assert layout.token_rows("page_first", layers=4, page_size=16, slots=1024) is None
    assert a(torch.tensor([0, 17, -1])).tolist() == [0, 65, -1]


# ---------------------------------------------------------------------------
# SGLang's io_backend='direct': small copies take the kernel at SMALL_COPY_CTAS, not the copy engines.

def _direct_pairs(row_elems: int, *, host_strided: bool = False, pinned: bool = True):
    import fake_gpu

    device = fake_gpu.cuda(torch.zeros((64, row_elems), dtype=torch.int32))
    host = torch.zeros((64, 2, row_elems) if host_strided else (64, row_elems), dtype=torch.int32)
    host = host[:, 1] if host_strided else host
    return direct.Pairs([(device, fake_gpu.pinned(host) if pinned else host)])


def test_small_direct_copies_take_the_kernel_where_it_works(monkeypatch):
    monkeypatch.setattr(route, "_verdicts", {1152: True, 512: True, 656: False})
    small = _direct_pairs(288)  # 1152-B rows
    assert route.small_copies(small, page_size=1)
    assert route.small_copies(small, page_size=32)                    # 36 KiB pages
    assert not route.small_copies(small, page_size=64)                # 72 KiB pages: the copy engines
    assert route.small_copies(_direct_pairs(288, host_strided=True), page_size=64)  # page_first: one row a copy
    assert not route.small_copies(_direct_pairs(164), page_size=1)    # 656 B: the probe says no
    assert not route.small_copies(_direct_pairs(288, pinned=False))   # pageable host memory
    both_host = direct.Pairs([(torch.zeros((8, 288), dtype=torch.int32), torch.zeros((8, 288), dtype=torch.int32))])
    assert not route.small_copies(both_host)
    with route.copy_engines_only():                                   # the tests' scope: every copy
        assert not route.small_copies(small)
    with route.copy_engines_only(small_copies_on_kernel=True):       # SGLang's 'direct' held to the engines
        assert route.small_copies(small) and route.in_direct_scope()
    assert not route.in_direct_scope()


@pytest.mark.parametrize("scope", ["none", "engines-only", "direct"])
def test_routed_direct_ops_send_small_copies_to_the_kernel_at_one_cta(monkeypatch, scope):
    """transfer_kv_direct (SGLang's 'direct') and a routed kernel op inside the 'direct' scope run the kernel
    at SMALL_COPY_CTAS for 1152-B rows; a plain copy_engines_only() block and the kernel ops outside any
    scope keep their paths (the copy engines, the kernel at its default)."""
    import contextlib

    import fake_gpu

    monkeypatch.setattr(route, "_verdicts", {1152: True})
    kernel, engines = [], []
    monkeypatch.setattr(routed.ops, "transfer_one_layer_mla",
                        lambda dst, di, src, si, block_quota=None, **k: kernel.append((dst, di, src, si, block_quota)))
    monkeypatch.setattr(route, "copy", lambda *a, **k: engines.append(a))
    device = fake_gpu.cuda(torch.zeros((64, 288), dtype=torch.int32))
    host = fake_gpu.pinned(torch.zeros((64, 288), dtype=torch.int32))
    h, d = torch.tensor([5, 1, 9]), torch.tensor([0, 7, 3])
    context = {"none": contextlib.nullcontext(), "engines-only": route.copy_engines_only(),
               "direct": route.copy_engines_only(small_copies_on_kernel=True)}[scope]
    with context:
        routed.transfer_kv_direct([host], [device], h, d, page_size=1)
    if scope == "engines-only":
        assert engines and not kernel
    else:
        assert not engines and len(kernel) == 1 and kernel[0][4] == route.SMALL_COPY_CTAS
        assert kernel[0][0] is not None and torch.equal(kernel[0][1], d) and torch.equal(kernel[0][3], h)


def test_a_small_page_first_direct_load_maps_host_tokens_to_rows_for_the_kernel(monkeypatch):
    """transfer_kv_per_layer_direct_pf_lf with 8-token pages of 1152-B rows: the kernel gets the host rows
    (t // P) * L * P + t % P of the layer's view, and a token past the buffer raises before any launch."""
    import fake_gpu

    monkeypatch.setattr(route, "_verdicts", {1152: True})
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: True)  # the layer's view of a pinned
    launched = []                                                                   # buffer (a fake's view is not)
    monkeypatch.setattr(routed.ops, "transfer_one_layer_mla",
                        lambda dst, di, src, si, block_quota=None, **k: launched.append((di, si, block_quota)))
    layers, page, pages = 3, 8, 4
    host = fake_gpu.pinned(torch.zeros((pages, layers, page, 288), dtype=torch.int32))
    device = fake_gpu.cuda(torch.zeros((64, 288), dtype=torch.int32))
    tokens = torch.tensor([0, 9, 17, 31])
    routed.transfer_kv_per_layer_direct_pf_lf([host], [device], tokens, torch.tensor([1, 2, 3, 4]), 1, page)
    (dst_idx, src_idx, quota), = launched
    assert quota == route.SMALL_COPY_CTAS and dst_idx.tolist() == [1, 2, 3, 4]
    assert src_idx.tolist() == [(t // page) * layers * page + t % page for t in tokens.tolist()]
    with pytest.raises(TransferIndexError, match="src_indices"):
        routed.transfer_kv_per_layer_direct_pf_lf([host], [device], torch.tensor([pages * page]), torch.tensor([0]),
                                                  1, page)
    assert len(launched) == 1
