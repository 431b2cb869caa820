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
"""

from __future__ import annotations

import atexit
import ctypes
import math
import threading
import weakref

import torch

from .. import settings
from ..errors import ArchUnsupportedError, TransferIndexError

# block_quota=None lets the kernel pick its measured default: 4 CTAs for the
# bulk engine (host -> GPU), 8 for plain loads and stores (GPU -> host). For
# reference only: the kernel's kDefaultBulkBlocks / kDefaultPlainBlocks decide.
DEFAULT_BLOCK_QUOTA = {"bulk": 4, "plain": 8}
_METHODS = {"auto": 0, "plain": 1, "bulk": 2}
METHOD_NAMES = {1: "plain", 2: "bulk", 17: "resident-plain", 18: "resident-bulk"}
# Or'ed into a method code: submit through the resident kernel's queue
# (HICACHE_RESIDENT_QUEUED in kernels/hicache_transfer.h).
_RESIDENT = 16
# HICACHE_HINT_DST_DEVICE: the destination is GPU memory (tunes the bulk pipeline's refills).
_HINT_DST_DEVICE = 1
RESIDENT_QUEUE_SLOTS = 64

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


_ERROR_WORDS = 4
_ERROR_MESSAGES = (
    "an index in indices_src was past the end of the source pool",
    "an index in indices_dst was past the end of the destination pool",
    "a row address was not 4-byte aligned",
)

# Environment settings, read once: os.environ costs a microsecond per look-up
# on a path that must stay cheap. reload_settings() re-reads them.
_settings: dict = {}


def reload_settings() -> None:
    """Re-reads SGLANG_HICACHE_JIT_STRICT and SGLANG_HICACHE_JIT_METHOD."""
    _settings.update(strict=settings.strict(), method=settings.method())
    _clear_plans()  # plans hold the values they were built with


class _DeviceState:
    """Per-device library handle and the pinned words the kernel reports errors in."""

    def __init__(self, device: int):
        from ..buildcache.arch import current_gpu_capability
        from ..buildcache.loader import load_kernels

        self.device = device
        self.capability = current_gpu_capability(device)
        self.library = load_kernels(device=device)
        if not self.library.supports(self.capability):
            major, minor = self.capability
            raise ArchUnsupportedError(
                f"The kernel library was built for {', '.join(map(str, self.library.archs))}, "
                f"which cannot run on cuda:{device} (compute capability {major}.{minor}).",
                f"include {major}.{minor} in {settings.ARCH} (or TORCH_CUDA_ARCH_LIST), or unset it.",
            )
        self.error_flags = torch.zeros(_ERROR_WORDS, dtype=torch.int32, pin_memory=True)
        self.error_flags_ptr = self.error_flags.data_ptr()
        self.error_view = (ctypes.c_uint32 * _ERROR_WORDS).from_address(self.error_flags_ptr)
        # The words the kernel sets, read as one bytes object: the cheapest
        # "no error pending" test for the per-call path (_Plan.run).
        self.error_bytes = (ctypes.c_char * (4 * len(_ERROR_MESSAGES))).from_address(self.error_flags_ptr)
        self.transfer = self.library.ops.transfer
        self._launch_c = _c_launcher(self.library.handle)
        self._method_used = ctypes.c_int(0)
        self._method_used_ref = ctypes.byref(self._method_used)
        self.resident = None  # the resident kernel's queue (a C pointer), created by the first resident transfer
        self._resident_lock = threading.Lock()

    def launch_torch_op(self, idx_src: torch.Tensor, idx_dst: torch.Tensor, *args) -> int:
        """One copy through the binding's torch op, for a library without the C
        entry points (plans call the C launcher through ctypes otherwise: a torch
        op call with 22 arguments costs ~10 us of host time in the dispatcher,
        ctypes ~2 us). ``args`` are the op's integer arguments after the two
        index tensors. There is no resident queue on this path. Returns the
        method that ran."""
        args = list(args)
        args[16] &= ~_RESIDENT
        return self.transfer(idx_src, idx_dst, *args)

    def submit(self, spec, method_used) -> None:
        """Calls the C launcher on the current stream of this device with a
        filled HicacheTransfer; it stores the method that ran in a c_int.
        Both are passed by address (an int) or as ``ctypes.byref``."""
        launch, device = self._launch_c, self.device
        if _current_device() == device:
            err = launch(spec, _raw_stream(device), method_used)
        else:
            with torch.cuda.device(device):
                err = launch(spec, _raw_stream(device), method_used)
        if err:
            raise RuntimeError(f"hicache transfer: {self._error_string(err)}")

    def _error_string(self, err: int) -> str:
        message = self.library.handle.hicache_error_string(err)
        return message.decode() if message else str(err)

    def _submit_resident(self, spec) -> int:
        if _current_device() != self.device:
            with torch.cuda.device(self.device):
                return self._submit_resident(spec)
        # One lock for submit, create and stop: a stop frees the queue, which a concurrent submit must not
        # be using; the method-used word is shared too.
        with self._resident_lock:
            queue = self.resident or self._create_resident_queue()
            err = self.library.handle.hicache_resident_submit(queue, ctypes.byref(spec), _raw_stream(self.device),
                                                              self._method_used_ref)
            if err:
                raise RuntimeError(f"hicache transfer (resident): {self._error_string(err)}")
            return self._method_used.value

    def _create_resident_queue(self) -> int:
        """The resident kernel's queue on this device (called with _resident_lock held)."""
        handle = self.library.handle
        _resident_signatures(handle)
        blocks = settings.resident_blocks()
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        if blocks > sms:  # every resident CTA must fit at once, or a transfer would wait forever
            raise settings.bad(settings.RESIDENT_BLOCKS, str(blocks),
                               f"cuda:{self.device} has {sms} SMs and each resident CTA needs one")
        out = ctypes.c_void_p()
        err = handle.hicache_resident_create(blocks, RESIDENT_QUEUE_SLOTS, settings.resident_idle_us(),
                                             ctypes.byref(out))
        if err:
            raise RuntimeError(f"the resident method is unavailable on cuda:{self.device}: "
                               f"{self._error_string(err)}. Use method 'auto' instead.")
        self.resident = out.value
        return self.resident

    def stop_resident(self, timeout_ms: int = 2000) -> None:
        with self._resident_lock:
            queue, self.resident = self.resident, None
            if queue is None:
                return
            with torch.cuda.device(self.device):
                err = self.library.handle.hicache_resident_destroy(queue, timeout_ms)
        if err:
            raise RuntimeError(f"stopping the resident copy kernel on cuda:{self.device}: {self._error_string(err)}")

    def resident_stats(self) -> dict | None:
        with self._resident_lock:
            if self.resident is None:
                return None
            out = (ctypes.c_uint64 * 4)()
            self.library.handle.hicache_resident_stats(self.resident, out)
        return dict(launches=out[0], queued=out[1], fallbacks=out[2], finished=out[3])


