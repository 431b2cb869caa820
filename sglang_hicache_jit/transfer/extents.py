"""Where the allocation an address lies in begins and ends: the size a raw pointer table does not carry.

SGLang's pools hand the all-layer ops one base address per layer (a uint64 pointer table) and nothing
else, so before any copy the ops (``pointer_tables.py``) ask here which allocation each address lies in,
and bound every index by it. Three sources, asked in this order:

1. **The registry**: buffers registered with ``register`` (a tensor's ``[data_ptr, data_ptr + bytes it
   spans)``, for as long as the tensor lives) or ``register_range``. The SGLang plugin registers the
   per-layer buffers of every pool it wraps (``integrations/sglang/pools.py``), and compat the host
   buffers it builds tables for: these extents are exact, one layer of one pool.
2. **torch's CUDA caching allocator**: the block an address lies in (one tensor's storage, rounded up to
   512 B), from ``torch.cuda.memory_snapshot()``; an address in a block torch has freed has no extent.
3. **The CUDA driver**: ``cuMemGetAddressRange`` (libcuda, through ctypes) for any memory CUDA knows:
   device memory (one cudaMalloc allocation; where memory is mapped with cuMemMap, the mapped range that
   continues from it), pinned host memory (one cudaHostAlloc block) and host memory registered with
   cudaHostRegister (exactly the registered range, which is how SGLang pins its host pools).
   Measured on the H200 (driver 580.159): a 1000-byte pinned tensor gave its 1024-byte block, a
   cudaHostRegister'd MiB that MiB, a cudaMalloc'd 64 MiB those 64 MiB; pageable memory, null and unmapped
   addresses CUDA_ERROR_NOT_FOUND; with no context current in the thread, CUDA_ERROR_INVALID_CONTEXT (so
   the look-up makes the device's context current first); about 3 us a call.

An address none of them knows (pageable memory nobody registered, a made-up number) has no extent, and the
ops refuse its table. Only the registry is exact: an allocation from sources 2 and 3 may hold more than
the pool (a cudaMalloc segment of torch's allocator holds many tensors), so an index past a pool that is
not registered is refused only where it leaves that allocation.

Among registered buffers an address may lie in several (a pool's buffer and its per-layer views). The one
that starts at the address wins, the longest of those (a layer, not a narrower view of its first columns,
which would refuse the layer's last row); else the one that starts nearest below the address.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import torch

_lock = threading.Lock()
_ranges: dict = {}  # token -> Extent
_by_tensor: dict = {}  # (id(owner), first byte, bytes) -> (weakref to the owner, token)
_tokens = iter(range(1, 1 << 62))
# Registrations whose tensor died, dropped under the lock by the next call here: a finalizer may run inside
# any garbage collection, including one under the lock, so it only appends (atomic) and bumps the generation.
_dead: list = []


class Generation:
    """A counter that every change of the registry bumps: pointer_tables.py checks a table again when it moved."""

    value = 0


class Extent:
    """``[start, end)`` of one allocation and where that came from (for messages)."""

    __slots__ = ("start", "end", "source")

    def __init__(self, start: int, end: int, source: str):
        self.start, self.end, self.source = start, end, source

    def __repr__(self) -> str:
        return f"{self.source} [{self.start:#x}, {self.end:#x})"


# Where an address lies in memory torch has freed: no extent, and a reason to say so.
FREED = Extent(0, 0, "a block torch's allocator has freed")


def span(tensor: torch.Tensor) -> tuple[int, int]:
    """(first byte, bytes up to the end of the last element) of a strided tensor."""
    if not tensor.numel():
        return tensor.data_ptr(), 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    if any(stride < 0 for stride in tensor.stride()):
        raise ValueError("a tensor with negative strides cannot be registered")
    return tensor.data_ptr(), (last + 1) * tensor.element_size()


def register_range(start: int, nbytes: int, name: str = "a registered buffer") -> int:
    """Registers ``[start, start + nbytes)`` as one allocation; returns a token for ``unregister``."""
    if isinstance(start, bool) or not isinstance(start, int) or isinstance(nbytes, bool) or \
            not isinstance(nbytes, int) or start < 0 or nbytes < 1 or start + nbytes > 1 << 64:
        raise ValueError(f"register_range needs an address and a positive size in bytes, got {start!r}, {nbytes!r}")
    with _lock:
        _drop_dead()
        token = next(_tokens)
        _ranges[token] = Extent(start, start + nbytes, name)
        Generation.value += 1
    return token


def unregister(token: int) -> None:
    with _lock:
        _drop_dead()
        if _ranges.pop(token, None) is not None:
            Generation.value += 1


def _drop_dead() -> None:
    """Drops the registrations of dead tensors (call with the lock held)."""
    while _dead:
        key, token = _dead.pop()
        _ranges.pop(token, None)
        hit = _by_tensor.get(key)
        if hit is not None and hit[1] == token:
            del _by_tensor[key]


def register(tensor: torch.Tensor, name: str = "a registered buffer", *, owner=None) -> None:
    """Registers the bytes ``tensor`` spans, for as long as ``owner`` lives (by default the tensor itself).
    Once per owner and span: another view of the same bytes under the same owner registers nothing new, so
    a caller that hands out a fresh view of one buffer on every call (SGLang's pools' ``k_buffer``) does
    not change ``Generation`` on every call, which would make every checked pointer table be checked
    again, a device sync for a CUDA table."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"register takes a torch.Tensor, got {type(tensor).__name__}")
    owner = tensor if owner is None else owner
    start, nbytes = span(tensor)
    key = (id(owner), start, nbytes)
    with _lock:
        _drop_dead()
        hit = _by_tensor.get(key)
        if hit is not None and hit[0]() is owner:
            return
    if not nbytes:
        return
    token = register_range(start, nbytes, name)
    with _lock:
        _by_tensor[key] = (weakref.ref(owner), token)
    weakref.finalize(owner, _forget, key, token)


