"""Copy descriptors: the rows of ``cudaMemcpy3DBatchOp`` structs (cuda.py) that the direct path (direct.py)
hands the runtime's batch call, one per run of a transfer and (dst, src) pair.

Rows of a run sit at a fixed stride on each side, so a run is one 2-D copy (width = row bytes, pitch = slot
stride, height = run length); when both strides equal the row size it is one flat copy of ``length * row``
bytes. Every descriptor is built on the CPU as int64 words, so CI checks the same rows a GPU receives.
"""

from __future__ import annotations

import torch

from .cuda import DESCRIPTOR_OFFSETS, OPERAND_TYPE_POINTER, SRC_ACCESS_ORDER_STREAM, WORDS, word


def describe_copies(pairs, runs) -> torch.Tensor:
    """Copy descriptors for every (pair, run) of ``pairs`` (a direct.Pairs) and ``runs`` (a direct.Runs): a
    CPU int64 tensor of shape ``(len(pairs) * len(runs), DESCRIPTOR_BYTES // 8)`` whose rows are
    ``cudaMemcpy3DBatchOp`` structs, pair-major.

    Packed pairs copy a run as one block (width = length * row, height 1);
    strided ones as rows (width = row, height = length, pitch = slot stride).
    ``rowLength`` always holds the pitch, so the per-copy fallback reads it
    back as ``cudaMemcpy2DAsync``'s pitch.
    """
    n_pairs, n_runs = len(pairs), len(runs)
    if 0 < n_pairs * n_runs <= SMALL_PLAN_COPIES:
        return _describe_few(pairs, runs)
    words = torch.zeros((n_pairs, n_runs, WORDS), dtype=torch.int64)
    if not n_runs:
        return words.view(0, WORDS)
    packed = pairs.packed[:, None]
    row = pairs.row_bytes[:, None]
    length = runs.length[None, :]
    width = torch.where(packed, row * length, row)
    height = torch.where(packed, torch.ones_like(length), length)
    for side, start, base, stride in (("dst", runs.dst_start, pairs.dst_ptr, pairs.dst_stride),
                                      ("src", runs.src_start, pairs.src_ptr, pairs.src_stride)):
        words[:, :, word(f"{side}.type")] = OPERAND_TYPE_POINTER  # 4-byte enum in the low half of its word
        words[:, :, word(f"{side}.ptr")] = base[:, None] + start[None, :] * stride[:, None]
        words[:, :, word(f"{side}.rowLength")] = torch.where(packed, width, stride[:, None])
    words[:, :, word("extent.width")] = width
    words[:, :, word("extent.height")] = height
    words[:, :, word("extent.depth")] = 1
    # srcAccessOrder and flags share one word: order in the low half, flags (0) in the high half.
    assert DESCRIPTOR_OFFSETS["flags"] == DESCRIPTOR_OFFSETS["srcAccessOrder"] + 4
    words[:, :, word("srcAccessOrder")] = SRC_ACCESS_ORDER_STREAM
    return words.view(n_pairs * n_runs, WORDS)


# Up to this many copies, describe_copies builds rows in Python: a dozen tensor ops on tiny tensors cost about
# 70 us on a 2-core machine, where a staged backup of a few pages has 2-8 copies (tools/bench.py plan-cost).
SMALL_PLAN_COPIES = 32
_COLUMNS = {name: word(name) for name in ("dst.type", "dst.ptr", "dst.rowLength", "src.type", "src.ptr",
                                          "src.rowLength", "extent.width", "extent.height", "extent.depth",
                                          "srcAccessOrder")}


def _describe_few(pairs, runs) -> torch.Tensor:
    """describe_copies for a few copies, the same rows built from Python ints."""
    c = _COLUMNS
    rows = []
    spans = runs.as_tuples()
    for dst, src in zip(pairs.dst, pairs.src):
        packed = dst.stride == dst.row_bytes and src.stride == dst.row_bytes
        for d, s, n in spans:
            width, height = (dst.row_bytes * n, 1) if packed else (dst.row_bytes, n)
            row = [0] * WORDS
            row[c["dst.type"]] = row[c["src.type"]] = OPERAND_TYPE_POINTER
            row[c["dst.ptr"]] = dst.ptr + d * dst.stride
            row[c["src.ptr"]] = src.ptr + s * src.stride
            row[c["dst.rowLength"]] = width if packed else dst.stride
            row[c["src.rowLength"]] = width if packed else src.stride
            row[c["extent.width"]], row[c["extent.height"]], row[c["extent.depth"]] = width, height, 1
            row[c["srcAccessOrder"]] = SRC_ACCESS_ORDER_STREAM
            rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)
