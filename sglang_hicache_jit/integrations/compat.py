"""SGLang 0.5.23's ``sglang.kernels.ops.kvcache.hicache``, served by this package's kernels.

Why one long module: it mirrors that one upstream module function for function, and the geometry
checks its functions share (also the routed SGLang ops') sit beside them.

Every public transfer function of that module, with the same name, parameter
names, kinds, order and defaults, and the same bytes moved, so a caller can
switch by changing one import (the SGLang plugin in
``integrations/sglang.py`` does the switch for SGLang's own host pools)::

    from sglang_hicache_jit.compat import (
        can_use_hicache_jit_kernel, transfer_hicache_one_layer_mla, ...)

Like upstream, these run the JIT kernel only: ``can_use_*`` says whether it
can be used here, and the transfers raise when it cannot (the plugin adds the
copy-engine fallback on top). Differences, all in the direction of accepting
more:

* any row size that is a multiple of 4 bytes works (upstream on CUDA: 128),
  and one build serves every row size, so ``can_use_*`` costs one probe;
* ``can_use_*`` never raise, whatever they are given;
* a negative index skips its pair, and an index past the end of a pool whose
  size the op can see is reported, never written;
* indices may live on the CPU (moved to the GPU without a host sync);
* ``unroll`` is accepted and ignored (the kernels choose their own vector
  width); ``page_size`` is accepted and ignored (every row is addressed by
  its own index, so pages need not tile anything); ``block_quota`` is
  honoured, and None means this package's measured default
  (``ops.DEFAULT_BLOCK_QUOTA``; 2 where the destination is a host tensor, ``ops.D2H_BLOCK_QUOTA``);
* the staged write-backs ignore the staging buffer: the all-layer kernel
  writes the ``page_first`` host rows directly, which moves the same bytes
  without the extra pass through GPU memory.
"""

from __future__ import annotations

import logging
import math
import weakref

import torch

from ..transfer import bounds, extents, ops, pointer_tables
from ..transfer import layout as host_layout
from ..transfer.probe import probe

log = logging.getLogger("sglang_hicache_jit.compat")  # its name from before the move to a subpackage (issue 20)
_warned: set = set()


def _available(element_size) -> bool:
    """The probe's verdict for rows of ``element_size`` bytes; never raises."""
    if isinstance(element_size, bool) or not isinstance(element_size, int):
        return False  # probe(None) would ask only about the GPU, not about a row
    # A plain int from here on: an int subclass may override __repr__, __index__ or __eq__ (and raise
    # from them); int.__index__ is int's own conversion and ignores those.
    size = int.__index__(element_size)
    try:
        result = probe(size)
        if not result.available:
            key = (size, result.code)
            if key not in _warned:
                _warned.add(key)
                log.warning("JIT HiCache kernel unavailable for element_size=%d: [%s] %s", size, result.code,
                            result.reason)
        return bool(result.available)
    except Exception as exc:  # probe() does not raise; belt and braces for a must-not-raise API
        log.warning("JIT HiCache kernel probe failed: %s: %s", type(exc).__name__, exc)
        return False


def can_use_hicache_jit_kernel(
    *,
    element_size: int,
    unroll: int | None = None,
    block_quota: int | None = None,
    page_size: int | None = None,
) -> bool:
    """True when the one- and all-layer kernels can copy rows of ``element_size``
    bytes on the current GPU. Never raises; logs the reason once."""
    return _available(element_size)


def can_use_write_back_jit_kernel(
    *,
    element_size: int,
    unroll: int | None = None,
    block_quota: int | None = None,
) -> bool:
    """True when the staged write-back (all layers, layer_first GPU -> page_first
    host) can run for rows of ``element_size`` bytes. Never raises."""
    return _available(element_size)


def can_use_page_unified_load_back_jit_kernel(
    *,
    group_bytes: int,
    block_quota: int | None = None,
) -> bool:
    """True when page_unified loads can run for head-group rows of
    ``group_bytes`` bytes. Never raises."""
    return _available(group_bytes)


# ---------------------------------------------------------------------------
# One layer and all layers.

# Geometry, checked once per call before anything is viewed or divided: these helpers serve compat and
# the routed SGLang ops (integrations/sglang/ops.py) alike, so a degenerate argument reads the same on
# every path (a TypeError or ValueError naming it, never torch's error from a view or a division).

