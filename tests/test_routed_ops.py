"""The routed SGLang ops without a GPU: what reaches this package's launch for each block_quota a caller gives."""

import logging

import pytest
import torch

from sglang_hicache_jit.integrations.sglang import ops as routed

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
