"""The transfer functions SGLang's host pools call once the plugin is active.

Why one long module: each function mirrors one upstream signature under the name SGLang imports it
by, routed to the kernel or the copy engines by the same few helpers; matching.py checks them per
release against this one list.

Two families, each under the name SGLang imports it by, taking every call
the upstream signature takes in the releases the plugin supports (parameter
names, kinds, order and defaults; ``matching.py`` checks this per release):

* ``sglang.kernels.ops.kvcache.hicache`` (``sglang.jit_kernel.hicache``
  up to 0.5.16), the JIT ops: ``can_use_*`` and the ``transfer_hicache_*``
  functions;
* ``sgl_kernel.kvcacheio`` (the ahead-of-time package): ``transfer_kv_*``.

Every transfer runs this package's JIT kernel when the probe says ``ok`` for
its row size, and the GPU's copy engines (``direct.py``) otherwise (the
choice, and the copy engines' plans, are ``transfer/route.py``'s), so no
call depends on sgl-kernel, and no row size or kernel failure makes a pool
raise. That is why the routed ``can_use_hicache_jit_kernel`` answers True for
any positive row size: the "JIT" names can always be served. The routed
``can_use_write_back_jit_kernel`` answers True where the kernel runs for the
rows and staging is on: SGLang then keeps a page_first backup's host indices
on the CPU and calls ``transfer_hicache_all_layer*_staged_lf_pf`` with the
staging buffers it allocated (64 pages x all layers: about 288 MB for
DeepSeek-V3 at page 64, as upstream), which this package's staging area
(``transfer/staging.py``) uses: a gather by the kernel into them, then whole
tokens to the host on the copy engines. Without host indices on the CPU, a
page_first backup would be the kernel writing every row to the host, 0.7 of
the staged rate (docs/BENCHMARKS.md).

Pointer tables carry no size: every op that takes one finds the allocation
each address lies in (``transfer/pointer_tables.py``), bounds each side's
indices by it before anything is copied, and copies through the addresses that
were checked (a CUDA table is read once, one device sync, and again only when
torch sees it change; a CPU table is compared on every call).
"""

from __future__ import annotations

import logging
import math
import threading
import weakref

import torch

from . import announce
from .. import compat
from ... import settings
from ...transfer import bounds, direct, ops, pointer_tables, route
from ...transfer import layout as host_layout
from ...transfer.abi import D2H_BLOCK_QUOTA
from ...errors import BadSettingError
from ...transfer.route import copy_engines_only  # noqa: F401  (the plugin's hooks and tests enter it from here)

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# Path choice.

def kernel_available(element_size: int) -> bool:
    """Whether rows of ``element_size`` bytes go through the JIT kernel (route.kernel_available): asked once
    per row size and process (``reset()`` forgets); the first question logs the plugin's start line."""
    return route.kernel_available(element_size, before_probe=announce.flush)


def reset() -> None:
    """Forgets the per-row-size choices, the copy engines' plans and the checked pointer tables (tests, or after
    a clean)."""
    route.reset()
    pointer_tables.clear()
    with _stagings_lock:
        _stagings.clear()


def path_for(element_size: int) -> str:
    """'kernel' or 'direct': what rows of this size use now."""
    return "kernel" if kernel_available(element_size) else "direct"


# ---------------------------------------------------------------------------
# Copy-engine helpers.

def _raw_pairs(dst_table, src_table, dst_stride: int, src_stride: int, row_bytes: int, *, names: tuple,
               dst_rows=None) -> list:
    """(dst, src) rows per layer of two pointer tables (the arguments ``names``), each side bounded by the
    rows its allocations hold (pointer_tables.py) and the destination by ``dst_rows`` where the caller knows it."""
    dst, src = pointer_tables.checked(dst_table, names[0]), pointer_tables.checked(src_table, names[1])
    if dst.count != src.count:
        raise ValueError(f"{names[0]} has {dst.count} layers but {names[1]} has {src.count}; they must match")
    rows = dst.rows(dst_stride, row_bytes, names[0])
    if dst_rows is not None:
        rows = min(rows, dst_rows)
    device = src.device if src.device is not None else dst.device
    src_rows = src.rows(src_stride, row_bytes, names[1])
    return [(direct.Rows.at(d, dst_stride, row_bytes, device, rows),
             direct.Rows.at(s, src_stride, row_bytes, device, src_rows))
            for d, s in zip(dst.addresses, src.addresses)]


def _copy(pairs, indices_dst, indices_src, *, page_size: int = 1, dst_rows=None, src_rows=None,
          names: tuple = ("indices_dst", "indices_src"), direct_backend: bool = False) -> None:
    """The copy engines (route.copy: planned once per index bytes, so the layers of one load share a plan),
    after checking the indices once: integer tensors on the CPU or the pairs' GPU (bounds.py), ``names``
    naming them. ``dst_rows`` / ``src_rows``: a side's layout.TokenRows. For SGLang's io_backend='direct'
    (``direct_backend``, or a copy_engines_only(small_copies_on_kernel=True) block) copies that the copy
    engines would take one small copy at a time go to the kernel at SMALL_COPY_CTAS (route.small_copies)."""
    pairs = direct.Pairs(pairs)
    bounds.check_index_tensor(names[0], indices_dst, pairs.device)
    bounds.check_index_tensor(names[1], indices_src, pairs.device)
    direct.same_length(indices_dst, indices_src, names)
    if ((direct_backend or route.in_direct_scope())
            and route.small_copies(pairs, page_size, before_probe=announce.flush)):
        _small_copies(pairs, indices_dst, indices_src, dst_rows, src_rows)
        return
    route.copy(pairs, indices_dst, indices_src, page_size=page_size, dst_map=dst_rows, src_map=src_rows)