def _cache(name: str, t) -> torch.Tensor:
    """``t`` (the argument ``name``) is a cache: a tensor of at least one slot of at least one element."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 0 or not t.numel():
        raise ValueError(f"{name} must hold at least one slot of at least one element; got shape {tuple(t.shape)}")
    return t


def _positive(name: str, value) -> int:
    """``value`` (the argument ``name``) as a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _element_dim(element_dim, cache, name: str) -> int:
    """``element_dim``, or (None or 0, as upstream) the last dimension of ``cache``, checked against
    ``cache`` (the argument ``name``) as _whole_rows does."""
    _cache(name, cache)
    if element_dim is None or (type(element_dim) is int and element_dim == 0):
        return cache.size(-1)
    _divides(_positive("element_dim", element_dim), name, cache)
    return element_dim


def _whole_rows(element_dim: int, **caches) -> None:
    """Each of ``caches`` (argument name -> tensor) is a cache whose row (its elements per slot; a flat
    buffer's elements) is a whole number of rows of ``element_dim`` elements. The kernel ops check the
    caches they are given themselves (by name, once per launch plan); the copy-engine path calls this."""
    for name, t in caches.items():
        _divides(element_dim, name, _cache(name, t))


def _divides(element_dim: int, name: str, t: torch.Tensor) -> None:
    row = math.prod(t.shape[1:]) if t.dim() > 1 else t.numel()
    if row % element_dim:
        raise ValueError(f"element_dim={element_dim} does not divide a row of {name} ({row} elements per slot, "
                         f"shape {tuple(t.shape)})")


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
    element_dim = _element_dim(element_dim, k_cache_dst, "k_cache_dst")
    # The caches go to ops as given (it views them as rows only when their shape
    # needs it): pools pass the same tensors every call, and ops' launch plan
    # for them is found by pointer, shape and strides, with no view to cut.
    ops.transfer_one_layer(k_cache_dst, v_cache_dst, indices_dst, k_cache_src, v_cache_src, indices_src,
                           element_dim=element_dim, block_quota=block_quota)


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
    element_dim = _element_dim(element_dim, cache_dst, "cache_dst")
    ops.transfer_one_layer_mla(cache_dst, indices_dst, cache_src, indices_src, element_dim=element_dim,
                               block_quota=block_quota)


def _element_size(element_size, src_stride, dst_stride, names: str) -> int:
    if element_size is not None:
        return _positive("element_size", element_size)
    if src_stride != dst_stride:
        # Upstream asserts here; a ValueError says what to pass instead.
        raise ValueError(f"element_size is required when {names} differ ({src_stride} != {dst_stride})")
    return _positive(f"element_size (left out: {names})", dst_stride)


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
    size = _element_size(element_size, kv_cache_src_stride_bytes, kv_cache_dst_stride_bytes,
                         "kv_cache_src_stride_bytes and kv_cache_dst_stride_bytes")
    ops.transfer_pointer_tables((k_ptr_dst, v_ptr_dst), indices_dst, (k_ptr_src, v_ptr_src), indices_src,
                                dst_stride_bytes=kv_cache_dst_stride_bytes, src_stride_bytes=kv_cache_src_stride_bytes,
                                element_size=size, block_quota=block_quota,
                                names=(("k_ptr_dst", "v_ptr_dst"), ("k_ptr_src", "v_ptr_src")))


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
    size = _element_size(element_size, cache_src_stride_bytes, cache_dst_stride_bytes,
                         "cache_src_stride_bytes and cache_dst_stride_bytes")
    ops.transfer_pointer_tables(ptr_dst, indices_dst, ptr_src, indices_src, dst_stride_bytes=cache_dst_stride_bytes,
                                src_stride_bytes=cache_src_stride_bytes, element_size=size, block_quota=block_quota,
                                names=("ptr_dst", "ptr_src"))


# ---------------------------------------------------------------------------
# Staged write-back: all layers, layer_first GPU -> page_first host.

