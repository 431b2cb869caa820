"""The C side of the transfer library as ctypes sees it: the HicacheTransfer struct, the method and
hint codes, the error words, the exported functions' signatures, and the raw CUDA stream and device
the launcher hands over. Mirrors kernels/hicache_transfer.h; tests/test_ops_abi.py checks the struct."""

from __future__ import annotations

import ctypes

import torch

# block_quota=None lets the kernel pick its measured default: 4 CTAs for the
# bulk engine (host -> GPU), 8 for plain loads and stores (GPU -> host). For
# reference only: the kernel's kDefaultBulkBlocks / kDefaultPlainBlocks decide.
DEFAULT_BLOCK_QUOTA = {"bulk": 4, "plain": 8}
# ...except into host memory, where the ops pass 2 themselves: beside back-to-back bf16 matmuls on an H200
# an all-layer backup of 16K-64K tokens moved 0.54-0.57 of the link at +8 to +10% matmul time with 2 CTAs,
# 0.87 at +102 to +179% with 8 (alone 0.79-0.84 against 0.93). Transfers in a server run beside compute,
# so the default is the budget with the most link per point of slowdown (tools/bench.py cta, 2026-12-04).
D2H_BLOCK_QUOTA = 2
_METHODS = {"auto": 0, "plain": 1, "bulk": 2}
METHOD_NAMES = {1: "plain", 2: "bulk", 17: "resident-plain", 18: "resident-bulk"}
# Or'ed into a method code: submit through the resident kernel's queue
# (HICACHE_RESIDENT_QUEUED in kernels/hicache_transfer.h).
_RESIDENT = 16
# HICACHE_HINT_DST_DEVICE: the destination is GPU memory (tunes the bulk pipeline's refills).
_HINT_DST_DEVICE = 1
RESIDENT_QUEUE_SLOTS = 64

_ERROR_WORDS = 4
_ERROR_MESSAGES = (
    "an index in indices_src was past the end of the source pool",
    "an index in indices_dst was past the end of the destination pool",
    "a row address was not 4-byte aligned",
    "a CUDA pointer table was rewritten after it was checked, by a write torch could not see (through .data, "
    "ctypes, DLPack or a CUDA graph), so nothing was copied through it; write pointer tables with torch ops, "
    "or pass a new tensor",
)

_NO_ERRORS = bytes(4 * len(_ERROR_MESSAGES))


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
        ("src_live0", ctypes.c_void_p), ("src_live1", ctypes.c_void_p),
        ("dst_live0", ctypes.c_void_p), ("dst_live1", ctypes.c_void_p),
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
