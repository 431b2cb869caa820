"""AROUND and AFTER hooks on SGLang's host-pool methods that raise for some
layout x io_backend x sharding cells, even with every op routed.

Each hook lets the pool's own method run whenever that method has a branch
for the cell (its op names are routed by ``ops`` already), and steps in only
where the method would raise:

* ``io_backend='direct'`` on a ``page_first`` host buffer: the pool's kernel
  branch runs, with every routed op held to the copy engines, which is what
  'direct' asked for;
* ``io_backend='kernel'`` on ``page_first_direct``: the pool's direct branch
  runs (its ops are routed to this package's copy planner);
* the layer-sharded backups the pools refuse (MLA on ``page_first`` without
  the JIT kernel, which is the error this package was started for; MLA direct
  on a non-``layer_first`` layout; MLA on ``page_first_direct``; the DSA
  indexer on ``page_first`` or ``page_first_direct``): one layer is copied
  here, from the device layer to the host layer's rows, through the routed path.

Where releases differ, a hook exists once per release family, newest first,
each declaring with ``@needs`` what it uses of the pool (``matching.py``): the
plugin picks, per method, the first hook whose needs the installed release
meets. The families differ only in where a layer's device rows and host
layer come from:

* 0.5.16-0.5.21: the device pool is an argument (``device_pool.kv_buffer``);
* 0.5.22: the host pool holds the device buffers (``self.device_kv_buffers``);
* 0.5.23: it also maps layers through ``_host_layer_by_controller`` and
  ``_buffer_index_by_layer``.
"""

from __future__ import annotations

import logging
import re
import weakref

import torch

from . import announce
from . import ops as routed
from ...transfer import direct, extents, ops, route
from .matching import needs

log = logging.getLogger(__name__)


_told: set = set()  # (pool class, hook) pairs already logged by _lacks


def _lacks(self, hook) -> bool:
    """Whether this pool lacks an attribute ``hook`` reads (its declared needs): a subclass that never sets
    ``layout``, or a pool used before its __init__ set it. The plan checks the release's classes, not each
    instance; without the attribute the hook cannot tell the cell, so the pool's own method runs, exactly as
    without the plugin (once per class and hook a WARNING says so), rather than the hook's AttributeError."""
    missing = [name for name in sorted(hook.needs.attributes) if not hasattr(self, name)]
    if not missing:
        return False
    told = (type(self), hook.__name__)
    if told not in _told:
        _told.add(told)
        method = re.sub(r"^(mla|dsa)_|_05[0-9]+$", "", hook.__name__)  # the hook's family names the method
        log.warning("sglang-hicache-jit: %s has no %s, so the plugin leaves its %s to SGLang's own code",
                    type(self).__qualname__, ", ".join(missing), method)
    return True


# ---------------------------------------------------------------------------
# The buffers behind the pools' pointer tables.
#
# SGLang's all-layer ops take per-layer address tables that carry no size (``data_ptrs``,
# ``k_data_ptrs``, ``device_data_ptrs``, ...). Each pool builds them from per-layer tensors it keeps, so
# registering those (transfer/extents.py) lets the routed ops bound every index by one layer of one
# pool, where the CUDA allocation alone (a cudaHostRegister'd host buffer of all layers, a segment of
# torch's allocator) would let an index past a layer reach the next layer's rows. Only lists of
# per-layer tensors are registered: the pools' whole buffers and their column views (an MLA pool's
# ``k_buffer``) would bound a layer too loosely or too tightly.
HOST_POOL_LAYER_LISTS = ("data_refs", "k_data_refs", "v_data_refs", "index_k_data_refs", "device_kv_buffers",
                         "device_k_buffers", "device_v_buffers", "packed_device_kv_buffers",
                         "packed_device_k_buffers", "packed_device_v_buffers", "packed_device_index_buffers")
DEVICE_POOL_LAYER_LISTS = ("kv_buffer", "k_buffer", "v_buffer", "index_k_with_scale_buffer")
_registered: dict = {}  # id(pool) -> weak reference to it: pools whose buffers a transfer registered


