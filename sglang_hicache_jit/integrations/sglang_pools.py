"""Wrappers (AROUND hooks) for the SGLang 0.5.23 host-pool methods that raise
for some layout x io_backend x sharding cells, even with every op available.

Each wrapper lets the pool's own method run whenever that method has a branch
for the cell (its op names are routed by ``sglang_ops`` already), and only
steps in where the method would raise:

* ``io_backend='direct'`` on a ``page_first`` host buffer: the pool's kernel
  branch runs, with every routed op held to the copy engines, which is what
  'direct' asked for;
* ``io_backend='kernel'`` on ``page_first_direct``: the pool's direct branch
  runs (its ops are routed to this package's copy planner);
* the layer-sharded backups the pools refuse (MLA direct on a non-layer_first
  layout, MLA on page_first_direct, the DSA indexer on page_first or
  page_first_direct): one layer is copied here, from the device layer to the
  host layer's rows, through the same routed path.

SGLang's server arguments already steer users away from the first two cells
(``page_first`` + direct becomes ``page_first_direct``), so those only matter
for pools built directly; the sharded backups are what GLM-5 / DeepSeek-V3.2
deployments with the DSA cache layer split hit.
"""

from __future__ import annotations

import logging

from . import sglang_ops
from .. import direct, ops

log = logging.getLogger(__name__)


def _normalized(layout: str, io_backend: str):
    """(io_backend the pool method can run, whether to hold it to the copy engines)."""
    if io_backend == "direct" and layout == "page_first":
        return "kernel", True
    if io_backend == "kernel" and layout == "page_first_direct":
        return "direct", False
    return io_backend, False


def _run(original, self, args, io_backend, kwargs):
    backend, engines_only = _normalized(self.layout, io_backend)
    if engines_only:
        with sglang_ops.copy_engines_only():
            return original(self, *args, backend, **kwargs)
    return original(self, *args, backend, **kwargs)


def load_to_device_per_layer(original, self, device_pool, host_indices, device_indices, layer_id, io_backend,
                             **kwargs):
    return _run(original, self, (device_pool, host_indices, device_indices, layer_id), io_backend, kwargs)


def backup_from_device_all_layer(original, self, device_pool, host_indices, device_indices, io_backend, **kwargs):
    if getattr(self, "_layer_shard_enabled", False):
        return original(self, device_pool, host_indices, device_indices, io_backend, **kwargs)  # per-layer hooks
    return _run(original, self, (device_pool, host_indices, device_indices), io_backend, kwargs)


def _copy_layer(host_rows, host_index, device_rows, device_index, *, io_backend: str, row_bytes: int) -> None:
    """One layer, device -> host: through the kernel when asked and available, else the copy engines."""
    if io_backend == "kernel" and sglang_ops.kernel_available(row_bytes):
        ops.transfer_one_layer_mla(host_rows, host_index, device_rows, device_index)
    else:
        direct.copy_rows([(host_rows, device_rows)], host_index, device_index)


def mla_backup_from_device_per_layer(original, self, host_indices, device_indices, layer_id, io_backend, **kwargs):
    if self.layout == "layer_first" or (self.layout == "page_first" and io_backend == "kernel"):
        return original(self, host_indices, device_indices, layer_id, io_backend, **kwargs)
    if io_backend not in ("kernel", "direct"):
        return original(self, host_indices, device_indices, layer_id, io_backend, **kwargs)
    host_layer = self._host_layer_by_controller[layer_id]
    device_rows = self.device_kv_buffers[self._buffer_index_by_layer[layer_id]]
    device_rows = device_rows.view(device_rows.shape[0], -1)
    row_bytes = self.kv_cache_dim * self.dtype.itemsize
    if self.layout == "page_first":
        host_rows = self.data_refs[host_layer].view(self.data_refs[host_layer].shape[0], -1)
        host_index = host_indices
    elif self.layout == "page_first_direct":
        host_rows, host_index = sglang_ops._page_first_direct_rows(self.kv_buffer, host_layer,
                                                                   self.kv_buffer.shape[2], host_indices)
    else:
        return original(self, host_indices, device_indices, layer_id, io_backend, **kwargs)
    _copy_layer(host_rows, host_index, device_rows, device_indices, io_backend=io_backend, row_bytes=row_bytes)