def host_layer_table(buffer: torch.Tensor, num_layers: int, row_bytes: int, device) -> torch.Tensor:
    """uint64 CUDA table of the per-layer row-0 addresses of a ``page_first``
    host buffer, where layer l of a token starts ``l * row_bytes`` into its
    slot. Cached per buffer (see _table_key): pools pass the same buffer on
    every call, some as a fresh view of it each time."""
    root = _root(buffer)
    hit = _host_tables.get(_table_key(buffer, root, (num_layers, row_bytes), device))
    if hit is not None and hit[0]() is root:  # the hit, inline: a backup's hot path
        return hit[1]
    return _buffer_table(buffer, (num_layers, row_bytes),
                         lambda: host_layout.layer_offsets("page_first", layers=num_layers, row_bytes=row_bytes), device)


def _root(buffer: torch.Tensor) -> torch.Tensor:
    """The tensor that owns ``buffer``'s memory: ``buffer`` itself, or the one it is a view of."""
    base = buffer._base
    return buffer if base is None else base


def _table_key(buffer: torch.Tensor, root: torch.Tensor, key, device) -> tuple:
    """A table's cache key: the owner of the memory and the bytes and geometry the table is made from, not
    the tensor object. SGLang 0.5.17's MHA host pool passes ``self.k_buffer``, a property that returns a new
    view of its buffer on every call; keyed by that object, every backup built (and registered) a new table,
    and the registration made every checked pointer table be read back from the GPU: a device sync in
    SGLang's scheduler thread on every backup (issue 36: a miss 26-28 ms slower per 8K-token chunk)."""
    return (id(root), buffer.data_ptr(), tuple(buffer.shape), tuple(buffer.stride()), buffer.dtype, key, str(device))


def _buffer_table(buffer: torch.Tensor, key, offsets, device) -> torch.Tensor:
    """uint64 table of ``buffer``'s address plus each of ``offsets()`` on ``device``, cached per buffer and
    ``key`` (what the offsets are made from). The buffer is registered as an allocation of its own
    (transfer/extents.py) for as long as the tensor that owns its memory lives, so the ops bound the
    table's rows by the buffer itself, not by the larger allocation it may be part of; the table is built
    checked (transfer/pointer_tables.py), never read back."""
    root = _root(buffer)
    cache_key = _table_key(buffer, root, key, device)
    hit = _host_tables.get(cache_key)
    if hit is not None and hit[0]() is root:
        return hit[1]
    extents.register(buffer, "a host buffer passed to compat", owner=root)
    base = buffer.data_ptr()
    table = pointer_tables.build([base + offset for offset in offsets()], device, "a host buffer's layer table")
    if len(_host_tables) >= 64:
        _host_tables.clear()
    _host_tables[cache_key] = (weakref.ref(root), table)
    return table


_host_tables: dict = {}


def staged_geometry(staging: torch.Tensor, dst: torch.Tensor, element_size) -> tuple[int, int]:
    """(row bytes, bytes per token across layers) of a staged write-back.

    Upstream reads whole pages starting at ``src_indices[::page_size]``; for the
    page-aligned indices its contract requires, copying token by token (as
    below) moves the same bytes."""
    _cache("staging", staging)
    _cache("dst", dst)
    if element_size is not None:
        _positive("element_size", element_size)
    if dst.dim() < 3 or not dst.is_contiguous():
        raise ValueError(f"dst must be a contiguous page_first host buffer (slots, layers, ...), got shape "
                         f"{tuple(dst.shape)}")
    if staging.dim() < 2:
        raise ValueError(f"staging must be a staging buffer laid out as dst (tokens, layers, ...), got shape "
                         f"{tuple(staging.shape)}")
    # A row's bytes from the shapes (indexing [0, 0] would cut a view per call, on SGLang's scheduler thread).
    row_bytes = math.prod(dst.shape[2:]) * dst.element_size()
    size = element_size or math.prod(staging.shape[2:]) * staging.element_size()
    if size != row_bytes:
        raise ValueError(f"element_size is {size} bytes but a row of dst is {row_bytes} bytes")
    return size, dst.shape[1] * row_bytes


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
    size, layout_dim = staged_geometry(staging_k, dst_k, element_size)
    # One slot count serves both tables below: V's buffer must be K's twin.
    if (not isinstance(dst_v, torch.Tensor) or (dst_v.shape, dst_v.dtype) != (dst_k.shape, dst_k.dtype)
            or not dst_v.is_contiguous()):
        got = (f"{tuple(dst_v.shape)} {dst_v.dtype}" if isinstance(dst_v, torch.Tensor) else type(dst_v).__name__)
        raise ValueError(f"dst_v must be a contiguous tensor of dst_k's shape and dtype ({tuple(dst_k.shape)} "
                         f"{dst_k.dtype}), got {got}")
    device, layers = k_ptr_src.device, dst_k.shape[1]
    # The host buffers are tensors here, so their slot count is known and the kernel checks dst_indices.
    ops.transfer_pointer_tables((host_layer_table(dst_k, layers, size, device),
                                 host_layer_table(dst_v, layers, size, device)), dst_indices,
                                (k_ptr_src, v_ptr_src), src_indices, dst_stride_bytes=layout_dim,
                                src_stride_bytes=size, element_size=size, block_quota=block_quota,
                                dst_rows=dst_k.shape[0], names=(("dst_k", "dst_v"), ("k_ptr_src", "v_ptr_src")))


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
    size, layout_dim = staged_geometry(staging, dst, element_size)
    ops.transfer_pointer_tables(host_layer_table(dst, dst.shape[1], size, ptr_src.device), dst_indices, ptr_src,
                                src_indices, dst_stride_bytes=layout_dim, src_stride_bytes=size,
                                element_size=size, block_quota=block_quota, dst_rows=dst.shape[0],
                                names=("dst", "ptr_src"))