def register_pool(pool, names=HOST_POOL_LAYER_LISTS, *, again: bool = False) -> None:
    """Registers the per-layer tensors of ``pool`` held in its list attributes ``names`` (and those of the
    device pool it keeps, if any): once per pool, or ``again`` (after the pool set up its transfer views).
    Reads only what it finds; never raises."""
    if pool is None:
        return
    hit = _registered.get(id(pool))
    if hit is not None and hit() is pool and not again:
        return
    try:
        ref = weakref.ref(pool)
    except TypeError:  # a class without weak references: kept, as pools live as long as the process
        ref = lambda: pool  # noqa: E731
    try:
        for name in names:
            layers = getattr(pool, name, None)
            if isinstance(layers, (list, tuple)):
                for i, layer in enumerate(layers):
                    if isinstance(layer, torch.Tensor) and layer.layout == torch.strided and not layer.is_meta:
                        extents.register(layer, f"{type(pool).__name__}.{name}[{i}]")
        if names is HOST_POOL_LAYER_LISTS:
            register_pool(getattr(pool, "device_pool", None), DEVICE_POOL_LAYER_LISTS, again=again)
        if len(_registered) >= 256:
            _registered.clear()
        _registered[id(pool)] = ref
    except Exception as exc:  # a registration must never break a pool: its tables are then bounded by CUDA
        log.debug("sglang-hicache-jit: could not register the buffers of %s: %s", type(pool).__name__, exc)


def _normalized(layout: str, io_backend: str):
    """(io_backend the pool method can run, whether to hold it to the copy engines)."""
    if io_backend == "direct" and layout == "page_first":
        return "kernel", True
    if io_backend == "kernel" and layout == "page_first_direct":
        return "direct", False
    return io_backend, False


def _run(original, self, args, io_backend, kwargs):
    register_pool(self)
    register_pool(args[0], DEVICE_POOL_LAYER_LISTS)  # the device pool these methods take
    backend, engines_only = _normalized(self.layout, io_backend)
    if engines_only:
        with route.copy_engines_only(small_copies_on_kernel=True):  # what io_backend='direct' means (route.io_path)
            return original(self, *args, backend, **kwargs)
    return original(self, *args, backend, **kwargs)


@needs(kwargs={"is_draft": False}, attributes={"layout"})
def load_to_device_per_layer(original, self, device_pool, host_indices, device_indices, layer_id, io_backend,
                             **kwargs):
    if _lacks(self, load_to_device_per_layer):
        return original(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs)
    return _run(original, self, (device_pool, host_indices, device_indices, layer_id), io_backend, kwargs)


@needs(attributes={"layout"})
def backup_from_device_all_layer(original, self, device_pool, host_indices, device_indices, io_backend):
    if _lacks(self, backup_from_device_all_layer):
        return original(self, device_pool, host_indices, device_indices, io_backend)
    # A layer-sharded pool backs up layer by layer through _backup_from_device_per_layer,
    # which the hooks below serve for every (normalized) cell.
    return _run(original, self, (device_pool, host_indices, device_indices), io_backend, {})


def _copy_layer(host_rows, host_index, device_rows, device_index, *, io_backend: str, row_bytes: int,
                to_rows=None, page_size: int = 1) -> None:
    """One layer, device -> host: through the kernel when asked and available (route.hook_path), else the copy
    engines, planned once per index bytes (route.copy: the layers of one layer-sharded backup share a plan),
    except copies the copy engines would take one small copy at a time (route.small_copies).
    ``to_rows`` maps host token indices to rows of ``host_rows`` (a layout.TokenRows; None: the identity)."""
    quota = None  # the kernel's measured default
    if route.hook_path(io_backend, row_bytes, before_probe=announce.flush) != "kernel":
        direct.check_pair(host_index, device_index)
        pairs = direct.Pairs([(host_rows, device_rows)])
        if not route.small_copies(pairs, page_size, before_probe=announce.flush):
            route.copy(pairs, host_index, device_index, page_size=page_size, dst_map=to_rows)
            return
        quota = route.SMALL_COPY_CTAS  # 'direct' copies under SMALL_COPY_BYTES: the kernel at a CTA budget of 1
    ops.transfer_one_layer_mla(host_rows, host_index if to_rows is None else to_rows(host_index), device_rows,
                               device_index, block_quota=quota)


# ---------------------------------------------------------------------------
# MLA, one layer of a layer-sharded backup.

def _mla_method_serves(self, io_backend) -> bool:
    """Whether the pool's own per-layer backup has a branch for this cell."""
    if io_backend not in ("kernel", "direct") or self.layout not in ("page_first", "page_first_direct"):
        return True  # other backends and layouts: the method says what it supports
    return self.layout == "page_first" and io_backend == "kernel" and self.can_use_jit


def _mla_backup_layer(self, host_layer, device_rows, host_indices, device_indices, io_backend) -> None:
    device_rows = device_rows.view(device_rows.shape[0], -1)
    to_rows, page_size = None, 1
    if self.layout == "page_first":
        host_rows = self.data_refs[host_layer]
        host_rows = host_rows.view(host_rows.shape[0], -1)
    else:  # page_first_direct: (pages, layers, page_size, 1, dim)
        host_rows, to_rows, page_size = routed.page_first_direct_rows(self.kv_buffer, host_layer)
    _copy_layer(host_rows, host_indices, device_rows, device_indices, io_backend=io_backend,
                row_bytes=self.kv_cache_dim * self.dtype.itemsize, to_rows=to_rows, page_size=page_size)