def _forget(key: tuple, token: int) -> None:
    _dead.append((key, token))
    Generation.value += 1


def clear() -> None:
    """Forgets every registration (tests)."""
    with _lock:
        _ranges.clear()
        _by_tensor.clear()
        _dead.clear()
        Generation.value += 1


def _registered(address: int) -> Extent | None:
    with _lock:
        _drop_dead()
        ranges = list(_ranges.values())
    best = None
    for extent in ranges:
        if not extent.start <= address < extent.end:
            continue
        if best is None:
            best = extent
        elif extent.start == address and best.start == address:
            best = extent if extent.end > best.end else best  # the layer, not a narrower view of it
        elif extent.start > best.start or (extent.start == best.start and extent.end < best.end):
            best = extent  # nearest below the address
    return best


def finder(device: int | None):
    """A look-up ``find(address) -> Extent | FREED | None`` for the addresses of one table; it reads
    torch's memory snapshot at most once and makes ``device``'s context current for the driver."""
    snapshot: list = []

    def find(address: int):
        extent = _registered(address)
        if extent is not None:
            return extent
        if not snapshot:
            snapshot.append(_torch_blocks())
        extent = _in_blocks(snapshot[0], address)
        if extent is not None:
            return extent
        return _driver_range(address, device)

    return find


# ---------------------------------------------------------------------------
# torch's caching allocator.

def _torch_blocks() -> list:
    """(start, end, allocated) of every block of torch's CUDA allocator; empty before CUDA is used."""
    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return []
        blocks = []
        for segment in torch.cuda.memory_snapshot():
            address = segment["address"]
            for block in segment.get("blocks", ()):
                start = block.get("address", address)
                blocks.append((start, start + block["size"], block.get("state") == "active_allocated"))
                address = start + block["size"]
        return blocks
    except Exception:  # a snapshot is a help, never a reason to fail: the driver answers next
        return []


def _in_blocks(blocks: list, address: int):
    for start, end, allocated in blocks:
        if start <= address < end:
            return Extent(start, end, "a block of torch's CUDA allocator") if allocated else FREED
    return None


# ---------------------------------------------------------------------------
# The CUDA driver, through ctypes.

_CUDA_ERROR_INVALID_CONTEXT = 201
_RANGE_START_ADDR, _RANGE_SIZE = 11, 12  # CU_POINTER_ATTRIBUTE_RANGE_START_ADDR / RANGE_SIZE
_MAX_MAPPINGS = 1 << 16  # mapped pieces followed from one address (cuMemMap memory), at about 3 us each


class _Driver:
    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self.range = lib.cuMemGetAddressRange_v2
        self.range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        self.attribute = lib.cuPointerGetAttribute
        self.attribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]

    def address_range(self, address: int):
        """(base, size) of the allocation or mapping holding ``address``, or the driver's error code."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        code = self.range(ctypes.byref(base), ctypes.byref(size), address)
        return code if code else (base.value, size.value)

    def reserved(self, address: int):
        """(start, size) of the address range reserved around ``address`` (for cuMemMap memory: the whole
        reservation, larger than any one mapping), or None."""
        start, size = ctypes.c_uint64(), ctypes.c_uint64()
        if self.attribute(ctypes.byref(start), _RANGE_START_ADDR, address) or \
                self.attribute(ctypes.byref(size), _RANGE_SIZE, address):
            return None
        return start.value, size.value


_driver_state: list = []  # [_Driver or None], once per process


def _driver():
    if not _driver_state:
        try:
            _driver_state.append(_Driver() if torch.version.cuda else None)
        except (OSError, AttributeError):  # no libcuda (no GPU driver here), or one too old
            _driver_state.append(None)
    return _driver_state[0]


def _driver_range(address: int, device: int | None):
    driver = _driver()
    if driver is None or not address:
        return None
    found = driver.address_range(address)
    if found == _CUDA_ERROR_INVALID_CONTEXT:
        # No context current in this thread (a thread that has not used CUDA yet): the device's primary one.
        try:
            with torch.cuda.device(torch.cuda.current_device() if device is None else device):
                found = driver.address_range(address)
        except Exception:  # no device to make current: the address has no extent CUDA knows
            return None
    if isinstance(found, int):
        return None
    base, size = found
    end = base + size
    reserved = driver.reserved(address)
    if reserved is not None and reserved[1] > size:
        # cuMemMap memory (torch's expandable segments): a buffer spans several mappings, one after the
        # other inside one reservation; follow them while they are there.
        limit = reserved[0] + reserved[1]
        for _ in range(_MAX_MAPPINGS):
            if end >= limit:
                break
            following = driver.address_range(end)
            if isinstance(following, int) or following[0] != end:
                break
            end += following[1]
    return Extent(base, end, "a CUDA allocation")
