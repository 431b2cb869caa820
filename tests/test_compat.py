"""The SGLang-compatible API: signatures (CPU) and upstream-style use (GPU)."""

import inspect

import pytest
import torch

from sglang_hicache_jit import compat

KW = inspect.Parameter.KEYWORD_ONLY
POS = inspect.Parameter.POSITIONAL_OR_KEYWORD

# Argument names and kinds of sglang.kernels.ops.kvcache.hicache in SGLang 0.5.23
# (test_sglang_integration.py compares against the installed module as well).
UPSTREAM = {
    "transfer_hicache_one_layer": (
        ["k_cache_dst", "v_cache_dst", "indices_dst", "k_cache_src", "v_cache_src", "indices_src"],
        ["element_dim", "unroll", "block_quota", "page_size"]),
    "transfer_hicache_one_layer_mla": (
        ["cache_dst", "indices_dst", "cache_src", "indices_src"],
        ["element_dim", "unroll", "block_quota", "page_size"]),
    "transfer_hicache_all_layer": (
        ["k_ptr_dst", "v_ptr_dst", "indices_dst", "k_ptr_src", "v_ptr_src", "indices_src"],
        ["kv_cache_src_stride_bytes", "kv_cache_dst_stride_bytes", "element_size", "unroll", "block_quota",
         "page_size"]),
    "transfer_hicache_all_layer_mla": (
        ["ptr_dst", "indices_dst", "ptr_src", "indices_src"],
        ["cache_src_stride_bytes", "cache_dst_stride_bytes", "element_size", "unroll", "block_quota", "page_size"]),
    "transfer_hicache_all_layer_staged_lf_pf": (
        ["k_ptr_src", "v_ptr_src", "src_indices", "dst_indices", "staging_k", "staging_v", "dst_k", "dst_v"],
        ["page_size", "element_size", "unroll", "block_quota"]),
    "transfer_hicache_all_layer_mla_staged_lf_pf": (
        ["ptr_src", "src_indices", "dst_indices", "staging", "dst"],
        ["page_size", "element_size", "unroll", "block_quota"]),
    "transfer_hicache_one_layer_page_unified_lf": (
        ["k_cache_dst", "v_cache_dst", "src", "src_indices", "dst_indices", "layer_id"], ["block_quota"]),
    "transfer_hicache_one_layer_mla_page_unified_lf": (
        ["cache_dst", "src", "src_indices", "dst_indices", "layer_id"], ["block_quota"]),
    "transfer_hicache_all_layer_staged_lf_page_unified": (
        ["k_ptr_src", "v_ptr_src", "src_pages", "dst_pages", "staging", "dst"], []),
    "transfer_hicache_all_layer_mla_staged_lf_page_unified": (
        ["ptr_src", "src_pages", "dst_pages", "staging", "dst"], []),
    "can_use_hicache_jit_kernel": ([], ["element_size", "unroll", "block_quota", "page_size"]),
    "can_use_write_back_jit_kernel": ([], ["element_size", "unroll", "block_quota"]),
    "can_use_page_unified_load_back_jit_kernel": ([], ["group_bytes", "block_quota"]),
}
REQUIRED_KW = {"kv_cache_src_stride_bytes", "kv_cache_dst_stride_bytes", "cache_src_stride_bytes",
               "cache_dst_stride_bytes", "page_size", "group_bytes"}


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_signature_matches_upstream(name):
    positional, keyword = UPSTREAM[name]
    params = inspect.signature(getattr(compat, name)).parameters
    assert [p for p, v in params.items() if v.kind == POS] == positional
    assert [p for p, v in params.items() if v.kind == KW] == keyword
    for p in keyword:
        required = params[p].default is inspect.Parameter.empty
        expect = (p in REQUIRED_KW and not (p == "page_size" and "staged_lf_pf" not in name)) or (
            p == "element_size" and name.startswith("can_use"))
        assert required == expect, p


def test_can_use_never_raises_and_says_no_for_bad_rows():
    assert compat.can_use_hicache_jit_kernel(element_size=6) is False
    assert isinstance(compat.can_use_hicache_jit_kernel(element_size=576), bool)
    assert isinstance(compat.can_use_hicache_jit_kernel(element_size=576, page_size=64), bool)
    for bad in ([576], 2.5, "288", None, -4):
        assert compat.can_use_hicache_jit_kernel(element_size=bad) is False


class _Hostile(int):
    """An int whose every Python-level hook raises."""

    def _raise(self, *args):
        raise RuntimeError("hostile int")

    __repr__ = __str__ = __index__ = __int__ = __hash__ = __eq__ = __format__ = _raise


