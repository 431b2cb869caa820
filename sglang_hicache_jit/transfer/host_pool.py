"""Host-memory KV pools for SGLang's HiCache: every layout x IO backend x operation.

Why one long module: one class (HostKVPool) carries SGLang's host-pool API; its methods are the
matrix of layouts x IO backends x operations and share the pool's buffers and views.

``MLAHostKVPool`` and ``MHAHostKVPool`` keep the method names and argument
order of SGLang's ``MLATokenToKVPoolHost`` / ``MHATokenToKVPoolHost``
(``backup_from_device_all_layer``, ``load_to_device_per_layer``, ``alloc``,
``free``, the storage page API). What differs is that no cell of the matrix
raises: each transfer runs through

* the **kernel** path (ops.py: one launch per layer, or one for all layers)
  when the probe says the kernel works for this row size on this GPU, or
* the **direct** path (direct.py: copy engines, one batched submission per
  transfer) otherwise, and whenever ``io_backend="direct"``.

Which one runs is route.py's decision: the pool's path once, at construction
(kept in ``transfer_path`` and ``transfer_path_reason``; a pool that falls
back to the direct path says so once, at WARNING), then per call for the
``io_backend`` asked; route.py also plans the direct path's copies.

Host buffers follow layout.py (``L`` host layers, row shape ``R`` = ``(1, D)``
for MLA, ``(H, Dh)`` for MHA; MHA adds a leading K/V dimension of 2): one
layer's rows and the token -> row map of ``page_first_direct`` come from
there, so both paths see a plain strided layer. Layer sharding: a device pool
with ``owned_layers=(start, end)`` gets ``end - start`` host layers; device
layer ``l`` lives in host layer ``l - start`` and other layers are skipped
(docs/concepts.md, layer sharding).
"""

from __future__ import annotations

import logging
import math
import operator
import threading
import weakref
from dataclasses import dataclass

import torch

from . import bounds, cuda, direct, route
from . import layout as host_layout
from .. import settings
from .checks import check_dense, check_index_tensor
from .slot_allocator import SlotAllocator

log = logging.getLogger("sglang_hicache_jit.host_pool")  # its name from before the move to a subpackage (issue 20)

LAYOUTS = host_layout.LAYOUTS
IO_BACKENDS = route.IO_BACKENDS
_logged_choices: set = set()  # (path, reason) pairs already logged in this process


@dataclass
class MLADevicePool:
    """The device side of an MLA pool: one ``[slots, 1, D]`` tensor per layer.

    ``owned_layers=(start, end)`` turns on layer sharding: this rank owns
    device layers ``[start, end)``; entries outside it are never touched.
    """

    kv_buffer: list
    owned_layers: tuple | None = None


@dataclass
class MHADevicePool:
    """The device side of an MHA pool: per-layer ``[slots, H, Dh]`` K and V tensors."""

    k_buffer: list
    v_buffer: list
    owned_layers: tuple | None = None


def _log_choice_once(path: str, reason: str) -> None:
    key = (path, reason)
    if key in _logged_choices:
        return
    _logged_choices.add(key)
    if path == "kernel":
        log.info("HiCache host pool: kernel path (%s)", reason)
    else:
        log.warning("HiCache host pool: direct (copy-engine) path, because %s", reason)


# The kernel's paths (route.io_path): (method, block_quota) for the ops; None: the op's measured default.
_KERNEL_PATHS = {"kernel": (None, None), "resident": ("resident", None), "kernel-small": (None, route.SMALL_COPY_CTAS)}
_STAGING_INIT = threading.Lock()  # a device side's staging area is made once, on a backup thread's first call


class _DeviceSide:
    """A device pool reduced to what transfers need, built once per device pool."""

    def __init__(self, caches: list[list], owned: tuple[int, int]):
        start, end = owned
        self.caches = caches                     # [cache][device layer] tensors
        self.owned = owned
        self.rows = [[direct.Rows(caches[c][l], f"device layer {l}") for l in range(start, end)]
                     for c in range(len(caches))]  # [cache][owned layer - start]
        self._table = None                       # ops.LayerTable over owned layers, built on first kernel use
        self.pairs: dict = {}                    # direct.Pairs by ('load', host layer) or ('backup',)
        self.staging = None                      # staging.PageStaging, False where none applies; see _staging
        self.group_loads = None                  # staged_loads.GroupLoads over that area, made on first use

    def table(self):
        if self._table is None:
            from .ops import LayerTable

            start, end = self.owned
            layers = [self.caches[c][start:end] for c in range(len(self.caches))]
            self._table = LayerTable(layers[0] if len(layers) == 1 else tuple(layers), name="device_pool")
        return self._table