def dsa_backup_from_device_per_layer(original, self, device_pool, host_indices, device_indices, layer_id,
                                     io_backend, *, is_draft: bool = False, **kwargs):
    if self.layout == "layer_first" and self.indexer_page_stride_size % 8 == 0 or io_backend not in ("kernel",
                                                                                                      "direct"):
        return original(self, device_pool, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft,
                        **kwargs)
    host_layer = self._draft_host_layer(layer_id) if is_draft else self._host_layer_index(layer_id)
    device_layer = 0 if is_draft else layer_id
    host_pages, device_pages = self._get_indexer_page_indices(host_indices, device_indices)
    item = self.indexer_page_stride_size * self.indexer_dtype.itemsize
    device_rows = device_pool.index_k_with_scale_buffer[device_layer]
    device_rows = device_rows.view(device_rows.shape[0], -1)
    host = self.index_k_with_scale_buffer
    if self.layout == "layer_first":
        host_rows = host[host_layer].view(host.shape[1], -1)
    else:  # page_first and page_first_direct share one (pages, layers, 1, page_bytes) buffer
        host_rows = sglang_ops._layer_of(host, host_layer, item, self.indexer_layout_dim * self.indexer_dtype.itemsize)
    _copy_layer(host_rows, host_pages, device_rows, device_pages, io_backend=io_backend, row_bytes=item)


def dsa_load_to_device_per_layer(original, self, device_pool, host_indices, device_indices, layer_id, io_backend,
                                 **kwargs):
    return _run(original, self, (device_pool, host_indices, device_indices, layer_id), io_backend, kwargs)


def dsa_backup_from_device_all_layer(original, self, device_pool, host_indices, device_indices, io_backend,
                                     **kwargs):
    if self._is_device_layer_sharded(device_pool):
        return original(self, device_pool, host_indices, device_indices, io_backend, **kwargs)
    return _run(original, self, (device_pool, host_indices, device_indices), io_backend, kwargs)


# Ops whose device addresses come from pointer tables, which carry no
# stride: SGLang's packed-rows guard must still stop those for strided rows.
# Every other guarded op is routed to code that reads the tensors' strides.
_STRIDE_BLIND_OPS = frozenset({
    "transfer_kv_all_layer", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_all_layer_lf_ph",
})


def require_packed_device_rows(original, self, kernel: str):
    if kernel in _STRIDE_BLIND_OPS:
        return original(self, kernel)
    return None


def describe_pool(result, self, *args, **kwargs):
    """AFTER hook on a pool's transfer-view setup: one INFO line with its path."""
    try:
        row_bytes = _row_bytes_of(self)
        path = sglang_ops.path_for(row_bytes) if row_bytes else "unknown"
        log.info("sglang-hicache-jit: %s (layout=%s, %s B rows) transfers through the %s path", type(self).__name__,
                 getattr(self, "layout", "?"), row_bytes, "JIT kernel" if path == "kernel" else "copy-engine")
    except Exception as exc:  # a log line must never break a pool
        log.debug("sglang-hicache-jit: could not describe %s: %s", type(self).__name__, exc)
    return result


def _row_bytes_of(pool) -> int | None:
    if hasattr(pool, "kv_cache_dim"):
        return pool.kv_cache_dim * pool.dtype.itemsize
    if hasattr(pool, "element_dim"):
        return pool.element_dim * pool.dtype.itemsize
    if hasattr(pool, "indexer_page_stride_size"):
        return pool.indexer_page_stride_size * pool.indexer_dtype.itemsize
    return None