@pytest.mark.parametrize("value", [576, 6, 0, -4])
def test_t7_can_use_never_raises_for_an_int_subclass_whose_hooks_raise(monkeypatch, value):
    """Issue 18, T7: repr(element_size) built the warning's key and raised."""
    from sglang_hicache_jit.probe import ProbeResult

    answers = []
    monkeypatch.setattr(compat, "probe", lambda size: answers.append(type(size)) or
                        ProbeResult(False, "no_cuda_device", "no GPU"))
    hostile = _Hostile(value)
    assert compat.can_use_hicache_jit_kernel(element_size=hostile) is False
    assert compat.can_use_write_back_jit_kernel(element_size=hostile) is False
    assert compat.can_use_page_unified_load_back_jit_kernel(group_bytes=hostile) is False
    assert answers == [int, int, int]  # the probe got a plain int

    def broken_probe(size):
        raise RuntimeError("a probe that breaks its promise")

    monkeypatch.setattr(compat, "probe", broken_probe)
    assert compat.can_use_hicache_jit_kernel(element_size=hostile) is False


def test_all_layer_needs_element_size_when_strides_differ():
    with pytest.raises(ValueError, match="element_size is required"):
        compat.transfer_hicache_all_layer_mla(None, None, None, None, cache_src_stride_bytes=1152,
                                              cache_dst_stride_bytes=9216)


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("element_dim", [1024, 288, 328, 64])  # bytes: 2048, 576, 656, 128 (fp16)
def test_upstream_style_round_trip(element_dim, index_dtype):
    """Mirrors SGLang's own test: sliced rows narrower than the stride, pointer tables, both directions."""
    layers, size = 4, 8192
    cuda_kv = torch.randn((2, layers, size, 1024), dtype=torch.float16, device="cuda")
    host_kv = torch.zeros((2, layers, 2 * size, 1024), dtype=torch.float16, pin_memory=True)
    cuda_view, host_view = cuda_kv[:, :, :, :element_dim], host_kv[:, :, :, :element_dim]
    stride_bytes = cuda_kv.stride(-2) * cuda_kv.element_size()
    src_idx = torch.randperm(size, device="cuda")[:777].sort().values.to(index_dtype)
    dst_idx = torch.randperm(2 * size, device="cuda")[:777].sort().values.to(index_dtype)

    compat.transfer_hicache_one_layer(host_view[0, 1], host_view[1, 1], dst_idx, cuda_view[0, 1], cuda_view[1, 1],
                                      src_idx)
    torch.cuda.synchronize()
    assert torch.equal(host_kv[:, 1, dst_idx.long().cpu(), :element_dim], cuda_kv[:, 1, src_idx.long(), :element_dim].cpu())
    assert int(host_kv[:, 1, :, element_dim:].count_nonzero()) == 0  # bytes past the row untouched

    table = lambda t, kv: torch.tensor([t[kv, l].data_ptr() for l in range(layers)], dtype=torch.uint64,  # noqa: E731
                                       device="cuda")
    back = torch.zeros_like(cuda_kv)
    compat.transfer_hicache_all_layer(table(back, 0), table(back, 1), src_idx, table(host_kv, 0), table(host_kv, 1),
                                      dst_idx, kv_cache_src_stride_bytes=stride_bytes,
                                      kv_cache_dst_stride_bytes=stride_bytes, element_size=element_dim * 2)
    torch.cuda.synchronize()
    assert torch.equal(back[:, 1, src_idx.long(), :element_dim], cuda_kv[:, 1, src_idx.long(), :element_dim])
    assert torch.equal(back[:, 0], torch.zeros_like(back[:, 0]))  # layer 0 of host_kv was still zero

    mla = torch.zeros((layers, 2 * size, element_dim), dtype=torch.float16, pin_memory=True)
    compat.transfer_hicache_one_layer_mla(mla[2], dst_idx, cuda_kv[0, 2, :, :element_dim], src_idx,
                                          element_dim=element_dim)
    compat.transfer_hicache_all_layer_mla(
        torch.tensor([mla[l].data_ptr() for l in range(layers)], dtype=torch.uint64, device="cuda"), dst_idx,
        table(cuda_kv, 0), src_idx, cache_src_stride_bytes=stride_bytes, cache_dst_stride_bytes=element_dim * 2,
        element_size=element_dim * 2)
    torch.cuda.synchronize()
    assert torch.equal(mla[3, dst_idx.long().cpu()], cuda_kv[0, 3, src_idx.long(), :element_dim].cpu())


# Issue 18: API errors that did not name the argument (a TypeError from '<=' between int and str, an
# AttributeError from a list, upstream's "Expected (page, ...)" with no argument named, a slice error for
# layer_id, "pass one table per cache on both sides").
_MLA_PAGES = torch.zeros(4, 2, 4, 8)                 # (page, layer, page_size, dim)
_MHA_PAGES = torch.zeros(2, 1, 2, 2, 4, 1, 8)       # (page, head_group, layer, 2, page_size, head_in_group, dim)
_IDX = torch.arange(4)
_CACHE = torch.zeros(16, 1, 8)
_KV = torch.zeros(16, 1, 8)