class HostKVPool:
    """Shared logic of the MLA and MHA host pools: allocator, layouts, sharding,
    path choice and both transfer paths. Subclasses only say what their caches are."""

    num_caches = 0     # 1 (MLA: kv) or 2 (MHA: k and v)

    # -- what subclasses describe -------------------------------------------------
    @classmethod
    def _device_caches(cls, device_pool) -> list[list]:
        """[cache][device layer] tensors of ``device_pool``."""
        raise NotImplementedError

    def _cache_buffers(self) -> list[torch.Tensor]:
        """One host buffer per cache (views into ``kv_buffer``)."""
        raise NotImplementedError

    # -- construction ---------------------------------------------------------------
    def __init__(self, device_pool, *, size: int, page_size: int, layout: str, pin_memory: bool = True):
        for name, value in (("size", size), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if page_size > size:  # size is rounded up to whole pages: 4 slots of 2**40-slot pages asked for 70 TB
            raise ValueError(f"page_size ({page_size}) must not exceed size ({size} token slots)")
        host_layout.check_layout(layout)
        caches = self._device_caches(device_pool)
        self.device_pool = device_pool
        self.layer_num_device = len(caches[0])
        self.owned_layers = _owned_range(device_pool, self.layer_num_device)
        start, end = self.owned_layers
        first = caches[0][start]
        for c, layers in enumerate(caches):
            for l in range(start, end):
                t = layers[l]
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"device_pool layer {l} must be a torch.Tensor, got {type(t).__name__}")
                check_dense(f"device_pool layer {l}", t)
                if (t.dtype, t.shape[1:], t.device) != (first.dtype, first.shape[1:], first.device):
                    raise ValueError(f"device_pool layers must share dtype, row shape and device; layer {l} has "
                                     f"{t.dtype} {tuple(t.shape[1:])} on {t.device}, layer {start} has "
                                     f"{first.dtype} {tuple(first.shape[1:])} on {first.device}")
        self.layout = layout
        self.page_size = page_size
        self.page_num = -(-size // page_size)  # in integers: a float division loses slots past 2**53
        self.size = self.page_num * page_size
        self.layer_num = end - start
        self.dtype = first.dtype
        self.row_shape = tuple(first.shape[1:])
        self.row_bytes = math.prod(self.row_shape) * first.element_size()
        # One direct-path copy: a page of a layer where the layout keeps it contiguous, else one row.
        self.copy_bytes = host_layout.copy_bytes(layout, layers=self.layer_num, row_bytes=self.row_bytes,
                                                 page_size=page_size)
        nbytes = self.size * self.layer_num * self.row_bytes * self.num_caches
        if nbytes >= 1 << 63:  # past what a tensor can address (torch raised an overflow RuntimeError)
            kv = " for K and V" if self.num_caches == 2 else ""
            raise ValueError(f"size ({size} token slots) is too large: {self.layer_num} layers of "
                             f"{self.row_bytes}-byte rows{kv} would take {nbytes} bytes")
        self.device = "cpu"
        self.pin_memory = bool(pin_memory) and first.is_cuda  # pinning only matters with a GPU on the other side
        self.kv_buffer = self._allocate(first.device)
        self._host_rows = self._host_layer_rows()    # [cache][host layer] Rows
        # Host token -> row of a layer's rows (None: the identity); a key of route.py's plans.
        self._host_map = host_layout.token_rows(layout, layers=self.layer_num, page_size=page_size, slots=self.size)
        self._device_sides: dict[int, tuple[object, _DeviceSide]] = {}
        self._device_side(device_pool)               # validates the owned layers once
        self._host_table = None
        self.staging_bytes = settings.staging_bytes()  # GPU memory page_first backups may stage through
        self.direct_mode = "auto"      # how the direct path submits CUDA copies: direct.MODES
        # Experimental (staged_loads.py; benchmarks only until measured): loads with CPU indices take this many
        # layers at once through the staging area, at the group's first layer; 0 or 1: layer by layer.
        self.load_group = 0
        self._group_loaded = threading.local()  # .last: this thread's last group load (_GroupLoad)
        self.last_direct_mode = None   # what the last direct transfer ran: 'batch', '2d', 'torch' or 'staged'
        self.transfer_path, self.transfer_path_reason = route.pool_path(first, pinned=self.pin_memory,
                                                                        row_bytes=self.row_bytes)
        _log_choice_once(self.transfer_path, self.transfer_path_reason)
        self.allocator = SlotAllocator(self.size, self.page_size)
        self.lock = self.allocator.lock

    def _buffer_shape(self) -> tuple:
        shape = host_layout.buffer_shape(self.layout, layers=self.layer_num, slots=self.size, page_size=self.page_size,
                                         row_shape=self.row_shape)
        return shape if self.num_caches == 1 else (self.num_caches, *shape)

    def _allocate(self, device_of_pool: torch.device) -> torch.Tensor:
        buffer = torch.empty(self._buffer_shape(), dtype=self.dtype, device="cpu")
        if self.pin_memory:
            # Register the exact bytes (as upstream does) rather than torch's
            # pinned allocator, which rounds each block up to a power of two.
            runtime = cuda.cuda_runtime()
            nbytes = buffer.numel() * buffer.element_size()
            try:
                with torch.cuda.device(device_of_pool):
                    runtime.host_register(buffer.data_ptr(), nbytes)
            except RuntimeError as exc:
                raise RuntimeError(f"pinning the {nbytes / 1e9:.2f} GB host pool failed ({exc}); free host memory, "
                                   "raise the locked-memory limit (ulimit -l), shrink size, or pass "
                                   "pin_memory=False (the direct path then copies through pageable memory, "
                                   "slower)") from exc
            weakref.finalize(buffer, _unregister, runtime, buffer.data_ptr())
        return buffer

    def _host_layer_rows(self) -> list[list[direct.Rows]]:
        """[cache][host layer] Rows: each layer of each cache as layout.layer_rows views it."""
        return [[direct.Rows(host_layout.layer_rows(buf, self.layout, h), f"host layer {h}")
                 for h in range(self.layer_num)] for buf in self._cache_buffers()]

    # -- device pools and indices ------------------------------------------------
    def _device_side(self, device_pool) -> _DeviceSide:
        entry = self._device_sides.get(id(device_pool))
        if entry is not None and entry[0] is device_pool:
            return entry[1]
        caches = self._device_caches(device_pool)
        owned = _owned_range(device_pool, len(caches[0]))
        if len(caches[0]) != self.layer_num_device or owned != self.owned_layers:
            raise ValueError(f"device_pool does not match this host pool: it has {len(caches[0])} layers owning "
                             f"{owned}, the host pool was built for {self.layer_num_device} layers owning "
                             f"{self.owned_layers}")
        start, end = owned
        for c, layers in enumerate(caches):
            for l in range(start, end):
                t = layers[l]
                if not isinstance(t, torch.Tensor) or t.dtype != self.dtype or tuple(t.shape[1:]) != self.row_shape:
                    got = f"{t.dtype} rows of {tuple(t.shape[1:])}" if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"device_pool does not match this host pool: layer {l} holds {got}, expected "
                                     f"{self.dtype} rows of {self.row_shape}")
                check_dense(f"device_pool layer {l}", t)
        side = _DeviceSide(caches, owned)
        if len(self._device_sides) >= 4:  # a pool serves one or two device pools; keep the cache small
            self._device_sides.clear()
        # Keep device_pool referenced so its id is not reused while the entry lives.
        self._device_sides[id(device_pool)] = (device_pool, side)
        return side

    def translate_host_indices(self, host_indices: torch.Tensor) -> torch.Tensor:
        """Host token indices -> row indices of the per-layer views (identity except
        for page_first_direct with several layers; layout.token_rows). Negative indices
        stay negative; an index past the pool is refused before it is multiplied."""
        return host_indices if self._host_map is None else self._host_map(host_indices)

    def _check_index_pair(self, host_indices, device_indices) -> None:
        for name, indices in (("host_indices", host_indices), ("device_indices", device_indices)):
            check_index_tensor(name, indices)
            check_dense(name, indices)  # the direct path reads them on the CPU
        if host_indices.shape[0] != device_indices.shape[0]:
            raise ValueError(f"host_indices has {host_indices.shape[0]} entries but device_indices has "
                             f"{device_indices.shape[0]}; they must have the same length")

    def _stages(self) -> bool:
        """Whether this pool's copy-engine backups go through a staging area (route.pool_stages)."""
        return route.pool_stages(self.layout, layers=self.layer_num, pinned=self.pin_memory,
                                 budget_bytes=self.staging_bytes,
                                 page_bytes=self.page_size * self.layer_num * self.row_bytes * self.num_caches)

    def _path(self, io_backend, operation: str, device_indices=None) -> str:
        staged = operation == "backup" and self._stages()
        return route.io_path(io_backend, operation, pool_path=self.transfer_path, copy_bytes=self.copy_bytes,
                             device_indices=device_indices, layout=self.layout, staged=staged,
                             direct_mode=self.direct_mode)

    def _layer(self, layer_id) -> int:
        try:
            layer = operator.index(layer_id)
        except TypeError:
            raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}") from None
        if not 0 <= layer < self.layer_num_device:
            raise ValueError(f"layer_id {layer} is out of range for a device pool of {self.layer_num_device} layers")
        return layer

    # -- transfers -------------------------------------------------------------------
    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend) -> None:
        """Host -> device for one layer: ``device[layer_id][device_indices[i]] =
        host[layer_id - start][host_indices[i]]``. A layer this rank does not own
        is a silent no-op (as upstream). With ``load_group`` G > 1 (experimental) and CPU indices, the call
        for a group's first layer loads its G layers at once, reading all of them from the host then, and
        the calls for the others with indices of the same values only order the caller's stream after it."""
        layer = self._layer(layer_id)
        self._check_index_pair(host_indices, device_indices)
        path = self._path(io_backend, "load", device_indices)
        start, end = self.owned_layers
        if not start <= layer < end:
            return
        side = self._device_side(device_pool)
        host_layer = layer - start
        if self.load_group > 1 and self._group_load(side, host_indices, device_indices, host_layer):
            self.last_direct_mode = "staged"
            return
        if path in _KERNEL_PATHS:
            from . import ops

            host_rows = self.translate_host_indices(host_indices)
            method, quota = _KERNEL_PATHS[path]
            if self.num_caches == 1:
                ops.transfer_one_layer_mla(side.caches[0][layer], device_indices,
                                           self._host_rows[0][host_layer].tensor, host_rows, method=method,
                                           block_quota=quota)
            else:
                ops.transfer_one_layer(side.caches[0][layer], side.caches[1][layer], device_indices,
                                       self._host_rows[0][host_layer].tensor, self._host_rows[1][host_layer].tensor,
                                       host_rows, method=method, block_quota=quota)
            self.last_direct_mode = None
            return
        pairs = side.pairs.get(("load", host_layer))
        if pairs is None:
            pairs = side.pairs[("load", host_layer)] = direct.Pairs(
                [(side.rows[c][host_layer], self._host_rows[c][host_layer]) for c in range(self.num_caches)])
        self._copy_direct(pairs, device_indices, host_indices, host_is_dst=False)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        """Device -> host for every owned layer: ``host[l - start][host_indices[i]] =
        device[l][device_indices[i]]``; one kernel launch or one batched copy."""
        path = self._path(io_backend, "backup")
        self._check_index_pair(host_indices, device_indices)
        side = self._device_side(device_pool)
        if path not in _KERNEL_PATHS:  # layouts that never stage get from unstaged_backup_path what io_path gave
            staging = self._staging(side)
            if staging is not None and staging.backup(host_indices, device_indices):
                self.last_direct_mode = "staged"
                return
            path = route.unstaged_backup_path(io_backend, pool_path=self.transfer_path, copy_bytes=self.copy_bytes,
                                              direct_mode=self.direct_mode)
            if path in _KERNEL_PATHS and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                path = "direct"  # the kernel's layer tables may be built on first use: a host copy, not capturable
        if path in _KERNEL_PATHS:
            from . import ops

            method, quota = _KERNEL_PATHS[path]
            ops.transfer_all_layer(self._host_layer_table(), self.translate_host_indices(host_indices),
                                   side.table(), device_indices, method=method, block_quota=quota)
            self.last_direct_mode = None
            return
        pairs = side.pairs.get(("backup",))
        if pairs is None:
            pairs = side.pairs[("backup",)] = direct.Pairs(
                [(self._host_rows[c][h], side.rows[c][h]) for h in range(self.layer_num)
                 for c in range(self.num_caches)])
        self._copy_direct(pairs, host_indices, device_indices, host_is_dst=True)

    def _staging(self, side: _DeviceSide):
        """The device staging area for backups into a layout whose host pages are contiguous across layers
        (route.pool_stages; staging.py), made on first use; None where it does not apply."""
        if side.staging is None:
            with _STAGING_INIT:  # two backup threads must not both build one, or see it half-built as "none"
                if side.staging is None:
                    side.staging = self._make_staging(side)
        return side.staging or None

    def _make_staging(self, side: _DeviceSide):
        """The staging area of ``side``, or False where none applies (see _staging)."""
        if not self._stages():
            return False
        from . import staging

        start, end = self.owned_layers
        layers = [cache[start:end] for cache in side.caches]
        gather = (staging.kernel_gather(side.table()) if self.transfer_path == "kernel"
                  else staging.torch_gather(layers))
        return staging.PageStaging(self._cache_buffers(), budget_bytes=self.staging_bytes,
                                   device=layers[0][0].device, device_rows=layers[0][0].shape[0], gather=gather,
                                   page_size=self.page_size if self.layout == "page_first_direct" else 1)

    def _group_load(self, side: _DeviceSide, host_indices, device_indices, host_layer: int) -> bool:
        """Whether host layer ``host_layer``'s rows are loaded by a group load (``load_group``): at a group's
        first layer the whole group is loaded now; at its other layers, True when this thread's last group
        load was that group's, into this device pool, with indices of the same values (compared byte for
        byte: a tensor changed in place since is loaded again), and the caller's stream then waits for it.
        Otherwise False: the caller loads the layer alone. Both index tensors must be on the CPU (the copies
        are planned from them on the host)."""
        if host_indices.is_cuda or device_indices.is_cuda:
            return False
        group = self.load_group
        first = host_layer - host_layer % group
        last = getattr(self._group_loaded, "last", None)
        if host_layer != first:
            if last is None or not last.covers(side, first, host_indices, device_indices):
                return False
            if last.done is not None:  # the caller's stream, maybe another one, orders after the group's copies
                torch.cuda.current_stream(last.device).wait_event(last.done)
            return True
        self._group_loaded.last = None
        staging = self._staging(side)
        if staging is None:
            return False
        if side.group_loads is None:
            from .staged_loads import GroupLoads

            start, end = self.owned_layers
            with _STAGING_INIT:
                if side.group_loads is None:
                    side.group_loads = GroupLoads(staging, [cache[start:end] for cache in side.caches])
        if not side.group_loads.load(host_indices, device_indices, first, min(group, self.layer_num - first)):
            return False
        done = None
        if staging.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(staging.device))
        self._group_loaded.last = _GroupLoad(side, first, host_indices, device_indices, done, staging.device)
        return True

    def _host_layer_table(self):
        if self._host_table is None:
            from .ops import LayerTable

            layers = [[rows.tensor for rows in cache] for cache in self._host_rows]
            self._host_table = LayerTable(layers[0] if len(layers) == 1 else tuple(layers), name="host_pool",
                                          written=True)
        return self._host_table

    def _copy_direct(self, pairs: direct.Pairs, indices_dst, indices_src, *, host_is_dst: bool) -> None:
        # The indices were checked once (_check_index_pair); route.copy plans them once per index bytes, so
        # SGLang's per-layer load loop, which passes the same indices for every layer, plans the first layer
        # and rebases that plan for the rest (a changed index is planned again).
        def check(dst, src):  # when a plan is made: host indices past the pool, named as such
            bounds.check_rows("host_indices", dst if host_is_dst else src, self.size, pool="the host pool")

        host_map = self._host_map
        self.last_direct_mode = route.copy(pairs, indices_dst, indices_src, page_size=self.page_size,
                                           dst_map=host_map if host_is_dst else None,
                                           src_map=None if host_is_dst else host_map,
                                           mode=self.direct_mode, check=check)

    # -- allocator (same semantics as upstream HostKVCache; see slot_allocator) --
    def clear(self) -> None:
        self.allocator.clear()

    def available_size(self) -> int:
        return self.allocator.available_size()

    def alloc(self, need_size: int):
        """``need_size`` free token slots (CPU int64, whole pages), or None when
        there are not enough."""
        return self.allocator.alloc(need_size)

    def free(self, indices) -> int:
        """Returns allocated slots to the pool; returns how many. Raises (and
        frees nothing) for a slot that is not currently allocated."""
        return self.allocator.free(indices)

    # -- storage page API (L3 backends read and write whole pages) ----------
    def _page_key(self, index) -> tuple:
        try:
            start = operator.index(index)
        except TypeError:
            raise TypeError(f"index must be an int (a page's first token slot), got {type(index).__name__}") from None
        if start % self.page_size or not 0 <= start < self.size:
            raise ValueError(f"index must be the first token slot of a page (a multiple of {self.page_size} in "
                             f"[0, {self.size})), got {start}")
        key = host_layout.page_index(self.layout, start, self.page_size)
        return key if self.num_caches == 1 else (slice(None), *key)

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        """One page (all layers) in the layout's natural order; flat=True flattens it
        (a copy where the page is not contiguous, as upstream)."""
        page = self.kv_buffer[self._page_key(index)]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index, data_page: torch.Tensor) -> None:
        target = self.kv_buffer[self._page_key(index)]
        if not isinstance(data_page, torch.Tensor):
            raise TypeError(f"data_page must be a torch.Tensor, got {type(data_page).__name__}")
        check_dense("data_page", data_page)
        if data_page.numel() != target.numel():
            raise ValueError(f"data_page has {data_page.numel()} elements; a page of this pool has {target.numel()}")
        if data_page.dtype != self.dtype:
            raise ValueError(f"data_page has dtype {data_page.dtype}; this pool stores {self.dtype}")
        target.copy_(data_page.reshape(target.shape))

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        shape = self.kv_buffer[self._page_key(0)].shape
        return torch.zeros(shape, dtype=self.dtype, device="cpu", pin_memory=self.pin_memory).flatten()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layout={self.layout!r}, size={self.size}, page_size={self.page_size}, "
                f"layers={self.layer_num} of {self.layer_num_device} owning {self.owned_layers}, "
                f"row={self.row_bytes} B, transfer_path={self.transfer_path!r})")