def _small_copies(pairs: direct.Pairs, indices_dst, indices_src, dst_map, src_map) -> None:
    """Every pair through the kernel at SMALL_COPY_CTAS CTA, the token maps applied to the indices first (a
    token outside its buffer raises, or on the GPU becomes a row the kernel refuses)."""
    dst_idx = indices_dst if dst_map is None else dst_map(indices_dst)
    src_idx = indices_src if src_map is None else src_map(indices_src)
    for dst, src in zip(pairs.dst, pairs.src):
        ops.transfer_one_layer_mla(_rows2d(dst.tensor), dst_idx, _rows2d(src.tensor), src_idx,
                                   block_quota=route.SMALL_COPY_CTAS)


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 2 else t.view(t.shape[0], -1)


def _view_rows(t: torch.Tensor, row_elems: int) -> torch.Tensor:
    return t.view(-1, row_elems) if t.dim() != 2 or t.shape[1] != row_elems else t


def layer_of(buffer: torch.Tensor, layer_id: int, item_size: int, layout_dim: int, name: str = "src") -> torch.Tensor:
    """Rows of one layer inside a page_first buffer: ``(slots, row)``, stride ``layout_dim`` bytes."""
    compat._cache(name, buffer)
    compat._positive("item_size", item_size)
    itemsize = buffer.element_size()
    flat = buffer.view(buffer.shape[0], -1)
    if flat.shape[1] * itemsize != layout_dim:
        raise ValueError(f"a token of {name} holds {flat.shape[1] * itemsize} bytes, not "
                         f"src_layout_dim={layout_dim}")
    if item_size % itemsize or layout_dim % item_size:
        raise ValueError(f"item_size={item_size} must be a whole number of {buffer.dtype} elements and divide "
                         f"src_layout_dim={layout_dim} (one row per layer)")
    # In range, or flat[:, -2 * e:] would be layer L-2 (Python's negative indexing) and layer L past the end.
    layer_id = bounds.check_layer(layer_id, layout_dim // item_size, pool=f"{name} (a page_first buffer)")
    e = item_size // itemsize
    return host_layout.layer_rows(flat.view(flat.shape[0], layout_dim // item_size, e), "page_first", layer_id)


# ---------------------------------------------------------------------------
# sglang.kernels.ops.kvcache.hicache, routed.

def can_use_hicache_jit_kernel(
    *,
    element_size: int,
    unroll: int | None = None,
    block_quota: int | None = None,
    page_size: int | None = None,
) -> bool:
    """True for any positive row size: the routed transfers below serve it
    with the kernel or the copy engines. Never raises."""
    try:
        ok = not isinstance(element_size, bool) and isinstance(element_size, int) and element_size > 0
        if ok:
            kernel_available(element_size)  # probe (and maybe build) now, not on the first transfer
        return ok
    except Exception as exc:  # must never raise
        log.warning("sglang-hicache-jit: probe failed: %s", exc)
        return True


def can_use_write_back_jit_kernel(
    *,
    element_size: int,
    unroll: int | None = None,
    block_quota: int | None = None,
) -> bool:
    """Whether SGLang's staged write-back (page_first backups whose host indices stay on the CPU) is served
    through this package's staging area: where the kernel runs for these rows (it gathers) and staging is on
    (``SGLANG_HICACHE_JIT_STAGING`` not 0). Never raises."""
    try:
        if isinstance(element_size, bool) or not isinstance(element_size, int) or element_size <= 0:
            return False
        return route.write_back_staged(element_size, before_probe=announce.flush)
    except Exception as exc:  # must never raise; the pools then back up through the kernel
        log.warning("sglang-hicache-jit: staged write-back unavailable: %s", exc)
        return False


def transfer_hicache_one_layer(
    k_cache_dst: torch.Tensor,
    v_cache_dst: torch.Tensor,
    indices_dst: torch.Tensor,
    k_cache_src: torch.Tensor,
    v_cache_src: torch.Tensor,
    indices_src: torch.Tensor,
    *,
    element_dim: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
    page_size: int | None = None,
) -> None:
    element_dim = compat._element_dim(element_dim, k_cache_dst, "k_cache_dst")
    if kernel_available(element_dim * k_cache_dst.element_size()):
        # ops directly, not through compat: this is the per-layer hot path (one frame less).
        ops.transfer_one_layer(k_cache_dst, v_cache_dst, indices_dst, k_cache_src, v_cache_src, indices_src,
                               element_dim=element_dim, block_quota=block_quota)
        return
    compat._whole_rows(element_dim, v_cache_dst=v_cache_dst, k_cache_src=k_cache_src, v_cache_src=v_cache_src)
    _copy([(_view_rows(k_cache_dst, element_dim), _view_rows(k_cache_src, element_dim)),
           (_view_rows(v_cache_dst, element_dim), _view_rows(v_cache_src, element_dim))], indices_dst, indices_src)


def transfer_hicache_one_layer_mla(
    cache_dst: torch.Tensor,
    indices_dst: torch.Tensor,
    cache_src: torch.Tensor,
    indices_src: torch.Tensor,
    *,
    element_dim: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
    page_size: int | None = None,
) -> None:
    element_dim = compat._element_dim(element_dim, cache_dst, "cache_dst")
    if kernel_available(element_dim * cache_dst.element_size()):
        ops.transfer_one_layer_mla(cache_dst, indices_dst, cache_src, indices_src, element_dim=element_dim,
                                   block_quota=block_quota)
        return
    compat._whole_rows(element_dim, cache_src=cache_src)
    _copy([(_view_rows(cache_dst, element_dim), _view_rows(cache_src, element_dim))], indices_dst, indices_src)


def transfer_hicache_all_layer(
    k_ptr_dst: torch.Tensor,
    v_ptr_dst: torch.Tensor,
    indices_dst: torch.Tensor,
    k_ptr_src: torch.Tensor,
    v_ptr_src: torch.Tensor,
    indices_src: torch.Tensor,
    *,
    kv_cache_src_stride_bytes: int,
    kv_cache_dst_stride_bytes: int,
    element_size: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
    page_size: int | None = None,
) -> None:
    size = compat._element_size(element_size, kv_cache_src_stride_bytes, kv_cache_dst_stride_bytes,
                                "kv_cache_src_stride_bytes and kv_cache_dst_stride_bytes")
    if kernel_available(size):
        compat.transfer_hicache_all_layer(k_ptr_dst, v_ptr_dst, indices_dst, k_ptr_src, v_ptr_src, indices_src,
                                          kv_cache_src_stride_bytes=kv_cache_src_stride_bytes,
                                          kv_cache_dst_stride_bytes=kv_cache_dst_stride_bytes, element_size=size,
                                          block_quota=block_quota)
        return
    _copy(_raw_pairs(k_ptr_dst, k_ptr_src, kv_cache_dst_stride_bytes, kv_cache_src_stride_bytes, size,
                     names=("k_ptr_dst", "k_ptr_src"))
          + _raw_pairs(v_ptr_dst, v_ptr_src, kv_cache_dst_stride_bytes, kv_cache_src_stride_bytes, size,
                       names=("v_ptr_dst", "v_ptr_src")),
          indices_dst, indices_src)


def transfer_hicache_all_layer_mla(
    ptr_dst: torch.Tensor,
    indices_dst: torch.Tensor,
    ptr_src: torch.Tensor,
    indices_src: torch.Tensor,
    *,
    cache_src_stride_bytes: int,
    cache_dst_stride_bytes: int,
    element_size: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
    page_size: int | None = None,
) -> None:
    size = compat._element_size(element_size, cache_src_stride_bytes, cache_dst_stride_bytes,
                                "cache_src_stride_bytes and cache_dst_stride_bytes")
    if kernel_available(size):
        compat.transfer_hicache_all_layer_mla(ptr_dst, indices_dst, ptr_src, indices_src,
                                              cache_src_stride_bytes=cache_src_stride_bytes,
                                              cache_dst_stride_bytes=cache_dst_stride_bytes, element_size=size,
                                              block_quota=block_quota)
        return
    _copy(_raw_pairs(ptr_dst, ptr_src, cache_dst_stride_bytes, cache_src_stride_bytes, size,
                     names=("ptr_dst", "ptr_src")), indices_dst, indices_src)


def _staged_pairs(ptr_src, dst, size, name: str) -> list:
    """(host layer rows, raw device rows) per layer of a staged write-back, for the copy engines."""
    table = pointer_tables.checked(ptr_src, name)
    if table.count != dst.shape[1]:
        raise ValueError(f"{name} has {table.count} layers but the host buffer holds {dst.shape[1]}")
    rows = table.rows(size, size, name)
    layers = dst.view(dst.shape[0], dst.shape[1], -1)
    return [(layers[:, layer], direct.Rows.at(src, size, size, table.device, rows))
            for layer, src in enumerate(table.addresses)]


def transfer_hicache_all_layer_staged_lf_pf(
    k_ptr_src: torch.Tensor,
    v_ptr_src: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    staging_k: torch.Tensor,
    staging_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    *,
    page_size: int,
    element_size: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
) -> None:
    size, layout_dim = compat.staged_geometry(staging_k, dst_k, element_size)
    if kernel_available(size):
        if not _staged_lf_pf((dst_k, dst_v), (k_ptr_src, v_ptr_src), dst_indices, src_indices, size, layout_dim,
                             dst_k.shape[1], memory=(staging_k, staging_v), write_back=True):
            compat.transfer_hicache_all_layer_staged_lf_pf(k_ptr_src, v_ptr_src, src_indices, dst_indices,
                                                           staging_k, staging_v, dst_k, dst_v, page_size=page_size,
                                                           element_size=size, block_quota=block_quota)
        return
    _copy(_staged_pairs(k_ptr_src, dst_k, size, "k_ptr_src") + _staged_pairs(v_ptr_src, dst_v, size, "v_ptr_src"),
          dst_indices, src_indices, names=("dst_indices", "src_indices"))


def transfer_hicache_all_layer_mla_staged_lf_pf(
    ptr_src: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    staging: torch.Tensor,
    dst: torch.Tensor,
    *,
    page_size: int,
    element_size: int | None = None,
    unroll: int | None = None,
    block_quota: int | None = None,
) -> None:
    size, layout_dim = compat.staged_geometry(staging, dst, element_size)
    if kernel_available(size):
        if not _staged_lf_pf((dst,), (ptr_src,), dst_indices, src_indices, size, layout_dim, dst.shape[1],
                             memory=(staging,), write_back=True):
            compat.transfer_hicache_all_layer_mla_staged_lf_pf(ptr_src, src_indices, dst_indices, staging, dst,
                                                               page_size=page_size, element_size=size,
                                                               block_quota=block_quota)
        return
    _copy(_staged_pairs(ptr_src, dst, size, "ptr_src"), dst_indices, src_indices,
          names=("dst_indices", "src_indices"))


HICACHE_OPS = (
    "can_use_hicache_jit_kernel",
    "can_use_write_back_jit_kernel",
    "transfer_hicache_one_layer",
    "transfer_hicache_one_layer_mla",
    "transfer_hicache_all_layer",
    "transfer_hicache_all_layer_mla",
    "transfer_hicache_all_layer_staged_lf_pf",
    "transfer_hicache_all_layer_mla_staged_lf_pf",
)


# ---------------------------------------------------------------------------
# sgl_kernel.kvcacheio, routed. ``block_quota`` and ``num_warps_per_block``
# are upstream's launch knobs. ``block_quota`` is the number of CTAs: left
# out (None), it is this kernel's measured default, except that the two MLA
# per-layer ops honour SGLang's SGLANG_HICACHE_BLOCK_QUOTA the way sgl-kernel
# 0.4.7+ does; a number is passed on. Warps per block are this kernel's own.

_bad_block_quota_told: list = []


def _sglang_block_quota():
    """SGLANG_HICACHE_BLOCK_QUOTA, or None. Like sgl-kernel, a value that does not parse means the default."""
    try:
        return settings.sglang_block_quota()
    except BadSettingError as exc:
        if not _bad_block_quota_told:
            _bad_block_quota_told.append(True)
            log.warning("sglang-hicache-jit: %s; using the measured default CTAs", exc)
        return None


def _one_layer(pairs_kv: list, indices_dst, indices_src, item_size: int, block_quota) -> None:
    """Copies one layer: ``pairs_kv`` = [(dst_rows, src_rows)] for MLA or K and V."""
    if kernel_available(item_size):
        if len(pairs_kv) == 1:
            (dst, src), = pairs_kv
            ops.transfer_one_layer_mla(dst, indices_dst, src, indices_src, block_quota=block_quota)
        else:
            (kd, ks), (vd, vs) = pairs_kv
            ops.transfer_one_layer(kd, vd, indices_dst, ks, vs, indices_src, block_quota=block_quota)
        return
    _copy(pairs_kv, indices_dst, indices_src, names=("dst_indices", "src_indices"))


def _packed_rows(t: torch.Tensor, item_size: int, name: str) -> torch.Tensor:
    compat._cache(name, t)
    compat._positive("item_size", item_size)
    itemsize = t.element_size()
    if item_size % itemsize:
        raise ValueError(f"item_size={item_size} is not a whole number of {t.dtype} elements")
    rows = t.view(t.shape[0], -1) if t.dim() > 1 else t.view(-1, item_size // itemsize)
    if rows.shape[1] * itemsize != item_size:
        raise ValueError(f"{name}: a slot holds {rows.shape[1] * itemsize} bytes, not item_size={item_size}")
    return rows


def transfer_kv_per_layer(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size, block_quota=None,
                          num_warps_per_block=32):
    _one_layer([(_packed_rows(dst_k, item_size, "dst_k"), _packed_rows(src_k, item_size, "src_k")),
                (_packed_rows(dst_v, item_size, "dst_v"), _packed_rows(src_v, item_size, "src_v"))],
               dst_indices, src_indices, item_size, block_quota)


def transfer_kv_per_layer_pf_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size,
                                src_layout_dim, block_quota=None, num_warps_per_block=32):
    _one_layer([(_packed_rows(dst_k, item_size, "dst_k"), layer_of(src_k, layer_id, item_size, src_layout_dim, "src_k")),
                (_packed_rows(dst_v, item_size, "dst_v"), layer_of(src_v, layer_id, item_size, src_layout_dim, "src_v"))],
               dst_indices, src_indices, item_size, block_quota)


def transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size, block_quota=None,
                              num_warps_per_block=32):
    if block_quota is None:
        block_quota = _sglang_block_quota()
    _one_layer([(_packed_rows(dst, item_size, "dst"), _packed_rows(src, item_size, "src"))], dst_indices,
               src_indices, item_size, block_quota)


def transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim,
                                    block_quota=None, num_warps_per_block=32):
    if block_quota is None:
        block_quota = _sglang_block_quota()
    _one_layer([(_packed_rows(dst, item_size, "dst"), layer_of(src, layer_id, item_size, src_layout_dim))],
               dst_indices, src_indices, item_size, block_quota)


def _all_layers(dst_tables, src_tables, indices_dst, indices_src, *, dst_stride, src_stride, item_size,
                block_quota, names: tuple, dst_rows=None) -> None:
    """``names``: the tables' argument names, (destination names, source names); ``dst_rows``: the
    destination's slot count where the caller holds it as a tensor (the host buffer of a page_first
    write-back), so that both paths check indices_dst against it, besides its allocations."""
    # SGLang's all-layer ops are its backups, into host memory: the kernel's default there (as upstream's)
    # is the CTA budget with the most link per point of matmul slowdown (transfer/abi.py, D2H_BLOCK_QUOTA).
    if block_quota is None:
        block_quota = D2H_BLOCK_QUOTA
    if kernel_available(item_size):
        ops.transfer_pointer_tables(dst_tables if len(dst_tables) > 1 else dst_tables[0], indices_dst,
                                    src_tables if len(src_tables) > 1 else src_tables[0], indices_src,
                                    dst_stride_bytes=dst_stride, src_stride_bytes=src_stride, element_size=item_size,
                                    block_quota=block_quota, dst_rows=dst_rows, names=names)
        return
    pairs = []
    for d, s, dst_name, src_name in zip(dst_tables, src_tables, *names):
        pairs += _raw_pairs(d, s, dst_stride, src_stride, item_size, names=(dst_name, src_name), dst_rows=dst_rows)
    _copy(pairs, indices_dst, indices_src, names=("dst_indices", "src_indices"))


def _check_layers(num_layers, *tables) -> None:
    compat._positive("num_layers", num_layers)
    for t in tables:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"a pointer table must be a torch.Tensor of uint64 addresses, got {type(t).__name__}")
        if t.numel() != num_layers:
            raise ValueError(f"num_layers={num_layers} but a pointer table holds {t.numel()} layers")