def _resident_signatures(handle) -> None:
    handle.hicache_resident_create.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                               ctypes.POINTER(ctypes.c_void_p)]
    handle.hicache_resident_create.restype = ctypes.c_int
    handle.hicache_resident_submit.argtypes = [ctypes.c_void_p, ctypes.POINTER(_CTransfer), ctypes.c_void_p,
                                               ctypes.POINTER(ctypes.c_int)]
    handle.hicache_resident_submit.restype = ctypes.c_int
    handle.hicache_resident_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)]
    handle.hicache_resident_stats.restype = None
    handle.hicache_resident_destroy.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    handle.hicache_resident_destroy.restype = ctypes.c_int


class _CTransfer(ctypes.Structure):
    """HicacheTransfer of kernels/hicache_transfer.h, field for field (the
    two-element arrays spelled as two fields: same layout)."""

    _fields_ = [
        ("src_table0", ctypes.c_void_p), ("src_table1", ctypes.c_void_p),
        ("dst_table0", ctypes.c_void_p), ("dst_table1", ctypes.c_void_p),
        ("src_base0", ctypes.c_uint64), ("src_base1", ctypes.c_uint64),
        ("dst_base0", ctypes.c_uint64), ("dst_base1", ctypes.c_uint64),
        ("num_caches", ctypes.c_int32), ("num_layers", ctypes.c_int32),
        ("indices_src", ctypes.c_void_p), ("indices_dst", ctypes.c_void_p),
        ("index_bytes", ctypes.c_int32), ("num_items", ctypes.c_int64),
        ("src_stride", ctypes.c_int64), ("dst_stride", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
        ("src_rows", ctypes.c_int64), ("dst_rows", ctypes.c_int64),
        ("num_blocks", ctypes.c_int32), ("method", ctypes.c_int32),
        ("bulk_warps", ctypes.c_int32), ("read_align", ctypes.c_int32),
        ("error_flags", ctypes.c_void_p), ("hints", ctypes.c_int32),
    ]


def _c_launcher(handle):
    """The library's hicache_transfer_launch as a ctypes function, or None."""
    fn = getattr(handle, "hicache_transfer_launch", None) if handle is not None else None
    if fn is None:
        return None
    # Untyped pointers: c_void_p takes a byref() and a plain address alike,
    # and converting an int costs less per call than checking a pointer type.
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    handle.hicache_error_string.argtypes = [ctypes.c_int]
    handle.hicache_error_string.restype = ctypes.c_char_p
    return fn


# torch's own raw-stream accessor (Triton launches through it): ~0.3 us,
# where torch.cuda.current_stream(device).cuda_stream builds a Stream object.
# And the current device without torch.cuda.current_device()'s lazy-init
# checks, run in Python on every call (CUDA is initialized once a
# _DeviceState exists). A CPU-only build of torch has neither.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


_states: dict[int, _DeviceState] = {}
_states_lock = threading.Lock()


def _state(device: int) -> _DeviceState:
    state = _states.get(device)
    if state is None:
        with _states_lock:
            state = _states.get(device)
            if state is None:
                state = _states[device] = _DeviceState(device)
    return state


def _raise_reported(state: _DeviceState) -> None:
    words = state.error_view
    if words[0] | words[1] | words[2]:
        problems = [msg for i, msg in enumerate(_ERROR_MESSAGES) if words[i]]
        for i in range(_ERROR_WORDS):
            words[i] = 0
        raise TransferIndexError(
            f"a transfer on cuda:{state.device} skipped rows: {'; '.join(problems)}. Those rows were "
            "neither read nor written. (Reported by the first op on this device after the faulty one; "
            f"set {settings.STRICT}=1 to check indices before each launch.)"
        )


def _device_index(device: int | torch.device | None) -> int:
    """A device argument as an index: None (or 'cuda' without an index) is the current device."""
    index = device.index if isinstance(device, torch.device) else (None if device is None else
                                                                    torch.device("cuda", device).index)
    return torch.cuda.current_device() if index is None else index


def check_errors(device: int | torch.device | None = None, *, synchronize: bool = True) -> None:
    """Raises TransferIndexError if a finished transfer on ``device`` skipped an
    out-of-range index. With synchronize=True it waits for the device first."""
    index = _device_index(device)
    state = _states.get(index)
    if state is None:
        return
    if synchronize:
        torch.cuda.synchronize(index)
    _raise_reported(state)


def stop_resident(device: int | torch.device | None = None) -> None:
    """Stops the resident copy kernel (method 'resident') and gives its SMs back.

    Queued transfers finish first: it waits up to 2 s for streams that have
    not reached theirs yet. A stream that reaches a queued transfer only after
    that would wait for it forever, so stop when no stream still has resident
    transfers ahead of it (e.g. after synchronizing them). ``device=None``
    stops it on every device. The next resident transfer starts it again.
    Called at interpreter exit.
    """
    states = list(_states.values()) if device is None else [_states.get(_device_index(device))]
    for state in states:
        if state is not None:
            state.stop_resident()


def resident_stats(device: int | torch.device | None = None) -> dict | None:
    """The resident queue's counters on ``device`` (launches of the resident
    kernel, transfers queued, fallbacks to an ordinary launch, transfers
    finished), or None when it is not running there."""
    state = _states.get(_device_index(device))
    return state.resident_stats() if state is not None else None


def _stop_all_resident() -> None:
    try:
        stop_resident()
    except Exception:  # at exit the CUDA context may already be gone; nothing is left to protect
        pass


atexit.register(_stop_all_resident)


class _Side:
    """One cache argument reduced to what the kernel needs."""

    __slots__ = ("ptr", "row_bytes", "stride", "rows", "device", "dtype")

    def __init__(self, name: str, t, element_dim: int | None, *, written: bool):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if element_dim is not None and (t.dim() < 2 or math.prod(t.shape[1:]) != element_dim):
            try:
                t = t.view(-1, element_dim)
            except RuntimeError as exc:
                raise ValueError(
                    f"{name} (shape {tuple(t.shape)}) cannot be viewed as rows of element_dim={element_dim} "
                    f"elements: {exc}"
                ) from None
        if t.dim() < 2:
            raise ValueError(
                f"{name} must have a slot dimension and a row (at least 2-D, e.g. [slots, dim]); "
                f"got shape {tuple(t.shape)} (pass element_dim to view a flat buffer as rows)"
            )
        shape, strides = t.shape, t.stride()
        expected = 1
        for size, stride in zip(reversed(shape[1:]), reversed(strides[1:])):
            if size != 1 and stride != expected:
                raise ValueError(
                    f"{name} must have contiguous rows (all dimensions after the first dense, last "
                    f"stride 1); got shape {tuple(shape)} with strides {strides}"
                )
            expected *= size
        itemsize = t.element_size()
        self.row_bytes = expected * itemsize
        self.stride = strides[0] * itemsize
        self.rows = shape[0]
        self.dtype = t.dtype
        self.ptr = t.data_ptr()
        if t.is_cuda:
            self.device = t.device.index
        elif t.device.type == "cpu":
            if not t.is_pinned():
                raise ValueError(
                    f"{name} is in pageable CPU memory; the kernel accesses host memory directly and "
                    "needs it pinned (allocate it with pin_memory=True or call .pin_memory())"
                )
            self.device = None
        else:
            raise ValueError(f"{name} must be a CUDA tensor or pinned CPU memory, got device {t.device}")
        if self.ptr % 4 or self.stride % 4:
            raise ValueError(
                f"{name} must be 4-byte aligned (data pointer and slot stride); got pointer "
                f"{self.ptr:#x} and stride {self.stride} bytes"
            )
        if self.stride < 0:
            raise ValueError(f"{name} must have a non-negative slot stride, got {self.stride} bytes")
        if written and self.rows > 1 and self.stride < self.row_bytes:
            raise ValueError(f"{name} has overlapping rows (slot stride {self.stride} bytes < row {self.row_bytes} bytes)")


def _check_pair(dst: _Side, src: _Side, dst_name: str, src_name: str) -> None:
    if dst.dtype != src.dtype:
        raise ValueError(f"{dst_name} has dtype {dst.dtype} but {src_name} has {src.dtype}; they must match")
    if dst.row_bytes != src.row_bytes:
        raise ValueError(
            f"{dst_name} rows are {dst.row_bytes} bytes but {src_name} rows are {src.row_bytes}; they must match"
        )
    if dst.row_bytes % 4:
        raise ValueError(f"rows of {dst_name} are {dst.row_bytes} bytes; the row size must be a multiple of 4 bytes")


def _device_of(*sides) -> int:
    devices = {s.device for s in sides if s.device is not None}
    if not devices:
        raise ValueError("both caches are in host memory; one side of a transfer must be on the GPU")
    if len(devices) > 1:
        raise ValueError(f"the GPU sides are on different devices ({sorted(devices)}); use one device")
    return devices.pop()


def _check_strided(name: str, t: torch.Tensor) -> None:
    # Sparse and nested tensors otherwise fail deep inside torch without naming the argument.
    if t.layout != torch.strided or getattr(t, "is_nested", False):
        kind = "nested" if getattr(t, "is_nested", False) else str(t.layout).split(".")[-1]
        raise TypeError(f"{name} must be a dense (strided) tensor, got a {kind} tensor")


def check_dense(name: str, t: torch.Tensor) -> None:
    """``t`` holds its elements in memory: a dense (strided) tensor, not a meta tensor. For the
    pools and their allocator, whose CPU-side work (``.to('cpu')``, copies) raised
    NotImplementedError or RuntimeError from inside torch for those; the ops refuse a meta
    tensor by its device."""
    _check_strided(name, t)
    if t.is_meta:
        raise ValueError(f"{name} must be on the CPU or a GPU, got a meta tensor (it holds no data)")


def check_index_tensor(name: str, idx) -> None:
    """The index contract shared by every path: a dense 1-D int32 or int64 tensor."""
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 or int64, got {type(idx).__name__}")
    _check_strided(name, idx)
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {idx.dtype}")
    if idx.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(idx.shape)}")