# ---------------------------------------------------------------------------
# page_unified: host pages laid out (page, head_group, layer, 2, page_size,
# head_in_group, dim) for MHA and (page, layer, page_size, dim) for MLA.
#
# A token's rows are not at a fixed stride from slot 0 there, so the host
# side is addressed as a flat table of group rows and each token index is
# mapped to its row: page * rows_per_page + offset_in_page, plus a constant
# (group, layer, K/V) offset folded into the base pointer.

_MHA_PAGES = "(page, head_group, layer, 2, page_size, head_in_group, dim)"
_MLA_PAGES = "MLA (page, layer, page_size, dim)"


def page_unified_rows(pages: torch.Tensor, page_size: int, rows_per_page: int, page_count: int | None = None, *,
                      name: str = "pages") -> torch.Tensor:
    """Flat row of each token of ``pages`` (page IDs): ``page * rows_per_page + offset`` for offsets 0 to
    ``page_size - 1``; every row of a negative page is -1 (skipped). With ``page_count`` (the pool's
    pages) a page ID outside the pool is refused before it multiplies (bounds.token_rows: an error for
    CPU pages, a row the kernel refuses for GPU pages); without it (a pool seen only through raw
    addresses) the product is formed as given."""
    if page_count is None:
        first = pages.to(torch.int64) * rows_per_page
    else:
        first = bounds.token_rows(name, pages, page_size=1, page_rows=rows_per_page, slots=page_count)
    first = first[:, None]
    rows = first + torch.arange(page_size, device=first.device, dtype=torch.int64)
    rows = torch.where(first < 0, -1, rows)
    if page_count is not None and first.is_cuda:
        rows = torch.where(first == bounds.PAST_THE_END, bounds.PAST_THE_END, rows)
    return rows.reshape(-1)


