"""Transfer ops: validate on the host, pick the library, launch on the current stream.

Every copy moves rows ``src[indices_src[i]] -> dst[indices_dst[i]]``. A cache
argument is a tensor whose first dimension is the token slot and whose other
dimensions form one contiguous row (a per-layer view of a ``page_first`` host
buffer is fine: its slot stride is larger than its row). One side is a CUDA
tensor, the other a CUDA tensor or pinned CPU memory; the kernel reads and
writes host memory directly, so pageable CPU memory is refused.

Index rules (docs/concepts.md, "The index contract"): int32 or int64, 1-D, equal lengths; CPU
indices are copied to the GPU without a host sync; a negative index skips its
pair; an index past the end of its pool is never read or written: the kernel
skips the row and the next op on that device (or ``check_errors``) raises
TransferIndexError. ``SGLANG_HICACHE_JIT_STRICT=1`` checks the range on the
host before launching instead (this synchronizes when indices are on the GPU).

The public ops read: validate (checks.py), pick or build a plan (plans.py), launch (launcher.py).
"""

from __future__ import annotations

import torch

from .abi import D2H_BLOCK_QUOTA, DEFAULT_BLOCK_QUOTA, METHOD_NAMES, RESIDENT_QUEUE_SLOTS  # noqa: F401  (public constants)
from .checks import (LayerTable, MAX_BLOCK_QUOTA, _Side, _check_pair, _device_of,  # noqa: F401
                     _quota, check_dense, check_index_tensor)
from .launcher import check_errors, resident_stats, stop_resident  # noqa: F401  (public ops)
from .plans import _Plan, _keep, _local, _plan_cache, reload_settings, set_tuning  # noqa: F401
from . import pointer_tables


def transfer_one_layer_mla(cache_dst, indices_dst, cache_src, indices_src, *, element_dim=None,
                           block_quota=None, method=None) -> str:
    """Copies rows of one layer's MLA cache: ``cache_dst[indices_dst[i]] = cache_src[indices_src[i]]``.

    ``element_dim`` views flat caches as rows of that many elements;
    ``block_quota`` is the number of CTAs (SMs) to use (None: the measured
    default for the method); ``method`` is 'auto', 'plain', 'bulk' or
    'resident' (docs/kernels.md; default: $SGLANG_HICACHE_JIT_METHOD, else
    'auto'). Returns the copy method that ran ('bulk', 'plain', or
    'resident-bulk' / 'resident-plain' when it went through the resident queue).
    """
    quota = 0 if block_quota is None else _quota(block_quota)
    try:
        plans = _local.plans
    except AttributeError:  # this thread's first transfer
        plans = _plan_cache()
    key = None
    if isinstance(cache_dst, torch.Tensor) and isinstance(cache_src, torch.Tensor):
        root_dst, root_src = cache_dst._base, cache_src._base
        if root_dst is None:
            root_dst = cache_dst
        if root_src is None:
            root_src = cache_src
        try:
            key = (id(root_dst), cache_dst.data_ptr(), cache_dst.shape, cache_dst.stride(), cache_dst.dtype,
                   id(root_src), cache_src.data_ptr(), cache_src.shape, cache_src.stride(), cache_src.dtype,
                   element_dim, quota, method)
            plan = plans.get(key)
        except (TypeError, RuntimeError):  # no data pointer, or unhashable options: the full path says why
            plan = key = None
        if plan is not None and plan.refs[0]() is root_dst and plan.refs[1]() is root_src:
            return plan.run(indices_dst, indices_src)
    dst = _Side("cache_dst", cache_dst, element_dim, written=True)
    src = _Side("cache_src", cache_src, element_dim, written=False)
    _check_pair(dst, src, "cache_dst", "cache_src")
    device = _device_of(dst, src)
    plan = _Plan(device, dst_bases=(dst.ptr, 0), src_bases=(src.ptr, 0), dst_tables=(0, 0), src_tables=(0, 0),
                 num_layers=1, dst_stride=dst.stride, src_stride=src.stride, row_bytes=dst.row_bytes,
                 dst_rows=dst.rows, src_rows=src.rows, to_device=src.device is None, to_host=dst.device is None,
                 quota=quota, method=method,
                 host_memory=_host_memory(("cache_dst", dst), ("cache_src", src)))
    if key is not None:
        _keep(plans, key, plan, (root_dst, root_src))
    return plan.run(indices_dst, indices_src)


