"""The routed SGLang ops without a GPU: what reaches this package's launch for each block_quota a caller gives."""

import logging

import pytest
import torch

from sglang_hicache_jit.integrations.sglang import ops as routed
from sglang_hicache_jit.transfer import route

ROW = 1152


@pytest.fixture
def launched(monkeypatch):
    """The block_quota each one-layer launch receives (the copy itself is the GPU tests' business)."""
    seen = []
    monkeypatch.setattr(routed, "_one_layer", lambda pairs, dst, src, item, block_quota: seen.append(block_quota))
    monkeypatch.delenv("SGLANG_HICACHE_BLOCK_QUOTA", raising=False)
    return seen


def _mla(**kwargs):
    rows = torch.zeros((8, ROW), dtype=torch.uint8)
    idx = torch.arange(4)
    routed.transfer_kv_per_layer_mla(rows, rows, idx, idx, ROW, **kwargs)
    routed.transfer_kv_per_layer_mla_pf_lf(rows.view(8, 1, ROW), rows, idx, idx, 0, ROW, ROW, **kwargs)


def test_left_out_means_the_measured_default(launched):
    _mla()
    assert launched == [None, None]


def test_sglang_block_quota_is_honoured_when_the_caller_leaves_it_out(launched, monkeypatch):
    # sgl-kernel 0.4.7+ reads SGLang's SGLANG_HICACHE_BLOCK_QUOTA for these two ops; so do the routed ones.
    monkeypatch.setenv("SGLANG_HICACHE_BLOCK_QUOTA", "6")
    _mla()
    _mla(block_quota=3)
    assert launched == [6, 6, 3, 3]