class MLAHostKVPool(HostKVPool):
    """MLA host pool: one ``kv_buffer`` (see the module docstring for its shape)."""

    num_caches = 1

    @classmethod
    def _device_caches(cls, device_pool) -> list[list]:
        kv = getattr(device_pool, "kv_buffer", None)
        if not isinstance(kv, (list, tuple)) or not kv:
            raise TypeError("device_pool must have kv_buffer, a non-empty list of per-layer tensors, for "
                            f"MLAHostKVPool; got {type(device_pool).__name__}")
        return [list(kv)]

    def _cache_buffers(self) -> list[torch.Tensor]:
        return [self.kv_buffer]


class MHAHostKVPool(HostKVPool):
    """MHA host pool: ``kv_buffer`` with K at ``[0]`` and V at ``[1]``."""

    num_caches = 2

    @classmethod
    def _device_caches(cls, device_pool) -> list[list]:
        k, v = getattr(device_pool, "k_buffer", None), getattr(device_pool, "v_buffer", None)
        if not isinstance(k, (list, tuple)) or not isinstance(v, (list, tuple)) or not k:
            raise TypeError("device_pool must have k_buffer and v_buffer, non-empty lists of per-layer tensors, "
                            f"for MHAHostKVPool; got {type(device_pool).__name__}")
        if len(k) != len(v):
            raise ValueError(f"device_pool has {len(k)} K layers but {len(v)} V layers; they must match")
        return [list(k), list(v)]

    def _cache_buffers(self) -> list[torch.Tensor]:
        return [self.kv_buffer[0], self.kv_buffer[1]]

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]