def transfer_kv_all_layer(src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices, dst_indices,
                          item_size, num_layers, block_quota=None, num_warps_per_block=32):
    _check_layers(num_layers, src_k_layers, dst_k_layers, src_v_layers, dst_v_layers)
    _all_layers((dst_k_layers, dst_v_layers), (src_k_layers, src_v_layers), dst_indices, src_indices,
                dst_stride=item_size, src_stride=item_size, item_size=item_size, block_quota=block_quota,
                names=(("dst_k_layers", "dst_v_layers"), ("src_k_layers", "src_v_layers")))


def transfer_kv_all_layer_mla(src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers,
                              block_quota=None, num_warps_per_block=32):
    _check_layers(num_layers, src_layers, dst_layers)
    _all_layers((dst_layers,), (src_layers,), dst_indices, src_indices, dst_stride=item_size, src_stride=item_size,
                item_size=item_size, block_quota=block_quota, names=(("dst_layers",), ("src_layers",)))


_stagings: dict = {}  # staging.PageStaging per (host buffers, device pointer tables), for page_first backups
_stagings_lock = threading.Lock()


def _staged_lf_pf(hosts: tuple, src_tables: tuple, dst_indices, src_indices, item_size: int, layout_dim: int,
                  num_layers: int, memory: tuple | None = None, write_back: bool = False) -> bool:
    """A page_first backup through the device staging area (transfer/staging.py: a gather by the kernel, then
    flat copies of whole pages on the copy engines), where route.routed_stages says it applies and there is
    room for a token; False: the caller copies rows. ``dst_indices`` (host slots) must be on the CPU, where the
    runs of slots are read without waiting for the GPU. ``write_back``: SGLang's staged write-back, whose
    ``src_indices`` may be on the GPU (the gather bounds them there, and a negative one is an error, not
    padding: staging.PageStaging.backup); elsewhere GPU indices go to the kernel's backup. ``memory``: SGLang's
    own staging buffers for this pool (the write-back's), the staging area where route.write_back_memory_fits
    (else False), so the plugin needs no GPU memory beyond upstream's; without them
    (SGLang's kvcacheio ops) the area is the budget's (``SGLANG_HICACHE_JIT_STAGING``)."""
    device = src_tables[0].device.index if src_tables[0].is_cuda else None
    bounds.check_index_tensor("dst_indices", dst_indices, device)  # before the staging area reads them as int64
    bounds.check_index_tensor("src_indices", src_indices, device)
    if dst_indices.numel() != src_indices.numel():
        raise ValueError(f"dst_indices has {dst_indices.numel()} entries but src_indices has {src_indices.numel()}; "
                         "they must have the same length")
    if dst_indices.is_cuda or (src_indices.is_cuda and not write_back):
        return False  # the kernel's backup, whose launch checks them
    if not route.routed_stages(num_layers=num_layers, layout_dim=layout_dim, item_size=item_size,
                               indices=(dst_indices,), hosts=hosts, before_probe=announce.flush):
        return False
    budget = settings.staging_bytes()
    if not budget:
        return False  # SGLANG_HICACHE_JIT_STAGING=0: staging is off, SGLang's buffers included
    if memory is not None and not route.write_back_memory_fits(memory, device=src_tables[0].device,
                                                               dtype=hosts[0].dtype, token_bytes=num_layers * item_size):
        return False
    # The device rows every layer's allocation holds: the staging area checks src_indices against them.
    device_rows = min(pointer_tables.checked(t, name).rows(item_size, item_size, name)
                      for t, name in zip(src_tables, ("src_k_layers", "src_v_layers") if len(src_tables) > 1
                                         else ("src_layers",)))
    key = (tuple(h.data_ptr() for h in hosts) + tuple(t.data_ptr() for t in src_tables)
           + (item_size, num_layers, device_rows) + tuple(m.data_ptr() for m in memory or ()))
    with _stagings_lock:
        entry = _stagings.get(key)
        owner = compat._root(hosts[0])  # SGLang may pass a fresh view of its buffer on every call
        if entry is None or entry[0]() is not owner or entry[1] != budget:
            from ...transfer import staging

            if not hosts[0].is_pinned():
                return False
            try:
                # As bytes: the staging area only needs whole tokens of num_layers rows of item_size bytes.
                area = staging.PageStaging([h.view(torch.uint8).view(-1, num_layers, item_size) for h in hosts],
                                           budget_bytes=budget,
                                           device=src_tables[0].device, device_rows=device_rows,
                                           gather=staging.pointer_table_gather(src_tables, item_size),
                                           memory=None if memory is None else
                                           [m.view(torch.uint8).view(-1, num_layers, item_size) for m in memory])
            except ValueError:  # no budget for a token, or staging memory the area refuses
                area = None
            if len(_stagings) >= 8:
                _stagings.clear()
            entry = _stagings[key] = (weakref.ref(owner), budget, area)
    area = entry[2]
    return area is not None and area.backup(dst_indices, src_indices, bound_on_gpu=write_back)


