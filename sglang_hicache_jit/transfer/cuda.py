"""The CUDA runtime through ctypes: the few calls the copy engines and host pinning need.

``CudaRuntime`` wraps torch's own ``libcudart`` (``cuda_runtime()``, one per process): 2-D copies, batched
3-D copies (``cudaMemcpy3DBatchAsync``, CUDA 12.8+), host registration and the pinned-memory question. The
``cudaMemcpy3DBatchOp`` struct is mirrored here as ctypes structures, and ``DESCRIPTOR_OFFSETS`` says
where each field sits, so that direct.py can build descriptor rows as one int64 tensor. Used by direct.py
(copies), host_pool.py (pinning), plans.py (is host memory still pinned) and, through direct, staging.py.

No copy goes through the CUDA driver (``libcuda``): its ``cuMemcpyBatchAsync`` returned wrong rows without an
error on driver 580.159.04 (docs/troubleshooting.md). The one driver call the package makes is
``cuMemGetAddressRange``, in extents.py, to bound raw pointer tables by their allocations.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading

import torch

# Copies per cudaMemcpy3DBatchAsync call. The API documents no limit; chunking
# bounds the descriptor array (112 B per copy) and keeps one call's CPU time short.
MAX_BATCH_OPS = 8192
CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from the pointers (UVA)
SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: read the source in stream order
OPERAND_TYPE_POINTER = 1  # cudaMemcpyOperandTypePointer


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _PointerOperand(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("rowLength", ctypes.c_size_t), ("layerHeight", ctypes.c_size_t),
                ("locHint", _MemLocation)]


class _Offset3D(ctypes.Structure):
    _fields_ = [("x", ctypes.c_size_t), ("y", ctypes.c_size_t), ("z", ctypes.c_size_t)]


class _ArrayOperand(ctypes.Structure):
    _fields_ = [("array", ctypes.c_void_p), ("offset", _Offset3D)]


class _OperandUnion(ctypes.Union):
    _fields_ = [("ptr", _PointerOperand), ("array", _ArrayOperand)]


class Memcpy3DOperand(ctypes.Structure):
    """``struct cudaMemcpy3DOperand`` (driver_types.h, CUDA 12.8+)."""

    _fields_ = [("type", ctypes.c_int), ("op", _OperandUnion)]


class Extent(ctypes.Structure):
    """``struct cudaExtent``; width in bytes for linear memory."""

    _fields_ = [("width", ctypes.c_size_t), ("height", ctypes.c_size_t), ("depth", ctypes.c_size_t)]


class Memcpy3DBatchOp(ctypes.Structure):
    """``struct cudaMemcpy3DBatchOp`` (driver_types.h, CUDA 12.8+)."""

    _fields_ = [("src", Memcpy3DOperand), ("dst", Memcpy3DOperand), ("extent", Extent),
                ("srcAccessOrder", ctypes.c_int), ("flags", ctypes.c_uint)]


def _descriptor_layout() -> dict:
    """Byte offsets of the fields describe_copies fills, from the ctypes structs above."""
    ptr = Memcpy3DOperand.op.offset + _OperandUnion.ptr.offset
    layout = {}
    for side in ("src", "dst"):
        base = getattr(Memcpy3DBatchOp, side).offset
        layout[f"{side}.type"] = base + Memcpy3DOperand.type.offset
        layout[f"{side}.ptr"] = base + ptr + _PointerOperand.ptr.offset
        layout[f"{side}.rowLength"] = base + ptr + _PointerOperand.rowLength.offset
        layout[f"{side}.layerHeight"] = base + ptr + _PointerOperand.layerHeight.offset
    for axis in ("width", "height", "depth"):
        layout[f"extent.{axis}"] = Memcpy3DBatchOp.extent.offset + getattr(Extent, axis).offset
    layout["srcAccessOrder"] = Memcpy3DBatchOp.srcAccessOrder.offset
    layout["flags"] = Memcpy3DBatchOp.flags.offset
    return layout


DESCRIPTOR_BYTES = ctypes.sizeof(Memcpy3DBatchOp)
DESCRIPTOR_OFFSETS = _descriptor_layout()
WORDS = DESCRIPTOR_BYTES // 8
assert DESCRIPTOR_BYTES % 8 == 0 and sys.byteorder == "little"


def word(field: str) -> int:
    """The int64 column of ``field`` in a descriptor row."""
    return DESCRIPTOR_OFFSETS[field] // 8


# ---------------------------------------------------------------------------
# The runtime library.

def _load_cudart() -> ctypes.CDLL:
    major = (torch.version.cuda or "").split(".")[0]
    if not major:
        raise RuntimeError("torch is a CPU-only build; the direct path on a GPU needs a CUDA build of torch")
    try:  # the soname resolves to the copy torch already loaded
        return ctypes.CDLL(f"libcudart.so.{major}")
    except OSError:
        pass
    site = os.path.dirname(os.path.dirname(torch.__file__))
    patterns = [os.path.join(site, "nvidia", f"cu{major}", "lib", f"libcudart.so.{major}*"),
                os.path.join(site, "nvidia", "cuda_runtime", "lib", f"libcudart.so.{major}*"),
                os.path.join(os.path.dirname(torch.__file__), "lib", f"libcudart*.so.{major}*")]
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    raise RuntimeError(f"could not load libcudart.so.{major} (torch's CUDA runtime); looked under {site}/nvidia")


class CudaRuntime:
    """The few CUDA runtime calls the direct path and host pinning need."""

    def __init__(self):
        lib = _load_cudart()
        self.lib = lib
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        version = ctypes.c_int()
        lib.cudaRuntimeGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        self.check(lib.cudaRuntimeGetVersion(ctypes.byref(version)), "cudaRuntimeGetVersion")
        self.version = version.value
        size_t, ptr = ctypes.c_size_t, ctypes.c_void_p
        lib.cudaMemcpy2DAsync.argtypes = [ptr, size_t, ptr, size_t, size_t, size_t, ctypes.c_int, ptr]
        lib.cudaHostRegister.argtypes = [ptr, size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ptr]
        lib.cudaPointerGetAttributes.argtypes = [ptr, ptr]
        self._batch = getattr(lib, "cudaMemcpy3DBatchAsync", None)
        # CUDA 12.8-12.9 take a failIdx out-pointer that 13.0 dropped.
        self._batch_has_fail_idx = self.version < 13000
        if self._batch is not None and self.version >= 12080:
            self._batch.argtypes = ([size_t, ptr] + ([ptr] if self._batch_has_fail_idx else [])
                                    + [ctypes.c_ulonglong, ptr])
        else:
            self._batch = None

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def check(self, code: int, what: str) -> None:
        if code:
            # Clear the runtime's last-error slot: a later torch check would
            # otherwise report this (non-sticky) error at an unrelated call.
            self.lib.cudaGetLastError()
            text = self.lib.cudaGetErrorString(code) or b"unknown error"
            raise RuntimeError(f"{what} failed: {text.decode(errors='replace')} (cudaError {code})")

    def memcpy_2d(self, words: torch.Tensor, stream: int) -> None:
        """One cudaMemcpy2DAsync per descriptor row."""
        columns = [word(f) for f in ("dst.ptr", "dst.rowLength", "src.ptr", "src.rowLength",
                                      "extent.width", "extent.height")]
        call = self.lib.cudaMemcpy2DAsync
        for dst, dpitch, src, spitch, width, height in words[:, columns].tolist():
            code = call(dst, dpitch, src, spitch, width, height, CUDA_MEMCPY_DEFAULT, stream)
            if code:
                self.check(code, f"cudaMemcpy2DAsync(width={width}, height={height})")

    def memcpy_batch(self, words: torch.Tensor, stream: int) -> None:
        """All descriptors in cudaMemcpy3DBatchAsync calls of at most MAX_BATCH_OPS.

        ``words`` must stay alive until the call returns: the runtime reads the
        descriptor array during the call (the memory it describes is accessed
        later, in stream order), so the caller's reference suffices.
        """
        assert words.is_contiguous() and words.dtype == torch.int64 and words.shape[1] == WORDS
        fail_idx = ctypes.c_size_t(0)
        for first in range(0, words.shape[0], MAX_BATCH_OPS):
            chunk = words[first:first + MAX_BATCH_OPS]
            args = [chunk.shape[0], chunk.data_ptr()]
            if self._batch_has_fail_idx:
                args.append(ctypes.addressof(fail_idx))
            code = self._batch(*args, 0, stream)
            if code:
                self.check(code, f"cudaMemcpy3DBatchAsync({chunk.shape[0]} copies)")

    def host_register(self, ptr: int, nbytes: int) -> None:
        self.check(self.lib.cudaHostRegister(ptr, nbytes, 0), f"cudaHostRegister({nbytes} bytes)")

    def host_unregister(self, ptr: int) -> None:
        self.check(self.lib.cudaHostUnregister(ptr), "cudaHostUnregister")

    def host_registered(self, ptr: int) -> bool:
        """Whether host address ``ptr`` is in memory pinned by CUDA, by cudaHostAlloc (torch's pinned
        memory) or cudaHostRegister (the pools'): one cudaPointerGetAttributes call, whose struct begins
        with the memory type (cudaMemoryTypeHost is 1). cudaHostGetFlags answers only for the first kind."""
        attributes = ctypes.create_string_buffer(256)  # struct cudaPointerAttributes: 88 bytes in CUDA 13
        if self.lib.cudaPointerGetAttributes(attributes, ptr):
            self.lib.cudaGetLastError()  # clear the non-sticky error, or a later torch check reports it
            return False
        return ctypes.c_int.from_buffer(attributes).value == 1


_runtime: CudaRuntime | None = None
_runtime_lock = threading.Lock()


def cuda_runtime() -> CudaRuntime:
    global _runtime
    if _runtime is None:
        with _runtime_lock:
            if _runtime is None:
                _runtime = CudaRuntime()
    return _runtime