def transfer_one_layer(k_dst, v_dst, indices_dst, k_src, v_src, indices_src, *, element_dim=None,
                       block_quota=None, method=None) -> str:
    """Copies rows of one layer's K and V caches in one launch (same indices for both)."""
    quota = 0 if block_quota is None else _quota(block_quota)
    try:
        plans = _local.plans
    except AttributeError:  # this thread's first transfer
        plans = _plan_cache()
    key = None
    if (isinstance(k_dst, torch.Tensor) and isinstance(v_dst, torch.Tensor) and isinstance(k_src, torch.Tensor)
            and isinstance(v_src, torch.Tensor)):
        roots = (k_dst._base, v_dst._base, k_src._base, v_src._base)
        roots = (k_dst if roots[0] is None else roots[0], v_dst if roots[1] is None else roots[1],
                 k_src if roots[2] is None else roots[2], v_src if roots[3] is None else roots[3])
        try:
            key = (id(roots[0]), k_dst.data_ptr(), k_dst.shape, k_dst.stride(), k_dst.dtype,
                   id(roots[1]), v_dst.data_ptr(), v_dst.shape, v_dst.stride(), v_dst.dtype,
                   id(roots[2]), k_src.data_ptr(), k_src.shape, k_src.stride(), k_src.dtype,
                   id(roots[3]), v_src.data_ptr(), v_src.shape, v_src.stride(), v_src.dtype,
                   element_dim, quota, method)
            plan = plans.get(key)
        except (TypeError, RuntimeError):  # no data pointer, or unhashable options: the full path says why
            plan = key = None
        if plan is not None:
            refs = plan.refs
            if (refs[0]() is roots[0] and refs[1]() is roots[1] and refs[2]() is roots[2]
                    and refs[3]() is roots[3]):
                return plan.run(indices_dst, indices_src)
    kd = _Side("k_dst", k_dst, element_dim, written=True)
    vd = _Side("v_dst", v_dst, element_dim, written=True)
    ks = _Side("k_src", k_src, element_dim, written=False)
    vs = _Side("v_src", v_src, element_dim, written=False)
    _check_pair(kd, ks, "k_dst", "k_src")
    _check_pair(vd, vs, "v_dst", "v_src")
    _check_pair(vd, kd, "v_dst", "k_dst")
    for (a, b, an, bn) in ((kd, vd, "k_dst", "v_dst"), (ks, vs, "k_src", "v_src")):
        if a.stride != b.stride or a.rows != b.rows:
            raise ValueError(f"{an} and {bn} must have the same slot count and stride "
                             f"(got {a.rows}x{a.stride} B and {b.rows}x{b.stride} B)")
        if (a.device is None) != (b.device is None):
            raise ValueError(f"{an} and {bn} must both be on the GPU or both in host memory")
    device = _device_of(kd, vd, ks, vs)
    plan = _Plan(device, dst_bases=(kd.ptr, vd.ptr), src_bases=(ks.ptr, vs.ptr), dst_tables=(0, 0),
                 src_tables=(0, 0), num_layers=1, dst_stride=kd.stride, src_stride=ks.stride, row_bytes=kd.row_bytes,
                 dst_rows=kd.rows, src_rows=ks.rows, to_device=ks.device is None, to_host=kd.device is None,
                 quota=quota, method=method,
                 host_memory=_host_memory(("k_dst", kd), ("v_dst", vd), ("k_src", ks), ("v_src", vs)))
    if key is not None:
        _keep(plans, key, plan, roots)
    return plan.run(indices_dst, indices_src)


def _host_memory(*sides) -> tuple:
    """(name, address) of each host-memory side: what a plan checks is still pinned on every run."""
    return tuple((name, side.ptr) for name, side in sides if side.device is None)


def _table_host_memory(table: LayerTable) -> tuple:
    """_host_memory for a LayerTable in host memory: the first and the last layer of each cache (a pool's
    layers share one buffer, pinned or unpinned as a whole; asking for every layer would cost a CUDA
    call per layer and transfer)."""
    if table.device is not None:
        return ()
    labels = [table.name] if table.num_caches == 1 else [f"{table.name}[k]", f"{table.name}[v]"]
    return tuple((f"{label}[{i}]", sides[i].ptr) for label, sides in zip(labels, table.sides)
                 for i in sorted({0, len(sides) - 1}))


