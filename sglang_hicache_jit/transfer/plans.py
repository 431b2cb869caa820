"""The launch-plan cache: a validated transfer configuration (_Plan) kept per thread under a key of
the caches' identity and geometry, so a repeated call skips validation and the struct build; and the
knobs whose change drops every plan (set_tuning, reload_settings)."""

from __future__ import annotations

import ctypes
import threading
import weakref

import torch

from .. import settings
from .abi import D2H_BLOCK_QUOTA, _CTransfer, _HINT_DST_DEVICE, _NO_ERRORS, _RESIDENT, METHOD_NAMES
from .checks import _gpu_indices, _method_code, _settings
from .cuda import cuda_runtime
from .launcher import _raise_reported, _state

# Bulk-copy tuning passed to the kernel; 0 keeps the kernel's measured default.
# Benchmarks change these through set_tuning(); see docs/kernels.md.
_tuning = {"bulk_warps": 0, "read_align": 0}


def set_tuning(*, bulk_warps: int | None = None, read_align: int | None = None) -> dict:
    """Experimental: override the bulk kernel's warps per CTA (1-8) and read
    alignment (16-256 bytes, a power of two); 0 restores the default.
    Returns the previous settings."""
    previous = dict(_tuning)
    for name, value in (("bulk_warps", bulk_warps), ("read_align", read_align)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int (0 for the default), got {type(value).__name__}")
    if bulk_warps is not None:
        if not 0 <= bulk_warps <= 8:
            raise ValueError(f"bulk_warps must be 0 (default) or 1..8, got {bulk_warps}")
        _tuning["bulk_warps"] = bulk_warps
    if read_align is not None:
        if read_align and (read_align < 16 or read_align > 256 or read_align & (read_align - 1)):
            raise ValueError(f"read_align must be 0 (default) or a power of two in 16..256, got {read_align}")
        _tuning["read_align"] = read_align
    if _tuning != previous:
        _clear_plans()  # plans hold the values they were built with
    return previous


def reload_settings() -> None:
    """Re-reads SGLANG_HICACHE_JIT_STRICT and SGLANG_HICACHE_JIT_METHOD."""
    _settings.update(strict=settings.strict(), method=settings.method())
    _clear_plans()  # plans hold the values they were built with


_INDEX_BYTES = {torch.int32: 4, torch.int64: 8}
_UNIT_STRIDE = (1,)
_CPU = torch.device("cpu")


class _Plan:
    """One validated transfer configuration, ready to launch: the caches'
    addresses and geometry, the options, the device state and a filled
    HicacheTransfer. Running it checks the index tensors (cheaply in the
    common case: 1-D, contiguous, one dtype, both on the transfer's GPU or
    both on the CPU), writes their addresses and count into the struct and
    launches.

    Plans are cached per thread (_plan_cache) under a key that holds, for
    each cache tensor, its data pointer, shape, strides and dtype (everything
    validation reads of it, so set_(), resize_() or as_strided_() on the same
    object lead to another key) and the id of its root: the tensor itself, or
    the tensor it is a view of (pools hand out a fresh view of one buffer per
    call; the root stays the same). ``refs`` holds weak references to the
    roots (or LayerTables), checked on every hit: a plan keeps nothing alive
    and a dead root's reused id never matches. Every address a hit launches
    with is that of a tensor the caller passes, so no freed memory is reached.

    What the key cannot see is host memory unpinned under the same tensor
    (``cudaHostUnregister``, which SGLang's teardown calls on its host pools):
    the kernel would then fault on it, a sticky error that ends the process. So
    every run first asks CUDA whether each host address in ``host_memory``
    (name, address) is still pinned, and raises a ValueError naming the cache
    if not.
    """

    __slots__ = ("refs", "state", "device", "cuda_device", "strict", "resident", "dst_rows", "src_rows", "op_args",
                 "spec", "spec_addr", "method_used", "method_used_addr", "host_memory")

    def __init__(self, device: int, *, dst_bases, src_bases, dst_tables, src_tables, num_layers: int,
                 dst_stride: int, src_stride: int, row_bytes: int, dst_rows: int, src_rows: int, to_device: bool,
                 quota: int, method, host_memory=(), to_host: bool = False, dst_live=(0, 0), src_live=(0, 0)):
        if not _settings:
            reload_settings()
        method_code = _method_code(method, to_device)
        if quota == 0 and to_host and not method_code & _RESIDENT:
            quota = D2H_BLOCK_QUOTA  # the default into host memory (abi.D2H_BLOCK_QUOTA says why)
        # The resident flag picks the submission (_DeviceState._submit_resident); the struct holds the method alone.
        self.resident = bool(method_code & _RESIDENT)
        self.refs = ()
        self.host_memory = tuple(host_memory)
        self.state = state = _state(device)
        self.device, self.cuda_device = device, torch.device("cuda", device)
        self.strict = _settings["strict"]
        self.dst_rows, self.src_rows = dst_rows, src_rows
        num_caches = 2 if (dst_bases[1] or dst_tables[1]) else 1
        # The torch op's integer arguments after the two index tensors (the fallback, _DeviceState.launch_torch_op).
        self.op_args = (src_bases[0], src_bases[1], dst_bases[0], dst_bases[1], src_tables[0], src_tables[1],
                        dst_tables[0], dst_tables[1], num_caches, num_layers, src_stride, dst_stride, row_bytes,
                        src_rows, dst_rows, quota, method_code, _tuning["bulk_warps"], _tuning["read_align"],
                        state.error_flags_ptr)
        self.spec = _CTransfer(src_tables[0], src_tables[1], dst_tables[0], dst_tables[1], src_bases[0],
                               src_bases[1], dst_bases[0], dst_bases[1], num_caches, num_layers, 0, 0, 8, 0,
                               src_stride, dst_stride, row_bytes, src_rows, dst_rows, quota,
                               method_code & ~_RESIDENT, _tuning["bulk_warps"], _tuning["read_align"],
                               state.error_flags_ptr, _HINT_DST_DEVICE if to_device else 0,
                               src_live[0], src_live[1], dst_live[0], dst_live[1])
        self.method_used = ctypes.c_int(0)
        # Passed to the launcher as plain addresses (the plan owns both).
        self.spec_addr, self.method_used_addr = ctypes.addressof(self.spec), ctypes.addressof(self.method_used)

    def run(self, indices_dst, indices_src) -> str:
        state = self.state
        if state.error_bytes.raw != _NO_ERRORS:
            _raise_reported(state)
        for name, address in self.host_memory:
            if not _host_registered(address):
                raise ValueError(
                    f"{name} is host memory (at {address:#x}) that is no longer pinned: it was unregistered "
                    "(cudaHostUnregister, as SGLang's teardown does) or freed. The kernel reads and writes host "
                    "memory directly, so it must stay pinned while transfers use it: pin it again, or stop "
                    "transferring to and from it")
        # The common case, told by a few attribute reads: both 1-D and
        # contiguous (stride (1,)), one index dtype, equal lengths, both on
        # this GPU or both on the CPU. Anything else, and strict mode, takes
        # _gpu_indices, which converts what it can and names what it cannot.
        where = None
        if (not self.strict and isinstance(indices_dst, torch.Tensor) and isinstance(indices_src, torch.Tensor)
                and indices_dst.stride() == _UNIT_STRIDE and indices_src.stride() == _UNIT_STRIDE):
            dtype, where, count = indices_dst.dtype, indices_dst.device, indices_dst.numel()
            index_bytes = _INDEX_BYTES.get(dtype)
            if (index_bytes is None or indices_src.dtype is not dtype or indices_src.device != where
                    or indices_src.numel() != count):
                where = None
        staged = None  # keeps an upload of CPU indices alive until the launch is queued
        if where == self.cuda_device:
            dst_ptr, src_ptr = indices_dst.data_ptr(), indices_src.data_ptr()
        elif where == _CPU:
            if count:
                # One pinned staging copy for both (as _gpu_indices), uploaded as
                # one tensor; the kernel takes addresses, so no views are cut.
                staged = torch.cat((indices_dst, indices_src)).pin_memory().to(self.cuda_device, non_blocking=True)
                dst_ptr = staged.data_ptr()
                src_ptr = dst_ptr + count * index_bytes
            else:  # nothing to upload (see below)
                dst_ptr = src_ptr = 0
        else:
            indices_dst, indices_src = _gpu_indices(indices_dst, indices_src, self.device, self.dst_rows,
                                                    self.src_rows)
            dst_ptr, src_ptr = indices_dst.data_ptr(), indices_src.data_ptr()
            index_bytes, count = indices_dst.element_size(), indices_dst.numel()
        if not count:
            # Nothing to copy, a no-op. An empty index tensor has no address (0), which the launcher
            # refused as "invalid transfer arguments"; given num_items 0 it picks the method and returns
            # before it reads an index, so any non-null address will do.
            if state._launch_c is None:  # the torch op reads the tensors' own addresses: launch nothing
                return METHOD_NAMES.get(self.op_args[16] & ~_RESIDENT) or "plain"
            dst_ptr = src_ptr = self.spec_addr
        if state._launch_c is None:  # no C entry points: the torch op, which takes tensors
            if staged is not None:
                indices_dst, indices_src = staged[:count], staged[count:]
            return METHOD_NAMES[state.launch_torch_op(indices_src, indices_dst, *self.op_args)]
        spec = self.spec
        spec.indices_dst, spec.indices_src, spec.index_bytes, spec.num_items = dst_ptr, src_ptr, index_bytes, count
        if self.resident:
            return METHOD_NAMES[state._submit_resident(spec)]
        state.submit(self.spec_addr, self.method_used_addr)
        return METHOD_NAMES[self.method_used.value]


def _host_registered(address: int) -> bool:
    """Whether host ``address`` is still pinned (a module-level name, so tests without a GPU replace it)."""
    return cuda_runtime().host_registered(address)


# Per-thread plan caches: a plan's struct is written on every call, so two
# threads must not share one. All of them are reachable here so that
# set_tuning() and reload_settings() can drop plans built with old values.
_local = threading.local()
_plan_caches: list = []  # weak references to every thread's cache
_plan_caches_lock = threading.Lock()
_MAX_PLANS = 1024  # a few per layer and direction; about 1 KB each


class _PlanCache(dict):
    __slots__ = ("__weakref__",)  # a thread's cache goes with the thread


def _plan_cache() -> dict:
    try:
        return _local.plans
    except AttributeError:
        plans = _local.plans = _PlanCache()
        with _plan_caches_lock:
            _plan_caches[:] = [ref for ref in _plan_caches if ref() is not None] + [weakref.ref(plans)]
        return plans


def _clear_plans() -> None:
    with _plan_caches_lock:
        caches = [ref() for ref in _plan_caches]
    for plans in caches:
        if plans is not None:
            plans.clear()


def _keep(plans: dict, key, plan: _Plan, objects) -> None:
    """Files ``plan`` under ``key``, for as long as ``objects`` live."""
    plan.refs = tuple(weakref.ref(o) for o in objects)
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[key] = plan