def transfer_kv_all_layer_lf_pf(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size,
                                dst_layout_dim, num_layers, block_quota=None, num_warps_per_block=32):
    _check_layers(num_layers, src_k_layers, src_v_layers)
    slots = _page_first_slots(num_layers, item_size, dst_layout_dim, dst_k=dst_k, dst_v=dst_v)
    if _staged_lf_pf((dst_k, dst_v), (src_k_layers, src_v_layers), dst_indices, src_indices, item_size,
                     dst_layout_dim, num_layers):
        return
    device = src_k_layers.device
    tables = (compat.host_layer_table(dst_k, num_layers, item_size, device),
              compat.host_layer_table(dst_v, num_layers, item_size, device))
    _all_layers(tables, (src_k_layers, src_v_layers), dst_indices, src_indices, dst_stride=dst_layout_dim,
                src_stride=item_size, item_size=item_size, block_quota=block_quota, dst_rows=slots,
                names=(("dst_k", "dst_v"), ("src_k_layers", "src_v_layers")))


def transfer_kv_all_layer_mla_lf_pf(src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim,
                                    num_layers, block_quota=None, num_warps_per_block=32):
    _check_layers(num_layers, src_layers)
    slots = _page_first_slots(num_layers, item_size, dst_layout_dim, dst=dst)
    if _staged_lf_pf((dst,), (src_layers,), dst_indices, src_indices, item_size, dst_layout_dim, num_layers):
        return
    table = compat.host_layer_table(dst, num_layers, item_size, src_layers.device)
    _all_layers((table,), (src_layers,), dst_indices, src_indices, dst_stride=dst_layout_dim, src_stride=item_size,
                item_size=item_size, block_quota=block_quota, dst_rows=slots, names=(("dst",), ("src_layers",)))