_MLA_POOL = ("layout", "can_use_jit", "data_refs", "kv_buffer", "kv_cache_dim", "dtype")


@needs(kwargs={"is_draft": False}, attributes={*_MLA_POOL, "_host_layer_by_controller", "device_kv_buffers",
                                               "_buffer_index_by_layer"})
def mla_backup_from_device_per_layer(original, self, host_indices, device_indices, layer_id, io_backend, **kwargs):
    """0.5.23: host and device layers through the pool's own maps (draft layers included)."""
    if _lacks(self, mla_backup_from_device_per_layer) or _mla_method_serves(self, io_backend):
        return original(self, host_indices, device_indices, layer_id, io_backend, **kwargs)
    _mla_backup_layer(self, self._host_layer_by_controller[layer_id],
                      self.device_kv_buffers[self._buffer_index_by_layer[layer_id]], host_indices, device_indices,
                      io_backend)


@needs(kwargs={"is_draft": False}, attributes={*_MLA_POOL, "_host_layer_index", "device_kv_buffers"},
       absent={"_buffer_index_by_layer"})
def mla_backup_from_device_per_layer_0522(original, self, host_indices, device_indices, layer_id, io_backend,
                                          **kwargs):
    """0.5.22: the pool holds the device buffers, indexed by layer; a draft layer's host layer is its id."""
    if _lacks(self, mla_backup_from_device_per_layer_0522) or _mla_method_serves(self, io_backend):
        return original(self, host_indices, device_indices, layer_id, io_backend, **kwargs)
    host_layer = layer_id if kwargs.get("is_draft", False) else self._host_layer_index(layer_id)
    _mla_backup_layer(self, host_layer, self.device_kv_buffers[layer_id], host_indices, device_indices, io_backend)


@needs(kwargs={"is_draft": False}, attributes={*_MLA_POOL, "_host_layer_index"}, reads={"device_pool": {"kv_buffer"}})
def mla_backup_from_device_per_layer_0516(original, self, device_pool, host_indices, device_indices, layer_id,
                                          io_backend, **kwargs):
    """0.5.16-0.5.21: the device pool is an argument; a draft layer has its own one-layer pool."""
    if _lacks(self, mla_backup_from_device_per_layer_0516) or _mla_method_serves(self, io_backend):
        return original(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs)
    draft = kwargs.get("is_draft", False)
    host_layer = layer_id if draft else self._host_layer_index(layer_id)
    _mla_backup_layer(self, host_layer, device_pool.kv_buffer[0 if draft else layer_id], host_indices,
                      device_indices, io_backend)


# ---------------------------------------------------------------------------
# DSA indexer, one layer of a layer-sharded backup (rows are whole index pages).

def _dsa_method_serves(self, io_backend) -> bool:
    if io_backend not in ("kernel", "direct") or self.layout not in ("layer_first", "page_first",
                                                                     "page_first_direct"):
        return True  # other backends and layouts: the method says what it supports
    # Its kernel branch needs 8-byte multiples of the index page stride.
    kernel_ok = io_backend == "kernel" and self.indexer_page_stride_size % 8 == 0
    return self.layout == "layer_first" and (kernel_ok or io_backend == "direct")


def _dsa_backup_layer(self, device_pool, host_indices, device_indices, host_layer, device_layer, io_backend):
    host_pages, device_pages = self._get_indexer_page_indices(host_indices, device_indices)
    item = self.indexer_page_stride_size * self.indexer_dtype.itemsize
    device_rows = device_pool.index_k_with_scale_buffer[device_layer]
    device_rows = device_rows.view(device_rows.shape[0], -1)
    host = self.index_k_with_scale_buffer
    if self.layout == "layer_first":
        host_rows = host[host_layer].view(host.shape[1], -1)
    else:  # page_first and page_first_direct share one (pages, layers, 1, page_bytes) buffer
        host_rows = routed.layer_of(host, host_layer, item, self.indexer_layout_dim * self.indexer_dtype.itemsize)
    _copy_layer(host_rows, host_pages, device_rows, device_pages, io_backend=io_backend, row_bytes=item)


_DSA_POOL = ("layout", "indexer_page_stride_size", "_host_layer_index", "_get_indexer_page_indices", "indexer_dtype",
             "index_k_with_scale_buffer", "indexer_layout_dim")


@needs(kwargs={"is_draft": False}, attributes={*_DSA_POOL, "_draft_host_layer"},
       reads={"device_pool": {"index_k_with_scale_buffer"}})