def _check_indices(name: str, idx, device: int) -> None:
    check_index_tensor(name, idx)
    if idx.is_cuda:
        if idx.device.index != device:
            raise ValueError(f"{name} is on {idx.device} but the transfer runs on cuda:{device}")
    elif idx.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU or on cuda:{device}, got {idx.device}")


def _check_range(name: str, idx: torch.Tensor, rows: int) -> None:
    if rows >= 0 and idx.numel() and int(idx.max()) >= rows:
        raise TransferIndexError(f"{name} holds index {int(idx.max())}, but its pool has only {rows} slots")


def _gpu_indices(indices_dst, indices_src, device: int, dst_rows: int, src_rows: int):
    """Both index tensors on ``device`` with one dtype, after validation (and,
    in strict mode, a range check: on the host for CPU indices, else with a sync)."""
    _check_indices("indices_dst", indices_dst, device)
    _check_indices("indices_src", indices_src, device)
    if indices_dst.shape[0] != indices_src.shape[0]:
        raise ValueError(f"indices_dst has {indices_dst.shape[0]} entries but indices_src has "
                         f"{indices_src.shape[0]}; they must have the same length")
    if indices_dst.dtype != indices_src.dtype:  # the kernel reads both with one index type
        indices_dst, indices_src = indices_dst.long(), indices_src.long()
    strict = _settings["strict"]
    if not indices_dst.is_cuda and not indices_src.is_cuda:
        if strict:
            _check_range("indices_dst", indices_dst, dst_rows)
            _check_range("indices_src", indices_src, src_rows)
        # One pinned staging copy for both: pinned memory makes the upload
        # asynchronous (a pageable source would make cudaMemcpyAsync wait).
        pair = torch.stack((indices_dst, indices_src)).pin_memory()
        pair = pair.to(torch.device("cuda", device), non_blocking=True)
        return pair[0], pair[1]
    dst, src = (_upload(i, device) for i in (indices_dst, indices_src))
    if strict:
        _check_range("indices_dst", dst, dst_rows)
        _check_range("indices_src", src, src_rows)
    return dst, src