def test_other_ops_keep_their_default(launched, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_BLOCK_QUOTA", "6")
    rows = torch.zeros((8, 256), dtype=torch.uint8)
    routed.transfer_kv_per_layer(rows, rows, rows, rows, torch.arange(4), torch.arange(4), 256)
    assert launched == [None]


@pytest.mark.parametrize("value", ["abc", "0", "-2", "9" * 5000], ids=["letters", "zero", "negative", "5000-digits"])
def test_a_value_sglang_would_ignore_is_ignored_with_one_warning(launched, monkeypatch, caplog, value):
    monkeypatch.setenv("SGLANG_HICACHE_BLOCK_QUOTA", value)
    monkeypatch.setattr(routed, "_bad_block_quota_told", [])
    with caplog.at_level(logging.WARNING):
        _mla()
    assert launched == [None, None]
    assert sum("SGLANG_HICACHE_BLOCK_QUOTA" in r.getMessage() for r in caplog.records) == 1


# ---------------------------------------------------------------------------
# SGLang's direct ops on CPU tensors (the copy engines' plan, executed as slice copies).

PAGE, LAYERS, DIM = 4, 3, 8


def _direct_case(padded: bool):
    gen = torch.Generator().manual_seed(7 + padded)
    host = torch.randint(-1000, 1000, (10, LAYERS, PAGE, 1, DIM), generator=gen, dtype=torch.int32)
    dev = [torch.randint(-1000, 1000, (6 * PAGE, 1, DIM), generator=gen, dtype=torch.int32) for _ in range(LAYERS)]
    pages = lambda ids: (torch.tensor(ids)[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)  # noqa: E731
    h, d = pages([7, 2, 3]), pages([1, 0, 5])
    if padded:
        h[5] = -1  # a padded slot: not whole pages any more
    return host, dev, h, d


@pytest.mark.parametrize("padded", [False, True], ids=["whole-pages", "padded"])
def test_direct_ops_move_the_right_rows_planned_per_page_when_they_can(padded, monkeypatch):
    from sglang_hicache_jit.transfer import direct

    per_row = []
    row_runs = direct.row_runs
    monkeypatch.setattr(direct, "row_runs", lambda *a: per_row.append(1) or row_runs(*a))
    host, dev, h, d = _direct_case(padded)
    keep = h >= 0
    expected_host = host.clone()
    for layer in range(LAYERS):
        expected_host.view(-1, LAYERS, PAGE, 1, DIM)[h[keep] // PAGE, layer, h[keep] % PAGE] = dev[layer][d[keep]]
    routed.transfer_kv_all_layer_direct_lf_pf(dev, [host], d, h, PAGE)
    assert torch.equal(host, expected_host)
    expected_dev = dev[1].clone()
    expected_dev[d[keep]] = host[h[keep] // PAGE, 1, h[keep] % PAGE]
    dev[1].zero_()
    expected_dev[~torch.isin(torch.arange(dev[1].shape[0]), d[keep])] = 0
    routed.transfer_kv_per_layer_direct_pf_lf([host], [dev[1]], h, d, 1, PAGE)
    assert torch.equal(dev[1], expected_dev)
    flat = [t.view(-1, DIM).clone() for t in dev]
    out = [torch.zeros_like(t) for t in flat]
    routed.transfer_kv_direct(flat, out, d, d, PAGE)
    for src, dst in zip(flat, out):
        assert torch.equal(dst[d], src[d])
    assert bool(per_row) == padded  # whole pages never take the per-row plan


def test_a_direct_op_with_index_lists_of_two_lengths_names_both_and_copies_nothing():
    """The routed copy checks each index tensor once, under the op's own argument names, and then the lengths."""
    host, dev, h, d = _direct_case(False)
    flat = [t.view(-1, DIM).clone() for t in dev]
    out = [torch.zeros_like(t) for t in flat]
    with pytest.raises(ValueError, match=r"dst_indices has 11 entries but src_indices has 12"):
        routed.transfer_kv_direct(flat, out, d, d[:-1], PAGE)
    assert all(not t.any() for t in out)
    with pytest.raises(TypeError, match="dst_indices must be int32 or int64"):
        routed.transfer_kv_direct(flat, out, d, d.float(), PAGE)


def test_all_layer_backups_default_to_the_gpu_to_host_cta_budget(monkeypatch):
    """SGLang's all-layer ops are its backups (into host memory): left out, block_quota is ops.D2H_BLOCK_QUOTA
    (2, as upstream's kernel), and a caller's number stands."""
    seen = []
    monkeypatch.setattr(routed, "kernel_available", lambda size: True)
    monkeypatch.setattr(routed.ops, "transfer_pointer_tables", lambda *a, **k: seen.append(k["block_quota"]))
    tables = torch.zeros(3, dtype=torch.int64)
    idx = torch.arange(4)
    routed.transfer_kv_all_layer_mla(tables, tables, idx, idx, ROW, 3)
    routed.transfer_kv_all_layer_mla(tables, tables, idx, idx, ROW, 3, block_quota=7)
    routed.transfer_kv_all_layer(tables, tables, tables, tables, idx, idx, ROW, 3)
    assert seen == [routed.ops.D2H_BLOCK_QUOTA, 7, routed.ops.D2H_BLOCK_QUOTA] and routed.ops.D2H_BLOCK_QUOTA == 2


@pytest.mark.parametrize("element_size", [0, -4, True, 2.0, "576", None])
def test_can_use_write_back_jit_kernel_refuses_a_row_size_that_is_not_one(element_size, monkeypatch):
    monkeypatch.setattr(route, "kernel_works", lambda size, before_probe=None: True)
    assert routed.can_use_write_back_jit_kernel(element_size=element_size) is False


@pytest.mark.parametrize("staging, kernel, answer", [
    (None, True, True),      # the default budget, and the kernel gathers: SGLang keeps host indices on the CPU
    ("0", True, False),      # staging off: SGLang moves them to the GPU and the kernel backs up row by row
    (None, False, False),    # no kernel for these rows: nothing gathers
    ("lots", True, False),   # a bad setting never raises here (the plugin refuses it when it registers)
])
def test_can_use_write_back_jit_kernel_says_whether_staging_serves_the_write_back(staging, kernel, answer,
                                                                                  monkeypatch):
    monkeypatch.setattr(route, "kernel_works", lambda size, before_probe=None: kernel)
    if staging is None:
        monkeypatch.delenv("SGLANG_HICACHE_JIT_STAGING", raising=False)
    else:
        monkeypatch.setenv("SGLANG_HICACHE_JIT_STAGING", staging)
    assert routed.can_use_write_back_jit_kernel(element_size=576) is answer


def test_sglangs_staging_buffers_are_the_staging_area_only_where_they_fit():
    """route.write_back_memory_fits, the rule for SGLang's own staging buffers (64 pages, cut in two halves)."""
    layers, row = 4, 576
    token = layers * row

    def buffers(tokens, dtype=torch.bfloat16, n=2):
        return tuple(torch.empty((tokens, layers, row // 2), dtype=dtype) for _ in range(n))

    fits = lambda memory, **kw: route.write_back_memory_fits(  # noqa: E731
        memory, device=kw.get("device", torch.device("cpu")), dtype=torch.bfloat16, token_bytes=token)
    enough = 2 * route.WRITE_BACK_MIN_CHUNK_TOKENS
    assert fits(buffers(enough))
    assert not fits(buffers(enough - 1))  # a half below the minimum: the kernel writes the rows instead
    assert not fits(buffers(enough, torch.float16))  # not the host's dtype
    assert not fits(buffers(enough), device=torch.device("meta"))  # not on the gather's device
    assert not fits((buffers(enough)[0], buffers(enough - 1)[0]))  # the smaller of K and V decides
    strided = torch.empty((enough, layers, row), dtype=torch.bfloat16)[:, :, : row // 2]
    assert not fits((strided,))  # not contiguous
    assert not fits((torch.empty(enough * token // 2 + 1, dtype=torch.bfloat16),))  # not whole tokens
    assert not fits(("not a tensor",))
