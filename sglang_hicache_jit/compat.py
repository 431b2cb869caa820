"""Drop-in replacements for SGLang's ``sglang.kernels.ops.kvcache.hicache`` (0.5.x).

Same function names, argument names and order, keyword-only options and
semantics, so SGLang can switch by changing one import::

    from sglang_hicache_jit.compat import (
        can_use_hicache_jit_kernel, transfer_hicache_all_layer, transfer_hicache_all_layer_mla,
        transfer_hicache_one_layer, transfer_hicache_one_layer_mla)

Differences, all in the direction of accepting more:
* any row size that is a multiple of 4 bytes works (upstream: multiples of
  128), and one build serves every row size;
* a negative index skips its pair (upstream reads out of bounds);
* indices may live on the CPU (moved to the GPU without a host sync);
* ``unroll`` and ``page_size`` are accepted and ignored: the kernels choose
  their own vector width and pipelining; ``block_quota`` is honoured, and
  None means this package's measured default (ops.DEFAULT_BLOCK_QUOTA), not
  upstream's 2.
"""

from __future__ import annotations

import logging

from . import ops
from .probe import probe

log = logging.getLogger(__name__)
_warned: set = set()


def can_use_hicache_jit_kernel(*, element_size: int, unroll: int | None = None, block_quota: int | None = None,
                               staged: bool = False) -> bool:
    """True when the kernels can copy rows of ``element_size`` bytes on the
    current GPU. Never raises; logs the reason once per row size and reason."""
    result = probe(element_size)
    if not result.available and (element_size, result.code) not in _warned:
        _warned.add((element_size, result.code))
        log.warning("JIT HiCache kernel unavailable for element_size=%s: [%s] %s", element_size, result.code,
                    result.reason)
    return result.available


def _rows(name: str, t, element_dim: int):
    try:
        return t.view(-1, element_dim)
    except (RuntimeError, AttributeError) as exc:
        raise ValueError(f"{name} cannot be viewed as rows of element_dim={element_dim}: {exc}") from None


def transfer_hicache_one_layer(k_cache_dst, v_cache_dst, indices_dst, k_cache_src, v_cache_src, indices_src, *,
                               element_dim: int | None = None, unroll: int | None = None,
                               block_quota: int | None = None, page_size: int | None = None) -> None:
    element_dim = element_dim or k_cache_dst.size(-1)
    ops.transfer_one_layer(
        _rows("k_cache_dst", k_cache_dst, element_dim), _rows("v_cache_dst", v_cache_dst, element_dim), indices_dst,
        _rows("k_cache_src", k_cache_src, element_dim), _rows("v_cache_src", v_cache_src, element_dim), indices_src,
        block_quota=block_quota)


def transfer_hicache_one_layer_mla(cache_dst, indices_dst, cache_src, indices_src, *,
                                   element_dim: int | None = None, unroll: int | None = None,
                                   block_quota: int | None = None, page_size: int | None = None) -> None:
    element_dim = element_dim or cache_dst.size(-1)
    ops.transfer_one_layer_mla(_rows("cache_dst", cache_dst, element_dim), indices_dst,
                               _rows("cache_src", cache_src, element_dim), indices_src, block_quota=block_quota)


def _element_size(element_size, src_stride: int, dst_stride: int, names: str) -> int:
    if element_size is not None:
        return element_size
    if src_stride != dst_stride:
        raise ValueError(f"element_size is required when {names} differ ({src_stride} != {dst_stride})")
    return dst_stride


def transfer_hicache_all_layer(k_ptr_dst, v_ptr_dst, indices_dst, k_ptr_src, v_ptr_src, indices_src, *,
                               kv_cache_src_stride_bytes: int, kv_cache_dst_stride_bytes: int,
                               element_size: int | None = None, unroll: int | None = None,
                               block_quota: int | None = None, page_size: int | None = None) -> None:
    size = _element_size(element_size, kv_cache_src_stride_bytes, kv_cache_dst_stride_bytes,
                         "kv_cache_src_stride_bytes and kv_cache_dst_stride_bytes")
    ops.transfer_pointer_tables((k_ptr_dst, v_ptr_dst), indices_dst, (k_ptr_src, v_ptr_src), indices_src,
                                dst_stride_bytes=kv_cache_dst_stride_bytes, src_stride_bytes=kv_cache_src_stride_bytes,
                                element_size=size, block_quota=block_quota)


def transfer_hicache_all_layer_mla(ptr_dst, indices_dst, ptr_src, indices_src, *, cache_src_stride_bytes: int,
                                   cache_dst_stride_bytes: int, element_size: int | None = None,
                                   unroll: int | None = None, block_quota: int | None = None,
                                   page_size: int | None = None) -> None:
    size = _element_size(element_size, cache_src_stride_bytes, cache_dst_stride_bytes,
                         "cache_src_stride_bytes and cache_dst_stride_bytes")
    ops.transfer_pointer_tables(ptr_dst, indices_dst, ptr_src, indices_src, dst_stride_bytes=cache_dst_stride_bytes,
                                src_stride_bytes=cache_src_stride_bytes, element_size=size, block_quota=block_quota)
