"""Argument validation for the transfer ops: cache tensors reduced to what the kernel needs (_Side,
LayerTable), the index contract (its tensor rule lives in bounds.py), block quotas and method names.
Everything here raises before a launch; nothing launches. Raw pointer tables are pointer_tables.py's."""

from __future__ import annotations

import math

import torch

from .. import settings
from .abi import _METHODS, _RESIDENT
from .bounds import check_index_tensor, check_rows  # noqa: F401  (check_index_tensor: its home was here)

# Environment settings, read once: os.environ costs a microsecond per look-up
# on a path that must stay cheap. reload_settings() re-reads them.
_settings: dict = {}



class _Side:
    """One cache argument reduced to what the kernel needs."""

    __slots__ = ("ptr", "row_bytes", "stride", "rows", "device", "dtype")

    def __init__(self, name: str, t, element_dim: int | None, *, written: bool):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if element_dim is not None and (isinstance(element_dim, bool) or not isinstance(element_dim, int)
                                        or element_dim < 1):
            # Checked here, off the plans' path: a bad element_dim never gets a plan.
            raise ValueError(f"element_dim must be a positive int (elements per row), got {element_dim!r}")
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
        if not shape[0] or not expected:
            # An empty tensor has no address (data pointer 0): the launcher refused it as "invalid
            # transfer arguments", which named neither the argument nor the shape.
            raise ValueError(f"{name} must hold at least one slot of at least one element; got shape {tuple(shape)}")
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


def _check_range(name: str, idx: torch.Tensor, rows: int) -> None:
    if rows >= 0:  # -1: a raw pointer table, whose pool size is unknown
        check_rows(name, idx, rows)


def _gpu_indices(indices_dst, indices_src, device: int, dst_rows: int, src_rows: int):
    """Both index tensors on ``device`` with one dtype, after validation (and,
    in strict mode, a range check: on the host for CPU indices, else with a sync)."""
    check_index_tensor("indices_dst", indices_dst, device)
    check_index_tensor("indices_src", indices_src, device)
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