def _upload(idx: torch.Tensor, device: int) -> torch.Tensor:
    if idx.is_cuda:
        return idx if idx.is_contiguous() else idx.contiguous()
    return idx.pin_memory().to(torch.device("cuda", device), non_blocking=True)


# More CTAs than any GPU has SMs many times over; the kernel never launches more than it has rows for.
MAX_BLOCK_QUOTA = 1 << 16


def _quota(block_quota) -> int:
    if block_quota is None:
        return 0  # the kernel's default for the method it picks
    if isinstance(block_quota, bool) or not isinstance(block_quota, int) or not 1 <= block_quota <= MAX_BLOCK_QUOTA:
        raise ValueError(f"block_quota must be an int from 1 to {MAX_BLOCK_QUOTA} (CTAs to launch), "
                         f"got {block_quota!r}")
    return block_quota


def _method_code(method, to_device: bool) -> int:
    """Measured policy for 'auto': the bulk engine for host -> GPU (plain loads
    from host memory stall a few SMs), plain loads/stores otherwise (they
    keep scattered host writes fast where bulk stores do not). 'resident'
    runs the bulk engine both ways inside the resident kernel (see below)."""
    name = _settings["method"] if method is None else method
    if name == "auto":
        return _METHODS["auto"] if to_device else _METHODS["plain"]
    if name == "resident":
        # The bulk engine both ways: beside a saturating matmul, resident bulk stores to the host kept
        # 0.91 of the link where plain stores kept 0.62 (4 CTAs, docs/BENCHMARKS.md). Scattered
        # page-1 backups favour plain stores on an idle GPU: 'resident-plain' asks for them.
        return _RESIDENT | _METHODS["auto"]
    if name in ("resident-plain", "resident-bulk"):
        return _RESIDENT | _METHODS[name[9:]]
    try:
        return _METHODS[name]
    except (KeyError, TypeError):
        raise ValueError(f"method must be one of {', '.join(settings.METHODS)}, got {method!r}") from None