def _check_pages(name: str, t, shape: str, dims: int, kv_dim: int | None = None) -> None:
    """``t`` (the argument ``name``) is a page_unified buffer: a tensor of ``dims`` dimensions laid out as
    ``shape``, every page dimension positive (and 2 at ``kv_dim``: K and V). Upstream's messages, with
    the argument named."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor laid out as {shape}, got {type(t).__name__}")
    ops.check_dense(name, t)
    if t.ndim != dims:
        raise ValueError(f"{name}: expected {shape}, got shape {tuple(t.shape)}")
    if any(d <= 0 for d in t.shape[1:]) or (kv_dim is not None and t.shape[kv_dim] != 2):
        kv = " and the K/V dimension must be 2" if kv_dim is not None else ""
        raise ValueError(f"{name}: page dimensions must be positive{kv}, got shape {tuple(t.shape)}")


def _check_page_unified_src(src: torch.Tensor) -> None:
    if not src.is_contiguous():
        raise ValueError("src: the host pool must be contiguous")
    if src.device.type != "cpu" and not src.is_cuda:
        raise ValueError(f"src: expected a CPU or CUDA-registered host pool, got device {src.device}")


def transfer_hicache_one_layer_page_unified_lf(
    k_cache_dst: torch.Tensor,
    v_cache_dst: torch.Tensor,
    src: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    *,
    block_quota: int | None = None,
) -> None:
    """Load one layer of page_unified MHA host pages into the device K/V
    caches ``(token, head, dim)``. ``src_indices`` are host token indices."""
    _check_pages("src", src, _MHA_PAGES, 7, kv_dim=3)
    _check_page_unified_src(src)
    _, groups, layers, _, page_size, heads_in_group, dim = src.shape
    layer_id = bounds.check_layer(layer_id, layers, pool="a host pool")
    ops.check_index_tensor("src_indices", src_indices)
    group_elems = heads_in_group * dim
    flat = src.view(-1, group_elems)
    rows_per_page = groups * layers * 2 * page_size
    host_rows = bounds.token_rows("src_indices", src_indices, page_size=page_size, page_rows=rows_per_page,
                                  slots=src.shape[0] * page_size)
    k_dst = k_cache_dst.view(k_cache_dst.shape[0], -1, dim)
    v_dst = v_cache_dst.view(v_cache_dst.shape[0], -1, dim)
    span = flat.shape[0] - (groups * layers * 2 - 1) * page_size  # rows every group's K and V view can hold
    for g in range(groups):
        base = (g * layers + layer_id) * 2 * page_size
        heads = slice(g * heads_in_group, (g + 1) * heads_in_group)
        ops.transfer_one_layer(k_dst[:, heads], v_dst[:, heads], dst_indices, flat[base:base + span],
                               flat[base + page_size:base + page_size + span], host_rows, block_quota=block_quota)


def transfer_hicache_one_layer_mla_page_unified_lf(
    cache_dst: torch.Tensor,
    src: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    *,
    block_quota: int | None = None,
) -> None:
    """Load one layer of page_unified MLA host pages ``(page, layer, page_size,
    dim)`` into the device cache ``(token, 1, dim)``."""
    _check_pages("src", src, _MLA_PAGES, 4)
    _check_page_unified_src(src)
    _, layers, page_size, dim = src.shape
    layer_id = bounds.check_layer(layer_id, layers, pool="a host pool")
    ops.check_index_tensor("src_indices", src_indices)
    if not isinstance(cache_dst, torch.Tensor):
        raise TypeError(f"cache_dst must be a torch.Tensor, got {type(cache_dst).__name__}")
    flat = src.view(-1, dim)
    host_rows = host_layout.page_first_direct_map(layers=layers, page_size=page_size, slots=src.shape[0] * page_size,
                                                  name="src_indices")(src_indices)
    ops.transfer_one_layer_mla(cache_dst.view(cache_dst.shape[0], -1), dst_indices, flat[layer_id * page_size:],
                               host_rows, block_quota=block_quota)


def _check_page_unified_write_back(staging, dst, src_pages, dst_pages) -> None:
    if staging.shape[1:] != dst.shape[1:] or staging.dtype != dst.dtype:
        raise ValueError(f"staging and dst must have matching page shapes and dtype, got {tuple(staging.shape)} "
                         f"{staging.dtype} and {tuple(dst.shape)} {dst.dtype}")
    for name, t in (("staging", staging), ("dst", dst)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if not staging.is_cuda:
        raise ValueError(f"staging must be a CUDA tensor, got device {staging.device}")
    if dst.device.type != "cpu" or not dst.is_pinned():
        got = "pageable CPU memory" if dst.device.type == "cpu" else f"device {dst.device}"
        raise ValueError(f"dst must be pinned CPU memory, got {got}")
    if staging.shape[0] == 0:
        raise ValueError("staging must hold at least one page")
    ops.check_index_tensor("src_pages", src_pages)
    ops.check_index_tensor("dst_pages", dst_pages)
    if src_pages.numel() != dst_pages.numel():
        raise ValueError(f"src_pages and dst_pages must have the same length, got {src_pages.numel()} and "
                         f"{dst_pages.numel()}")


def _shifted(table: torch.Tensor, offset: int, name: str) -> torch.Tensor:
    """``table`` (the argument ``name``) with ``offset`` bytes added to each address, made once per table and
    offset from the checked addresses (pointer_tables.py), so no call reads a table back."""
    return pointer_tables.checked(table, name).shifted(offset)


def transfer_hicache_all_layer_staged_lf_page_unified(
    k_ptr_src: torch.Tensor,
    v_ptr_src: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    staging: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """Write whole GPU KV pages (every layer) into pinned host pages laid out
    page_unified. ``src_pages`` / ``dst_pages`` are page IDs, not tokens."""
    _check_pages("dst", dst, _MHA_PAGES, 7, kv_dim=3)
    _check_pages("staging", staging, _MHA_PAGES, 7, kv_dim=3)
    _check_page_unified_write_back(staging, dst, src_pages, dst_pages)
    _, groups, layers, _, page_size, heads_in_group, dim = dst.shape
    itemsize = dst.element_size()
    group_bytes = heads_in_group * dim * itemsize
    device = k_ptr_src.device
    rows_per_page = groups * layers * 2 * page_size
    src_rows = page_unified_rows(src_pages.to(device), page_size, page_size)
    dst_rows = page_unified_rows(dst_pages, page_size, rows_per_page, dst.shape[0], name="dst_pages").to(device)
    # Every table below starts inside page 0, at most rows_per_page - page_size rows in: from each, the
    # rows of dst that remain are at least this many, and a row in the pool is below it.
    dst_slots = (dst.shape[0] - 1) * rows_per_page + page_size
    src_stride = groups * group_bytes  # a device token row holds every head group
    for g in range(groups):
        k_offsets = [((g * layers + layer) * 2) * page_size * group_bytes for layer in range(layers)]
        k_table = _buffer_table(dst, ("page_unified k", tuple(k_offsets)), lambda: k_offsets, device)
        v_table = _buffer_table(dst, ("page_unified v", tuple(k_offsets), page_size * group_bytes),
                                lambda: [page_size * group_bytes + o for o in k_offsets], device)
        ops.transfer_pointer_tables((k_table, v_table), dst_rows,
                                    (_shifted(k_ptr_src, g * group_bytes, "k_ptr_src"),
                                     _shifted(v_ptr_src, g * group_bytes, "v_ptr_src")),
                                    src_rows, dst_stride_bytes=group_bytes, src_stride_bytes=src_stride,
                                    element_size=group_bytes, dst_rows=dst_slots,
                                    names=(("dst", "dst"), ("k_ptr_src", "v_ptr_src")))


def transfer_hicache_all_layer_mla_staged_lf_page_unified(
    ptr_src: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    staging: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """Write whole GPU MLA pages into pinned host pages ``(page, layer,
    page_size, dim)``. ``src_pages`` / ``dst_pages`` are page IDs."""
    _check_pages("dst", dst, _MLA_PAGES, 4)
    _check_pages("staging", staging, _MLA_PAGES, 4)
    _check_page_unified_write_back(staging, dst, src_pages, dst_pages)
    _, layers, page_size, dim = dst.shape
    row_bytes = dim * dst.element_size()
    device = ptr_src.device
    table = _buffer_table(dst, ("page_unified mla", layers, page_size, row_bytes),
                          lambda: host_layout.layer_offsets("page_first_direct", layers=layers, row_bytes=row_bytes,
                                                            page_size=page_size), device)
    rows_per_page = layers * page_size
    dst_rows = page_unified_rows(dst_pages, page_size, rows_per_page, dst.shape[0], name="dst_pages").to(device)
    ops.transfer_pointer_tables(table, dst_rows, ptr_src, page_unified_rows(src_pages.to(device), page_size, page_size),
                                dst_stride_bytes=row_bytes, src_stride_bytes=row_bytes, element_size=row_bytes,
                                dst_rows=(dst.shape[0] - 1) * rows_per_page + page_size, names=("dst", "ptr_src"))


__all__ = [
    "can_use_hicache_jit_kernel",
    "can_use_page_unified_load_back_jit_kernel",
    "can_use_write_back_jit_kernel",
    "transfer_hicache_all_layer",
    "transfer_hicache_all_layer_mla",
    "transfer_hicache_all_layer_mla_staged_lf_page_unified",
    "transfer_hicache_all_layer_mla_staged_lf_pf",
    "transfer_hicache_all_layer_staged_lf_page_unified",
    "transfer_hicache_all_layer_staged_lf_pf",
    "transfer_hicache_one_layer",
    "transfer_hicache_one_layer_mla",
    "transfer_hicache_one_layer_mla_page_unified_lf",
    "transfer_hicache_one_layer_page_unified_lf",
]