def dsa_backup_from_device_per_layer(original, self, device_pool, host_indices, device_indices, layer_id,
                                     io_backend, **kwargs):
    """0.5.22+: a draft layer's host layer comes from the pool (_draft_host_layer)."""
    if _lacks(self, dsa_backup_from_device_per_layer) or _dsa_method_serves(self, io_backend):
        return original(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs)
    draft = kwargs.get("is_draft", False)
    host_layer = self._draft_host_layer(layer_id) if draft else self._host_layer_index(layer_id)
    _dsa_backup_layer(self, device_pool, host_indices, device_indices, host_layer, 0 if draft else layer_id,
                      io_backend)


@needs(kwargs={"is_draft": False}, attributes=_DSA_POOL, reads={"device_pool": {"index_k_with_scale_buffer"}},
       absent={"_draft_host_layer"})
def dsa_backup_from_device_per_layer_0516(original, self, device_pool, host_indices, device_indices, layer_id,
                                          io_backend, **kwargs):
    """0.5.16-0.5.21: a draft layer's host layer is its id."""
    if _lacks(self, dsa_backup_from_device_per_layer_0516) or _dsa_method_serves(self, io_backend):
        return original(self, device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs)
    draft = kwargs.get("is_draft", False)
    host_layer = layer_id if draft else self._host_layer_index(layer_id)
    _dsa_backup_layer(self, device_pool, host_indices, device_indices, host_layer, 0 if draft else layer_id,
                      io_backend)


# ---------------------------------------------------------------------------

# Ops whose device addresses come from pointer tables, which carry no
# stride: SGLang's packed-rows guard must still stop those for strided rows.
# Every other guarded op is routed to code that reads the tensors' strides.
_STRIDE_BLIND_OPS = frozenset({
    "transfer_kv_all_layer", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_all_layer_lf_ph",
})


@needs()
def require_packed_device_rows(original, self, kernel):
    if kernel in _STRIDE_BLIND_OPS:
        return original(self, kernel)
    return None


def describe_pool(result, self, *args, **kwargs):
    """AFTER hook on a pool's transfer setup: the plugin's start line (once per process, see announce.py)
    and one INFO line with the path each io_backend takes for this pool. Reads only what it finds."""
    announce.flush()
    register_pool(self, again=True)  # the pool's transfer views are set up now
    try:
        row_bytes = _row_bytes_of(self)
        layout = getattr(self, "layout", "?")
        path = routed.path_for(row_bytes) if row_bytes else "unknown"
        copy_bytes = _direct_copy_bytes(self, layout, row_bytes) if row_bytes else None
        log.info("sglang-hicache-jit: %s (layout=%s, %s B rows) transfers through %s", type(self).__name__, layout,
                 row_bytes, paths_by_backend(layout, path, copy_bytes))
    except Exception as exc:  # a log line must never break a pool
        log.debug("sglang-hicache-jit: could not describe %s: %s", type(self).__name__, exc)
    return result


def paths_by_backend(layout: str, row_path: str, copy_bytes: int | None = None) -> str:
    """What runs for each io_backend: 'kernel' the JIT kernel where its rows have it, except on
    page_first_direct, whose kernel requests the pool serves through its direct branch; 'direct' the copy
    engines, or the kernel at one CTA where each copy (``copy_bytes``: a page of a layer, or one row of a
    page_first layer) is under route.SMALL_COPY_BYTES (route.small_copies)."""
    if row_path != "kernel":
        why = "the JIT kernel is not used for these rows" if row_path == "direct" else "row size unknown"
        return f"the copy engines with either io_backend ({why})"
    if copy_bytes is not None and copy_bytes < route.SMALL_COPY_BYTES:
        direct_path = f"the JIT kernel at {route.SMALL_COPY_CTAS} CTA ({copy_bytes}-B copies)"
    else:
        direct_path = "the copy engines"
    if layout == "page_first_direct":
        return f"{direct_path} with either io_backend (page_first_direct moves whole pages)"
    return f"the JIT kernel with io_backend=kernel, {direct_path} with io_backend=direct"


def _direct_copy_bytes(pool, layout: str, row_bytes: int) -> int | None:
    """One 'direct' copy's bytes for this pool: a page of a layer, or one row where the host layout strides
    a layer's rows (page_first)."""
    page = getattr(pool, "page_size", None)
    if layout == "page_first":
        return row_bytes
    return row_bytes * page if isinstance(page, int) and page > 0 else None


def _row_bytes_of(pool) -> int | None:
    if hasattr(pool, "kv_cache_dim"):
        return pool.kv_cache_dim * pool.dtype.itemsize
    if hasattr(pool, "element_dim"):
        return pool.element_dim * pool.dtype.itemsize
    if hasattr(pool, "indexer_page_stride_size"):
        return pool.indexer_page_stride_size * pool.indexer_dtype.itemsize
    return None