def _page_first_slots(num_layers: int, item_size: int, layout_dim: int, **buffers) -> int:
    """The token slots of page_first host buffers (argument name -> tensor) that pointer tables will
    address as ``num_layers`` rows of ``item_size`` bytes at a stride of ``layout_dim`` bytes; each must
    be contiguous, hold whole tokens of ``layout_dim`` bytes and every layer's row within a token."""
    compat._positive("item_size", item_size)
    compat._positive("dst_layout_dim", layout_dim)
    if num_layers * item_size > layout_dim:
        raise ValueError(f"{num_layers} layers of item_size={item_size} bytes do not fit in a token of "
                         f"dst_layout_dim={layout_dim} bytes")
    slots = None
    for name, t in buffers.items():
        compat._cache(name, t)
        nbytes = t.numel() * t.element_size()
        if not t.is_contiguous() or nbytes % layout_dim:
            raise ValueError(f"{name} must be a contiguous page_first buffer of whole {layout_dim}-byte tokens, got "
                             f"shape {tuple(t.shape)} of {t.dtype}")
        slots = nbytes // layout_dim if slots is None else min(slots, nbytes // layout_dim)
    return slots


# page_head host layout: (pages, heads, page_size, layers, head_dim) per cache.
# A token's row is split into one head_dim piece per head, so each head is
# its own pair: device rows (slots, head_dim) at stride heads*head_dim, host
# rows addressed as page*(heads*page_size*layers) + offset*layers (+ head and
# layer folded into the base).