_INDEX_BYTES = {torch.int32: 4, torch.int64: 8}
_UNIT_STRIDE = (1,)
_CPU = torch.device("cpu")
_NO_ERRORS = bytes(4 * len(_ERROR_MESSAGES))


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
    """

    __slots__ = ("refs", "state", "device", "cuda_device", "strict", "resident", "dst_rows", "src_rows", "op_args",
                 "spec", "spec_addr", "method_used", "method_used_addr")

    def __init__(self, device: int, *, dst_bases, src_bases, dst_tables, src_tables, num_layers: int,
                 dst_stride: int, src_stride: int, row_bytes: int, dst_rows: int, src_rows: int, to_device: bool,
                 quota: int, method):
        if not _settings:
            reload_settings()
        method_code = _method_code(method, to_device)
        # The resident flag picks the submission (_DeviceState._submit_resident); the struct holds the method alone.
        self.resident = bool(method_code & _RESIDENT)
        self.refs = ()
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
                               state.error_flags_ptr, _HINT_DST_DEVICE if to_device else 0)
        self.method_used = ctypes.c_int(0)
        # Passed to the launcher as plain addresses (the plan owns both).
        self.spec_addr, self.method_used_addr = ctypes.addressof(self.spec), ctypes.addressof(self.method_used)

    def run(self, indices_dst, indices_src) -> str:
        state = self.state
        if state.error_bytes.raw != _NO_ERRORS:
            _raise_reported(state)
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
            # One pinned staging copy for both (as _gpu_indices), uploaded as
            # one tensor; the kernel takes addresses, so no views are cut.
            staged = torch.cat((indices_dst, indices_src)).pin_memory().to(self.cuda_device, non_blocking=True)
            dst_ptr = staged.data_ptr()
            src_ptr = dst_ptr + count * index_bytes
        else:
            indices_dst, indices_src = _gpu_indices(indices_dst, indices_src, self.device, self.dst_rows,
                                                    self.src_rows)
            dst_ptr, src_ptr = indices_dst.data_ptr(), indices_src.data_ptr()
            index_bytes, count = indices_dst.element_size(), indices_dst.numel()
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
                 dst_rows=dst.rows, src_rows=src.rows, to_device=src.device is None, quota=quota, method=method)
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
                 dst_rows=kd.rows, src_rows=ks.rows, to_device=ks.device is None, quota=quota, method=method)
    if key is not None:
        _keep(plans, key, plan, roots)
    return plan.run(indices_dst, indices_src)


class LayerTable:
    """The per-layer caches of one side of an all-layer transfer, validated once.

    Pools build one per side and reuse it: validating dozens of layers costs
    more than launching the copy. ``caches`` holds one tensor per layer (all
    with the same row size, slot count and stride), or a ``(k_caches,
    v_caches)`` pair of such lists for MHA.
    """

    def __init__(self, caches, *, name: str = "caches", written: bool = False, element_dim: int | None = None):
        groups = caches if _is_kv_pair(caches) else (caches,)
        self.name = name
        self.sides = []
        for g, group in enumerate(groups):
            group = list(group)
            if not group:
                raise ValueError(f"{name} must hold at least one layer")
            label = name if len(groups) == 1 else f"{name}[{'kv'[g]}]"
            self.sides.append([_Side(f"{label}[{i}]", t, element_dim, written=written) for i, t in enumerate(group)])
        first = self.sides[0][0]
        for sides in self.sides:
            if len(sides) != len(self.sides[0]):
                raise ValueError(f"{name}: K and V must have the same number of layers")
            for s in sides:
                if (s.row_bytes, s.stride, s.rows, s.dtype, s.device is None) != (
                        first.row_bytes, first.stride, first.rows, first.dtype, first.device is None):
                    raise ValueError(f"{name}: every layer must have the same dtype, row size, slot count, slot "
                                     "stride and memory kind (GPU or pinned host)")
        self.num_caches = len(self.sides)
        self.num_layers = len(self.sides[0])
        self.row_bytes, self.stride, self.rows, self.dtype = first.row_bytes, first.stride, first.rows, first.dtype
        devices = {s.device for sides in self.sides for s in sides if s.device is not None}
        if len(devices) > 1:
            raise ValueError(f"{name}: layers are on several devices {sorted(devices)}")
        self.device = devices.pop() if devices else None
        self._tables: dict[int, list[torch.Tensor]] = {}

    def tables(self, device: int) -> tuple[int, int]:
        """Addresses of the per-cache uint64 pointer tables on ``device``."""
        tables = self._tables.get(device)
        if tables is None:
            tables = [torch.tensor([s.ptr for s in sides], dtype=torch.uint64, device=torch.device("cuda", device))
                      for sides in self.sides]
            self._tables[device] = tables
        return tables[0].data_ptr(), tables[1].data_ptr() if len(tables) > 1 else 0


def _is_kv_pair(caches) -> bool:
    return (isinstance(caches, tuple) and len(caches) == 2
            and all(isinstance(g, (list, tuple)) for g in caches))


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
                 to_device=src.device is None, quota=quota, method=method)
    # The plan holds the addresses of the LayerTables' device pointer tables,
    # which live as long as the LayerTables, which the refs check.
    if key is not None:
        _keep(plans, key, plan, (dst, src))
    return plan.run(indices_dst, indices_src)


def _pointer_table(name: str, table, device: int | None) -> torch.Tensor:
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of uint64 addresses, got {type(table).__name__}")
    if table.dtype not in (torch.uint64, torch.int64) or table.dim() != 1:
        raise ValueError(f"{name} must be a 1-D uint64 tensor (one address per layer), got {table.dtype} "
                         f"with shape {tuple(table.shape)}")
    if not table.is_cuda:
        raise ValueError(f"{name} must be on the GPU (the kernel reads it), got {table.device}")
    if device is not None and table.device.index != device:
        raise ValueError(f"{name} is on {table.device} but the other tables are on cuda:{device}")
    return table if table.is_contiguous() else table.contiguous()


def transfer_pointer_tables(tables_dst, indices_dst, tables_src, indices_src, *, dst_stride_bytes: int,
                            src_stride_bytes: int, element_size: int, block_quota=None, method=None) -> str:
    """All-layer copy from raw per-layer address tables (what SGLang's pools keep).

    ``tables_dst`` / ``tables_src`` are ``(k_table, v_table)`` pairs or a
    single table for MLA: 1-D uint64 CUDA tensors with one row-0 address per
    layer. The kernel cannot know the pools' sizes here, so index ranges are
    not checked: pass valid indices (or use LayerTable, which checks). Nor
    does it know which side is host memory, so 'auto' means plain loads and
    stores, which are fast in both directions (the bulk engine wins only for
    host -> GPU; ask for method='bulk' there).
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
    quota = 0 if block_quota is None else _quota(block_quota)
    # Pools back up every layer through the same pointer tables on every
    # call: a plan for them skips the table checks and the struct build. The
    # key holds, per table, what those checks read (object, address, dtype,
    # shape, strides, device), so set_() or resize_() on a table leads to
    # another key, and refs (checked on a hit) make a dead table's reused id
    # miss. The plan launches with the addresses of the tables passed now.
    try:
        plans = _local.plans
    except AttributeError:  # this thread's first transfer
        plans = _plan_cache()
    tables = dst + src
    key = [len(dst), dst_stride_bytes, src_stride_bytes, element_size, quota, method]
    try:
        for t in tables:
            if not isinstance(t, torch.Tensor):
                raise TypeError  # the full path names it
            key += (id(t), t.data_ptr(), t.dtype, t.shape, t.stride(), t.device)
        key = tuple(key)
        plan = plans.get(key)
    except (TypeError, RuntimeError):  # not a tensor, no data pointer, or an unhashable method
        plan = key = None
    if plan is not None:
        refs = plan.refs
        if refs[0]() is tables[0] and refs[1]() is tables[1] and (len(refs) == 2 or (
                refs[2]() is tables[2] and refs[3]() is tables[3])):
            return plan.run(indices_dst, indices_src)
    first = _pointer_table("tables_dst", dst[0], None)
    device = first.device.index
    dst = [first] + [_pointer_table("tables_dst", t, device) for t in dst[1:]]
    src = [_pointer_table("tables_src", t, device) for t in src]
    layers = {t.numel() for t in dst + src}
    if len(layers) != 1:
        raise ValueError(f"every pointer table must have the same number of layers, got {sorted(layers)}")
    pad = [0, 0]
    dst_ptrs = [t.data_ptr() for t in dst] + pad[len(dst):]
    src_ptrs = [t.data_ptr() for t in src] + pad[len(src):]
    plan = _Plan(device, dst_bases=(0, 0), src_bases=(0, 0), dst_tables=tuple(dst_ptrs[:2]),
                 src_tables=tuple(src_ptrs[:2]), num_layers=layers.pop(), dst_stride=dst_stride_bytes,
                 src_stride=src_stride_bytes, row_bytes=element_size, dst_rows=-1, src_rows=-1, to_device=False,
                 quota=quota, method=method)
    # Kept only when the plan holds the caller's own tables: a non-contiguous
    # table was copied above, and that copy dies with this call.
    if key is not None and all(a is b for a, b in zip(dst + src, tables)):
        _keep(plans, key, plan, tables)
    return plan.run(indices_dst, indices_src)