@pytest.mark.parametrize("call,error,argument", [
    (lambda: ops_module().set_tuning(bulk_warps="4"), TypeError, "bulk_warps"),
    (lambda: ops_module().set_tuning(read_align=32.0), TypeError, "read_align"),
    (lambda: ops_module().transfer_pointer_tables((_IDX, _IDX), _IDX, _IDX, _IDX, dst_stride_bytes=4,
                                                  src_stride_bytes=4, element_size=4), ValueError, "tables_dst"),
    (lambda: compat.transfer_hicache_one_layer_mla_page_unified_lf(_CACHE, _MLA_PAGES, _IDX, _IDX, "0"),
     TypeError, "layer_id"),
    (lambda: compat.transfer_hicache_one_layer_mla_page_unified_lf(_CACHE, _MLA_PAGES, _IDX, _IDX, 2),
     ValueError, "layer_id"),
    (lambda: compat.transfer_hicache_one_layer_mla_page_unified_lf(_CACHE, _MLA_PAGES, _IDX, _IDX, -1),
     ValueError, "layer_id"),
    (lambda: compat.transfer_hicache_one_layer_mla_page_unified_lf(_CACHE, [1], _IDX, _IDX, 0), TypeError, "src"),
    (lambda: compat.transfer_hicache_one_layer_mla_page_unified_lf(_CACHE, _MLA_PAGES[0], _IDX, _IDX, 0),
     ValueError, "src"),
    (lambda: compat.transfer_hicache_one_layer_mla_page_unified_lf(_CACHE, _MLA_PAGES.transpose(1, 2), _IDX,
                                                                  _IDX, 0), ValueError, "src"),
    (lambda: compat.transfer_hicache_one_layer_mla_page_unified_lf(_CACHE, _MLA_PAGES, [0], _IDX, 0),
     TypeError, "src_indices"),
    (lambda: compat.transfer_hicache_one_layer_mla_page_unified_lf("x", _MLA_PAGES, _IDX, _IDX, 0), TypeError,
     "cache_dst"),
    (lambda: compat.transfer_hicache_one_layer_page_unified_lf(_KV, _KV, _MHA_PAGES, _IDX, _IDX, 5), ValueError,
     "layer_id"),
    (lambda: compat.transfer_hicache_one_layer_page_unified_lf(_KV, _KV, _MHA_PAGES[:, :, :, :1], _IDX, _IDX, 0),
     ValueError, "src"),
    (lambda: compat.transfer_hicache_all_layer_mla_staged_lf_page_unified(_IDX, _IDX, _IDX, _MLA_PAGES,
                                                                          _MLA_PAGES[0]), ValueError, "dst"),
    (lambda: compat.transfer_hicache_all_layer_mla_staged_lf_page_unified(_IDX, _IDX, _IDX, _MLA_PAGES[0],
                                                                          _MLA_PAGES), ValueError, "staging"),
    (lambda: compat.transfer_hicache_all_layer_staged_lf_page_unified(_IDX, _IDX, _IDX, _IDX, _MHA_PAGES,
                                                                      _MHA_PAGES), ValueError, "staging"),
    (lambda: compat.transfer_hicache_one_layer_mla_page_unified_lf(_CACHE, _MLA_PAGES.to("meta"), _IDX, _IDX, 0),
     ValueError, "src"),
], ids=["set_tuning-str", "set_tuning-float", "tables-count", "pu-layer-str", "pu-layer-range", "pu-layer-neg",
        "pu-src-list", "pu-src-3d", "pu-src-strided", "pu-indices-list", "pu-cache-str", "pu-mha-layer",
        "pu-mha-kv-dim", "wb-dst-3d", "wb-staging-3d", "wb-staging-cpu", "pu-src-meta"])
def test_api_errors_name_the_argument(call, error, argument):
    import re

    with pytest.raises(error) as info:
        call()
    assert re.search(rf"\b{argument}\b", str(info.value)), str(info.value)


def ops_module():
    from sglang_hicache_jit import ops

    return ops


def test_staged_geometry_reads_rows_from_the_shapes_and_names_a_flat_staging_buffer():
    """staged_geometry: (row bytes, bytes per token across layers) from the shapes, as upstream reads them from
    ``staging[0, 0]`` and ``dst[0, 0]``; a staging buffer without a layer dimension is refused naming it (it
    raised IndexError: "too many indices")."""
    from sglang_hicache_jit.integrations import compat as icompat

    dst = torch.zeros(16, 3, 8, 128, dtype=torch.bfloat16)  # (slots, layers, heads, dim)
    staging = torch.zeros(4, 3, 8, 128, dtype=torch.bfloat16)
    assert icompat.staged_geometry(staging, dst, None) == (dst[0, 0].numel() * 2, 3 * dst[0, 0].numel() * 2)
    flat_rows = torch.zeros(16, 3, 1, dtype=torch.float32)  # one element per row: staging[0, 0] of a 2-D buffer
    assert icompat.staged_geometry(torch.zeros(4, 3, dtype=torch.float32), flat_rows, None) == (4, 12)
    with pytest.raises(ValueError, match="staging must be a staging buffer"):
        icompat.staged_geometry(torch.zeros(8, dtype=torch.bfloat16), dst, None)
    with pytest.raises(ValueError, match="element_size is 512 bytes but a row of dst is 2048 bytes"):
        icompat.staged_geometry(torch.zeros(4, 3, 2, 128, dtype=torch.bfloat16), dst, None)