def transfer_all_layer(tables_dst, indices_dst, tables_src, indices_src, *, block_quota=None, method=None) -> str:
    """Copies the rows of every layer in one launch.

    ``tables_dst`` / ``tables_src`` are LayerTable objects (or what LayerTable
    accepts: a list of per-layer tensors for MLA, a ``(k_list, v_list)`` pair
    for MHA). Both sides need the same layer count, cache count and row size.
    """
    quota = 0 if block_quota is None else _quota(block_quota)
    # Plans only for LayerTables: a LayerTable does not change once built,
    # where a list of tensors can be edited between calls.
    try:
        plans = _local.plans
    except AttributeError:  # this thread's first transfer
        plans = _plan_cache()
    key = None
    if isinstance(tables_dst, LayerTable) and isinstance(tables_src, LayerTable):
        key = (id(tables_dst), id(tables_src), quota, method)
        try:
            plan = plans.get(key)
        except TypeError:  # an unhashable method: the full path below says what is wrong
            plan = key = None
        if plan is not None and plan.refs[0]() is tables_dst and plan.refs[1]() is tables_src:
            return plan.run(indices_dst, indices_src)
    dst = tables_dst if isinstance(tables_dst, LayerTable) else LayerTable(tables_dst, name="tables_dst", written=True)
    src = tables_src if isinstance(tables_src, LayerTable) else LayerTable(tables_src, name="tables_src")
    if (dst.num_caches, dst.num_layers) != (src.num_caches, src.num_layers):
        raise ValueError(f"tables_dst has {dst.num_caches} cache(s) x {dst.num_layers} layers but tables_src has "
                         f"{src.num_caches} x {src.num_layers}; they must match")
    if dst.dtype != src.dtype or dst.row_bytes != src.row_bytes:
        raise ValueError(f"tables_dst rows are {dst.row_bytes} B of {dst.dtype} but tables_src rows are "
                         f"{src.row_bytes} B of {src.dtype}; they must match")
    devices = {d for d in (dst.device, src.device) if d is not None}
    if not devices:
        raise ValueError("both sides are in host memory; one side of a transfer must be on the GPU")
    if len(devices) > 1:
        raise ValueError(f"the two sides are on different devices ({sorted(devices)})")
    device = devices.pop()
    plan = _Plan(device, dst_bases=(0, 0), src_bases=(0, 0), dst_tables=dst.tables(device),
                 src_tables=src.tables(device), num_layers=dst.num_layers, dst_stride=dst.stride,
                 src_stride=src.stride, row_bytes=dst.row_bytes, dst_rows=dst.rows, src_rows=src.rows,
                 to_device=src.device is None, to_host=dst.device is None, quota=quota, method=method,
                 host_memory=_table_host_memory(dst) + _table_host_memory(src))
    # The plan holds the addresses of the LayerTables' device pointer tables,
    # which live as long as the LayerTables, which the refs check.
    if key is not None:
        _keep(plans, key, plan, (dst, src))
    return plan.run(indices_dst, indices_src)