class _GroupLoad:
    """What one group load moved: the group, the device pool, copies of its indices' values, and an event
    after it on the stream it ran on (None on the CPU)."""

    def __init__(self, side, first: int, host_indices, device_indices, done, device):
        self.side, self.first, self.done, self.device = side, first, done, device
        self.host_values = route.host_indices(host_indices).clone()
        self.device_values = route.host_indices(device_indices).clone()

    def covers(self, side, first: int, host_indices, device_indices) -> bool:
        return (side is self.side and first == self.first and host_indices.numel() == self.host_values.numel()
                and device_indices.numel() == self.device_values.numel()
                and route._same_bytes(route.host_indices(host_indices), self.host_values)
                and route._same_bytes(route.host_indices(device_indices), self.device_values))


def _owned_range(device_pool, layer_num: int) -> tuple[int, int]:
    owned = getattr(device_pool, "owned_layers", None)
    if owned is None:
        return 0, layer_num
    try:
        start, end = (operator.index(x) for x in owned)
    except (TypeError, ValueError):
        raise ValueError(f"device_pool.owned_layers must be a (start, end) pair of ints, got {owned!r}") from None
    if not 0 <= start < end <= layer_num:
        raise ValueError(f"device_pool.owned_layers {owned!r} must satisfy 0 <= start < end <= {layer_num} "
                         "(the device pool's layer count)")
    return start, end


def _unregister(runtime, ptr: int) -> None:
    try:
        runtime.host_unregister(ptr)
    except RuntimeError:  # at interpreter exit the context may already be gone
        pass