def _page_head_geometry(host, name: str, item_size, page_size, heads) -> tuple[int, int, int]:
    """(elements of one head's row, layers, pages) of a page_head host buffer, its geometry checked."""
    compat._cache(name, host)
    compat._positive("item_size", item_size)
    compat._positive("page_size", page_size)
    compat._positive("head_num", heads)
    itemsize = host.element_size()
    if item_size % (heads * itemsize):
        raise ValueError(f"item_size={item_size} is not head_num={heads} heads of whole {host.dtype} elements")
    head_elems = item_size // itemsize // heads
    pages = host.shape[0]
    per_layer = pages * heads * page_size * head_elems  # elements of one layer across the buffer
    if not host.is_contiguous() or host.numel() % per_layer:
        raise ValueError(f"{name} must be a contiguous page_head buffer (pages, heads={heads}, page_size={page_size}, "
                         f"layers, {head_elems} elements), got shape {tuple(host.shape)}")
    return head_elems, host.numel() // per_layer, pages


def _page_head_rows(name: str, indices: torch.Tensor, page_size: int, heads: int, layers: int,
                    pages: int) -> torch.Tensor:
    return bounds.token_rows(name, indices, page_size=page_size, page_rows=heads * page_size * layers,
                             slots=pages * page_size, token_stride=layers)