def transfer_pointer_tables(tables_dst, indices_dst, tables_src, indices_src, *, dst_stride_bytes: int,
                            src_stride_bytes: int, element_size: int, block_quota=None, method=None,
                            dst_rows: int | None = None, src_rows: int | None = None,
                            names: tuple = ("tables_dst", "tables_src")) -> str:
    """All-layer copy from raw per-layer address tables (what SGLang's pools keep).

    ``tables_dst`` / ``tables_src`` are ``(k_table, v_table)`` pairs or a
    single table for MLA: 1-D uint64 CUDA tensors with one row-0 address per
    layer. Addresses carry no size, so each is looked up in the allocation it
    lies in (pointer_tables.py, extents.py: the buffers registered there, torch's
    allocator, the CUDA driver), and each side's indices are bounded by the rows
    every layer's allocation holds; a table with an address in no known
    allocation is refused. ``dst_rows`` / ``src_rows`` (the slots every layer of
    that side holds), where the caller knows them, bound that side further.
    The kernel launches with a private copy of the addresses that were checked
    (pointer_tables.py says when a table is read again). It does not know which
    side is host memory, so 'auto' means plain loads and stores, which are fast
    in both directions (the bulk engine wins only for host -> GPU; ask for
    method='bulk' there). ``names``: what errors call the two sides (a name per
    side, or per table of the side).
    """
    dst = tables_dst if isinstance(tables_dst, tuple) else (tables_dst,)
    src = tables_src if isinstance(tables_src, tuple) else (tables_src,)
    if len(dst) != len(src) or len(dst) not in (1, 2):
        raise ValueError(f"tables_dst and tables_src must each be one table per cache, (k, v) for MHA or one "
                         f"table for MLA; got {len(dst)} and {len(src)}")
    # The integers first, on every call: a plan found by key would otherwise
    # accept True for 1 (equal and of equal hash).
    if not (type(element_size) is int and type(dst_stride_bytes) is int and type(src_stride_bytes) is int
            and element_size > 0 and dst_stride_bytes >= 0 and src_stride_bytes >= 0
            and not (element_size | dst_stride_bytes | src_stride_bytes) & 3):  # the common case, in one test
        for name, value in (("element_size", element_size), ("dst_stride_bytes", dst_stride_bytes),
                            ("src_stride_bytes", src_stride_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value % 4:
                raise ValueError(f"{name} must be a non-negative multiple of 4 bytes, got {value!r}")
        if element_size == 0:
            raise ValueError("element_size must be positive")
    for name, value in (("dst_rows", dst_rows), ("src_rows", src_rows)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None (unknown) or a positive int (slots of that side), got {value!r}")
    quota = 0 if block_quota is None else _quota(block_quota)
    # Each table checked against its allocations (cached per table: a few attribute reads when it is as
    # it was), and each side's rows: what every layer's allocation holds, and what the caller said.
    rows_dst, dst = _checked(dst, names[0], dst_stride_bytes, element_size)
    rows_src, src = _checked(src, names[1], src_stride_bytes, element_size)
    if dst_rows is not None:
        rows_dst = min(rows_dst, dst_rows)
    if src_rows is not None:
        rows_src = min(rows_src, src_rows)
    # Pools back up every layer through the same pointer tables on every
    # call: a plan for them skips the struct build. The checked tables stand
    # for the caller's (a table read again is a new record, so another key),
    # and refs (checked on a hit) make a dead record's reused id miss.
    try:
        plans = _local.plans
    except AttributeError:  # this thread's first transfer
        plans = _plan_cache()
    tables = dst + src
    key = (len(dst), dst_stride_bytes, src_stride_bytes, element_size, quota, method, rows_dst, rows_src,
           *map(id, tables))
    try:
        plan = plans.get(key)
    except TypeError:  # an unhashable method: the full path names it
        plan = key = None
    if plan is not None:
        refs = plan.refs
        if refs[0]() is tables[0] and refs[1]() is tables[1] and (len(refs) == 2 or (
                refs[2]() is tables[2] and refs[3]() is tables[3])):
            return plan.run(indices_dst, indices_src)
    devices = {t.device for t in tables}
    if len(devices) != 1:
        raise ValueError(f"the pointer tables must be on one GPU, got tables on {sorted(devices, key=str)}")
    layers = {t.count for t in tables}
    if len(layers) != 1:
        raise ValueError(f"every pointer table must have the same number of layers, got {sorted(layers)}")
    device = devices.pop()
    pad = [0, 0]
    # The kernel copies through the checked copies (launch) and first compares the caller's tables (live).
    dst_ptrs = tuple([t.launch.data_ptr() for t in dst] + pad[len(dst):])
    src_ptrs = tuple([t.launch.data_ptr() for t in src] + pad[len(src):])
    dst_live = tuple([t.live for t in dst] + pad[len(dst):])
    src_live = tuple([t.live for t in src] + pad[len(src):])
    plan = _Plan(device, dst_bases=(0, 0), src_bases=(0, 0), dst_tables=dst_ptrs, src_tables=src_ptrs,
                 dst_live=dst_live, src_live=src_live, num_layers=layers.pop(), dst_stride=dst_stride_bytes,
                 src_stride=src_stride_bytes, row_bytes=element_size, dst_rows=rows_dst, src_rows=rows_src,
                 to_device=False, quota=quota, method=method)
    # The plan holds the addresses of the checked tables' private copies, which live as long as the
    # records, which the refs check.
    if key is not None:
        _keep(plans, key, plan, tables)
    return plan.run(indices_dst, indices_src)


def _checked(tables: tuple, name, stride: int, row_bytes: int) -> tuple[int, list]:
    """(rows every layer of every table of one side holds, the checked tables): pointer_tables.py.
    ``name``: the side's argument name, or a tuple of one per table."""
    if isinstance(name, tuple):
        names = name
    else:
        names = (name,) if len(tables) == 1 else (f"{name}[k]", f"{name}[v]")
    rows, checked = None, []
    for t, n in zip(tables, names):
        c = pointer_tables.checked(t, n)
        if c.launch is None:
            raise ValueError(f"{n} must be on the GPU (the kernel reads it), got a CPU tensor")
        r = c.rows(stride, row_bytes, n)
        rows = r if rows is None or r < rows else rows
        checked.append(c)
    return rows, checked