def _head_rows(flat: torch.Tensor, head: int, layer: int, page_size: int, layers: int, heads: int) -> torch.Tensor:
    """The rows of ``head`` of ``layer`` in a page_head buffer's flat head pieces: a view from the first such
    piece, whose token ``t`` is row ``token_rows`` (_page_head_rows) of it; it ends where the last head's
    pieces of that layer end, so every head's view has one length."""
    span = flat.shape[0] - ((heads - 1) * page_size * layers + layer)
    base = head * page_size * layers + layer
    return flat[base:base + span]


def _page_head_pairs(host: torch.Tensor, device_rows: torch.Tensor, layer_id: int, item_size: int, page_size: int,
                     heads: int, *, host_is_dst: bool, names: tuple[str, str]) -> tuple[list, tuple[int, int]]:
    host_name, device_name = names
    head_elems, layers, pages = _page_head_geometry(host, host_name, item_size, page_size, heads)
    layer_id = bounds.check_layer(layer_id, layers, pool=f"{host_name} (a page_head buffer)")
    compat._cache(device_name, device_rows)
    if device_rows.dim() < 2 or math.prod(device_rows.shape[1:]) != heads * head_elems:
        raise ValueError(f"{device_name} must hold rows of head_num={heads} x {head_elems} elements per slot, got "
                         f"shape {tuple(device_rows.shape)}")
    flat = host.view(-1, head_elems)
    dev = device_rows.view(device_rows.shape[0], heads, head_elems)
    pairs = []
    for h in range(heads):
        pair = (_head_rows(flat, h, layer_id, page_size, layers, heads), dev[:, h])
        pairs.append(pair if host_is_dst else pair[::-1])
    return pairs, (layers, pages)


def _page_head_copy(pairs, host_idx, device_idx, *, host_is_dst: bool, item_size: int, heads: int, block_quota):
    """Runs head pairs (dst, src) with one index map for the host side."""
    indices_dst, indices_src = (host_idx, device_idx) if host_is_dst else (device_idx, host_idx)
    if kernel_available(item_size // heads):
        for dst, src in pairs:
            ops.transfer_one_layer_mla(dst, indices_dst, src, indices_src, block_quota=block_quota)
        return
    _copy(pairs, indices_dst, indices_src, names=("dst_indices", "src_indices"))


def transfer_kv_per_layer_ph_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size,
                                src_layout_dim, page_size, head_num, block_quota=None, num_warps_per_block=32):
    pairs, geometry = [], set()
    for names, host, dev in ((("src_k", "dst_k"), src_k, dst_k), (("src_v", "dst_v"), src_v, dst_v)):
        p, shape = _page_head_pairs(host, dev, layer_id, item_size, page_size, head_num, host_is_dst=False,
                                    names=names)
        pairs += p
        geometry.add(shape)
    if len(geometry) > 1:
        raise ValueError(f"src_k and src_v must have the same layers and pages, got {sorted(geometry)}")
    (layers, pages), = geometry
    rows = _page_head_rows("src_indices", src_indices, page_size, head_num, layers, pages)
    _page_head_copy(pairs, rows, dst_indices, host_is_dst=False, item_size=item_size, heads=head_num,
                    block_quota=block_quota)


def transfer_kv_all_layer_lf_ph(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size,
                                dst_layout_dim, num_layers, page_size, head_num, block_quota=None,
                                num_warps_per_block=32):
    _check_layers(num_layers, src_k_layers, src_v_layers)
    pages = set()
    for name, host in (("dst_k", dst_k), ("dst_v", dst_v)):
        _, layers, host_pages = _page_head_geometry(host, name, item_size, page_size, head_num)
        if layers != num_layers:
            raise ValueError(f"num_layers={num_layers} but {name} holds {layers} layers (shape {tuple(host.shape)})")
        pages.add(host_pages)
    head_bytes = item_size // head_num
    # The smaller buffer's pages bound both: a token past it is refused, not written past its end.
    rows = _page_head_rows("dst_indices", dst_indices, page_size, head_num, num_layers, min(pages))
    pairs = []
    for host, table, name in ((dst_k, src_k_layers, "src_k_layers"), (dst_v, src_v_layers, "src_v_layers")):
        flat = host.view(-1, head_bytes // host.element_size())
        table = pointer_tables.checked(table, name)
        # Every head's piece lies inside its token's row: the rows that hold whole rows bound them all.
        device_rows = table.rows(item_size, item_size, name)
        for layer, address in enumerate(table.addresses):
            for h in range(head_num):
                pairs.append((_head_rows(flat, h, layer, page_size, num_layers, head_num),
                              direct.Rows.at(address + h * head_bytes, item_size, head_bytes, table.device,
                                             device_rows)))
    # Raw device rows: the copy engines serve this layout whatever the probe says.
    _copy(pairs, rows, src_indices, names=("dst_indices", "src_indices"))


# The direct ops: upstream moves runs of page_size tokens with cudaMemcpyAsync.
# Here the rows are planned by direct.py (maximal runs, 2-D copies for
# strided rows, one batched submission), so any page size and stride work.

def _caches(name: str, tensors) -> list:
    """A list or tuple of caches (the argument ``name``), each checked."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(tensors).__name__}")
    return [compat._cache(f"{name}[{i}]", t) for i, t in enumerate(tensors)]


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    compat._positive("page_size", page_size)
    src_layers, dst_layers = _caches("src_layers", src_layers), _caches("dst_layers", dst_layers)
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"src_layers has {len(src_layers)} tensors but dst_layers has {len(dst_layers)}")
    _copy([(_rows_of(d), _rows_of(s)) for d, s in zip(dst_layers, src_layers)], dst_indices, src_indices,
          page_size=page_size, names=("dst_indices", "src_indices"), direct_backend=True)


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0], -1) if t.dim() > 2 else t


def page_first_direct_rows(buffer: torch.Tensor, layer_id: int, name: str = "buffer", tokens_name: str = "indices"):
    """(flat rows, token -> row map for route.copy, page size) of one layer of a (pages, layers, page_size, ...)
    buffer (layout.layer_rows, layout.TokenRows); the map refuses a token outside the buffer."""
    compat._cache(name, buffer)
    if buffer.dim() < 3 or not buffer.is_contiguous():
        raise ValueError(f"{name} must be a contiguous page_first_direct buffer (pages, layers, page_size, ...), got "
                         f"shape {tuple(buffer.shape)}")
    pages, layers, page_size = buffer.shape[0], buffer.shape[1], buffer.shape[2]
    # In range: layer L would view the next page's layer 0.
    layer_id = bounds.check_layer(layer_id, layers, pool=f"{name} (a page_first_direct buffer)")
    rows = host_layout.layer_rows(buffer, "page_first_direct", layer_id)
    to_rows = host_layout.page_first_direct_map(layers=layers, page_size=page_size, slots=pages * page_size,
                                                name=tokens_name)
    return rows.view(rows.shape[0], -1), to_rows, page_size


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    compat._positive("page_size", page_size)
    src_ptrs, dst_ptrs = _caches("src_ptrs", src_ptrs), _caches("dst_ptrs", dst_ptrs)
    if len(src_ptrs) != len(dst_ptrs):
        raise ValueError(f"src_ptrs has {len(src_ptrs)} buffers but dst_ptrs has {len(dst_ptrs)} layers")
    pairs, to_rows, rows_per_page = [], None, 1
    for i, (host, dev) in enumerate(zip(src_ptrs, dst_ptrs)):
        flat, to_rows, rows_per_page = page_first_direct_rows(host, layer_id, f"src_ptrs[{i}]", "src_indices")
        pairs.append((_rows_of(dev), flat))
    _copy(pairs, dst_indices, src_indices, page_size=rows_per_page, src_rows=to_rows,
          names=("dst_indices", "src_indices"), direct_backend=True)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    compat._positive("page_size", page_size)
    src_ptrs, dst_ptrs = _caches("src_ptrs", src_ptrs), _caches("dst_ptrs", dst_ptrs)
    layers_per_buffer = len(src_ptrs) // max(1, len(dst_ptrs))
    if not dst_ptrs or layers_per_buffer * len(dst_ptrs) != len(src_ptrs):
        raise ValueError(f"src_ptrs has {len(src_ptrs)} layers, not a multiple of the {len(dst_ptrs)} buffers")
    pairs, to_rows, rows_per_page = [], None, 1
    for b, host in enumerate(dst_ptrs):
        for layer in range(layers_per_buffer):
            flat, to_rows, rows_per_page = page_first_direct_rows(host, layer, f"dst_ptrs[{b}]", "dst_indices")
            pairs.append((flat, _rows_of(src_ptrs[b * layers_per_buffer + layer])))
    _copy(pairs, dst_indices, src_indices, page_size=rows_per_page, dst_rows=to_rows,
          names=("dst_indices", "src_indices"), direct_backend=True)


KVCACHEIO_OPS = (
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_all_layer_direct_lf_pf",
)
