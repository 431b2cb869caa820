"""The direct path: row copies done by the GPU's copy engines, no kernels, no JIT.

Every transfer is a list of ``(dst, src)`` row tensors (one pair per layer and
cache) plus one pair of index lists shared by all of them, as in ops.py:
row ``src[indices_src[i]]`` goes to ``dst[indices_dst[i]]``; a negative index
on either side skips its pair. The flow:

1. indices -> CPU int64 (GPU indices are copied back, which synchronizes the
   host with the GPU; upstream's ``transfer_kv_direct`` does the same);
2. ``plan_runs``: maximal runs where both sides advance by one slot, found
   one entry per page when the indices are whole pages (what HiCache moves),
   else one entry per row (``find_runs``);
3. ``describe_copies``: one copy per run and pair. Rows of a run sit at a
   fixed stride on each side, so a run is one 2-D copy (width = row bytes,
   pitch = slot stride, height = run length); when both strides equal the row
   size it is one flat copy of ``length * row`` bytes (cut at MAX_COPY_BYTES);
4. execution: CUDA tensors -> every copy, flat (packed runs: a page of a
   ``page_first_direct`` or ``layer_first`` layer) or strided (rows of a
   ``page_first`` layer), in one ``cudaMemcpy3DBatchAsync`` call (CUDA 12.8+);
   one ``cudaMemcpy2DAsync`` per copy where that call is missing, host memory
   is pageable, or a CUDA graph is being captured. (The driver's
   ``cuMemcpyBatchAsync`` returned wrong rows on driver 580.159.04 and is
   never called: docs/troubleshooting.md.) CPU tensors -> one tensor slice
   copy per run, so CI runs the same plan.

The CUDA runtime is torch's ``libcudart``, through ctypes (cuda.py), on the
current stream of the tensors' device. Which transfers come here, and the
cache that keeps a load's plan for all its layers, are route.py's.
"""

from __future__ import annotations

import logging

import torch

from .bounds import PAST_THE_END, check_rows, check_spans
from .checks import check_index_tensor
from .cuda import WORDS, CudaRuntime, cuda_runtime, word
from .descriptors import describe_copies
from .layout import TokenRows

log = logging.getLogger("sglang_hicache_jit.direct")  # its name from before the move to a subpackage (issue 20)

# 'batch': every copy of a transfer in cudaMemcpy3DBatchAsync calls; '2d': one cudaMemcpy2DAsync per
# copy; 'auto': 'batch' where it can run.
MODES = ("auto", "batch", "2d")
# Largest flat block one copy moves. A packed run is one block of length * row
# bytes, and CUDA caps a 2-D copy's pitch (cudaDevAttrMaxPitch, 2^31 - 1 on
# current GPUs), so longer runs are cut into pieces of at most this size.
MAX_COPY_BYTES = 1 << 30


# ---------------------------------------------------------------------------
# Rows and pairs: what one side of a copy is, validated once.

class Rows:
    """A tensor seen as slots of one contiguous row each: first dimension the
    slot, the remaining dimensions dense (per-layer views of a ``page_first``
    buffer qualify: their slot stride is larger than the row)."""

    __slots__ = ("tensor", "ptr", "stride", "row_bytes", "rows", "device", "dtype")

    def __init__(self, tensor, name: str = "cache"):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() < 2:
            raise ValueError(f"{name} must have a slot dimension and a row (at least 2-D), got shape "
                             f"{tuple(tensor.shape)}")
        expected = 1
        for size, stride in zip(reversed(tensor.shape[1:]), reversed(tensor.stride()[1:])):
            if size != 1 and stride != expected:
                raise ValueError(f"{name} must have contiguous rows (all dimensions after the first dense); got "
                                 f"shape {tuple(tensor.shape)} with strides {tensor.stride()}")
            expected *= size
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} must be a CPU or CUDA tensor, got device {tensor.device}")
        itemsize = tensor.element_size()
        self.tensor = tensor
        self.ptr = tensor.data_ptr()
        self.stride = tensor.stride(0) * itemsize
        self.row_bytes = expected * itemsize
        self.rows = tensor.shape[0]
        self.device = tensor.device.index if tensor.is_cuda else None
        self.dtype = tensor.dtype
        if self.rows > 1 and self.stride < self.row_bytes:
            raise ValueError(f"{name} has overlapping rows (slot stride {self.stride} B < row {self.row_bytes} B)")

    @classmethod
    def at(cls, ptr: int, stride: int, row_bytes: int, device: int, rows: int | None = None) -> "Rows":
        """Rows at a raw address (an entry of a pool's per-layer pointer table).

        The caller vouches for the address; the pool size is unknown unless
        given, so only the other side's bounds are checked. Unknown, it is the
        most slots whose addresses stay below 2**63, so that no index can wrap
        an address around to below ``ptr``. Host and device addresses alike:
        copies use cudaMemcpyDefault, which tells them apart.
        """
        if rows is None:
            rows = (PAST_THE_END - int(ptr)) // max(int(stride), int(row_bytes), 1)
        rows_ = cls.__new__(cls)
        rows_.tensor, rows_.ptr, rows_.stride, rows_.row_bytes = None, int(ptr), int(stride), int(row_bytes)
        rows_.rows, rows_.device, rows_.dtype = rows, device, None
        return rows_


class Pairs:
    """The (dst, src) row pairs of one transfer, validated once and reused.

    All pairs share one index list per side. Pools build a Pairs per layer
    (loads) and one over all layers (backups) on first use and keep them.
    """

    def __init__(self, pairs):
        pairs = list(pairs)
        if not pairs:
            raise ValueError("pairs must hold at least one (dst, src) pair")
        self.dst, self.src = [], []
        for i, pair in enumerate(pairs):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(f"pairs[{i}] must be a (dst, src) pair of tensors")
            dst = pair[0] if isinstance(pair[0], Rows) else Rows(pair[0], f"pairs[{i}] dst")
            src = pair[1] if isinstance(pair[1], Rows) else Rows(pair[1], f"pairs[{i}] src")
            if (dst.dtype != src.dtype and None not in (dst.dtype, src.dtype)) or dst.row_bytes != src.row_bytes:
                raise ValueError(f"pairs[{i}]: dst rows are {dst.row_bytes} B of {dst.dtype} but src rows are "
                                 f"{src.row_bytes} B of {src.dtype}; they must match")
            self.dst.append(dst)
            self.src.append(src)
        devices = {r.device for r in self.dst + self.src if r.device is not None}
        if len(devices) > 1:
            raise ValueError(f"pairs use several GPUs {sorted(devices)}; one transfer runs on one device")
        self.device = devices.pop() if devices else None
        # Pageable host memory is staged through driver buffers whatever the call;
        # 'auto' sends it one cudaMemcpy2DAsync per run rather than rely on the batch call for it.
        self.pageable = self.device is not None and any(
            r.device is None and r.tensor is not None and not r.tensor.is_pinned() for r in self.dst + self.src)
        self.dst_rows = min(r.rows for r in self.dst)
        self.src_rows = min(r.rows for r in self.src)
        # Per-pair constants of the copy descriptors, as CPU int64 columns.
        self.dst_ptr = torch.tensor([r.ptr for r in self.dst], dtype=torch.int64)
        self.src_ptr = torch.tensor([r.ptr for r in self.src], dtype=torch.int64)
        self.dst_stride = torch.tensor([r.stride for r in self.dst], dtype=torch.int64)
        self.src_stride = torch.tensor([r.stride for r in self.src], dtype=torch.int64)
        self.row_bytes = torch.tensor([r.row_bytes for r in self.dst], dtype=torch.int64)
        # A pair whose slots are back to back on both sides copies a run as one flat block.
        self.packed = (self.dst_stride == self.row_bytes) & (self.src_stride == self.row_bytes)
        # Everything a CopyPlan depends on but the base addresses: pairs of equal geometry share plans.
        self.geometry = (tuple(self.dst_stride.tolist()), tuple(self.src_stride.tolist()),
                         tuple(self.row_bytes.tolist()), self.dst_rows, self.src_rows, self.device, self.pageable)

    def __len__(self) -> int:
        return len(self.dst)


# ---------------------------------------------------------------------------
# Pure planning: runs and copy descriptors.

class Runs:
    """Maximal runs of a transfer: ``length[r]`` slots from ``src_start[r]`` to
    ``dst_start[r]`` (CPU int64 tensors of equal length)."""

    __slots__ = ("dst_start", "src_start", "length")

    def __init__(self, dst_start, src_start, length):
        self.dst_start, self.src_start, self.length = dst_start, src_start, length

    def __len__(self) -> int:
        return int(self.length.numel())

    def as_tuples(self) -> list[tuple[int, int, int]]:
        return list(zip(self.dst_start.tolist(), self.src_start.tolist(), self.length.tolist()))


def check_pair(indices_dst, indices_src) -> None:
    """The index contract for both index tensors of a transfer (checks.check_index_tensor) and equal lengths:
    what a caller of route.copy checks once per operation."""
    check_index_tensor("indices_dst", indices_dst)
    check_index_tensor("indices_src", indices_src)
    same_length(indices_dst, indices_src)


def same_length(indices_dst, indices_src, names: tuple = ("indices_dst", "indices_src")) -> None:
    """ValueError naming both arguments unless the two (checked) index tensors have one length."""
    if indices_dst.numel() != indices_src.numel():
        raise ValueError(f"{names[0]} has {indices_dst.numel()} entries but {names[1]} has "
                         f"{indices_src.numel()}; they must have the same length")


def _checked(indices_dst, indices_src) -> tuple[torch.Tensor, torch.Tensor]:
    check_pair(indices_dst, indices_src)
    # GPU indices are copied to the CPU here, which waits for the GPU: copies are issued from the host.
    return indices_dst.to("cpu", torch.int64).contiguous(), indices_src.to("cpu", torch.int64).contiguous()


def find_runs(indices_dst, indices_src) -> Runs:
    """Groups index pairs into runs in which both sides advance by one slot (row_runs), after checking both."""
    return row_runs(*_checked(indices_dst, indices_src))


def row_runs(dst: torch.Tensor, src: torch.Tensor) -> Runs:
    """Runs of index pairs the caller checked (contiguous CPU int64 of one length), one entry per row.

    Pairs with a negative index on either side are dropped first; a run may
    continue across a dropped pair because the rows either side of it are
    still consecutive on both sides.
    """
    keep = (dst >= 0) & (src >= 0)
    if not bool(keep.all()):
        dst, src = dst[keep], src[keep]
    if dst.numel() == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return Runs(empty, empty, empty)
    breaks = ((dst[1:] - dst[:-1]) != 1) | ((src[1:] - src[:-1]) != 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks.nonzero().flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([dst.numel()])])
    return Runs(dst[starts], src[starts], ends - starts)


def whole_pages(indices: torch.Tensor, page_size: int, *, aligned: bool = False) -> torch.Tensor | None:
    """The first index of every page if ``indices`` (CPU int64) is whole pages: groups of ``page_size``
    consecutive slots, none negative (and each starting at a multiple of ``page_size`` if ``aligned``);
    else None. HiCache moves whole pages, and planning one entry per page instead of one per token is
    what keeps the direct path's host cost per call small (docs/BENCHMARKS.md)."""
    count = indices.numel()
    if page_size < 2 or count == 0 or count % page_size:
        return None
    pages = indices.view(-1, page_size)
    starts = pages[:, 0]
    # A page's last slot, start + page_size - 1, must not pass 2**63 - 1: then the int64 subtraction
    # below cannot wrap, and a page equal to its start plus 0..page_size-1 is exactly that page.
    if bool(((starts < 0) | (starts > PAST_THE_END - (page_size - 1))).any()) or (
            aligned and bool((starts % page_size).any())):
        return None
    if not torch.equal(pages - starts[:, None], torch.arange(page_size).expand_as(pages)):
        return None
    return starts


def page_runs(dst_starts: torch.Tensor, src_starts: torch.Tensor, page_size: int) -> Runs:
    """find_runs for whole pages given by their first slots: page ``i`` is ``page_size`` rows from
    ``dst_starts[i]`` and from ``src_starts[i]``; pages that continue on both sides merge into one run."""
    if dst_starts.numel() != src_starts.numel():
        raise ValueError(f"dst_starts has {dst_starts.numel()} pages but src_starts has {src_starts.numel()}")
    if dst_starts.numel() == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return Runs(empty, empty, empty)
    breaks = ((dst_starts[1:] - dst_starts[:-1]) != page_size) | ((src_starts[1:] - src_starts[:-1]) != page_size)
    first = torch.cat([torch.zeros(1, dtype=torch.int64), breaks.nonzero().flatten() + 1])
    ends = torch.cat([first[1:], torch.tensor([dst_starts.numel()])])
    return Runs(dst_starts[first], src_starts[first], (ends - first) * page_size)


def split_runs(runs: Runs, max_rows: int) -> Runs:
    """The same copies with no run longer than ``max_rows`` slots."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be positive, got {max_rows}")
    if not len(runs) or int(runs.length.max()) <= max_rows:
        return runs
    pieces = (runs.length + max_rows - 1) // max_rows
    run_of_piece = torch.repeat_interleave(torch.arange(len(runs)), pieces)
    first_piece = torch.cumsum(pieces, 0) - pieces
    offset = (torch.arange(run_of_piece.numel()) - first_piece[run_of_piece]) * max_rows
    length = torch.minimum(runs.length[run_of_piece] - offset, torch.tensor(max_rows))
    return Runs(runs.dst_start[run_of_piece] + offset, runs.src_start[run_of_piece] + offset, length)


# Up to this many runs, check_bounds reads them as Python ints: its eight tensor ops cost about 25 us on a
# 2-core machine, where a staged backup of a few pages has one to a few runs (tools/bench.py host-cost).
SMALL_CHECK_RUNS = 64


def check_bounds(runs: Runs, dst_rows: int, src_rows: int) -> None:
    """Raises TransferIndexError if a run reaches past the end of either side (bounds.py: without
    wrap-around, before describe_copies computes an address)."""
    if len(runs) <= SMALL_CHECK_RUNS:
        length = runs.length.tolist()
        check_spans("indices_dst", runs.dst_start.tolist(), length, dst_rows, pool="that side")
        check_spans("indices_src", runs.src_start.tolist(), length, src_rows, pool="that side")
        return
    check_rows("indices_dst", runs.dst_start, dst_rows, runs.length, pool="that side")
    check_rows("indices_src", runs.src_start, src_rows, runs.length, pool="that side")


_batch_failure: str | None = None  # why the batch call was given up in this process, if it was
_null_stream_helpers: dict[int, torch.cuda.Stream] = {}


def batch_status() -> tuple[bool, str]:
    """Whether CUDA copies go out as batched calls, which, and why not."""
    runtime = cuda_runtime()
    if not runtime.has_batch:
        return False, (f"cudaMemcpy3DBatchAsync needs CUDA 12.8 or newer; torch's runtime is "
                       f"{runtime.version // 1000}.{runtime.version % 1000 // 10}: one cudaMemcpy2DAsync per run")
    if _batch_failure:
        return False, f"cudaMemcpy3DBatchAsync failed earlier in this process ({_batch_failure}); using 2-D copies"
    return True, (f"cudaMemcpy3DBatchAsync (CUDA runtime {runtime.version}) for every copy, flat and strided: "
                  "one call per transfer; one cudaMemcpy2DAsync per copy while a CUDA graph is captured")


# ---------------------------------------------------------------------------
# Execution.

def copy_rows(pairs, indices_dst, indices_src, *, mode: str = "auto", page_size: int = 1, dst_rows=None,
              src_rows=None) -> str:
    """Copies ``src[indices_src[i]] -> dst[indices_dst[i]]`` for every pair.

    ``pairs`` is a Pairs (or a list of (dst, src) tensors). ``mode`` picks the
    CUDA submission (see MODES): 'batch' (every copy in one
    cudaMemcpy3DBatchAsync call), '2d' (one cudaMemcpy2DAsync per run and
    pair) or 'auto' ('batch' where the call exists, host memory is pinned and
    the stream is not being captured). ``page_size``, ``dst_rows`` and
    ``src_rows``: see plan_runs. Returns what ran: 'batch', '2d', or 'torch'
    (CPU tensors: slice copies). Asynchronous on the current stream for CUDA.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    runs = plan_runs(indices_dst, indices_src, page_size, dst_rows=dst_rows, src_rows=src_rows)
    return copy_runs(pairs, runs, mode=mode)


def plan_runs(indices_dst, indices_src, page_size: int = 1, *, dst_rows=None, src_rows=None) -> Runs:
    """The runs of a transfer whose indices name slots, after checking both index tensors (see runs_of)."""
    return runs_of(*_checked(indices_dst, indices_src), page_size, dst_rows=dst_rows, src_rows=src_rows)


def runs_of(dst: torch.Tensor, src: torch.Tensor, page_size: int = 1, *, dst_rows=None, src_rows=None) -> Runs:
    """The runs of indices the caller checked (contiguous CPU int64 of one length). ``dst_rows`` / ``src_rows``
    (None: the identity) map a side's slots to the rows of its pair tensors, elementwise on CPU int64 tensors,
    keeping negative slots negative, and must map a page-aligned slot to the first of ``page_size``
    consecutive rows (layout.TokenRows does). When both sides are whole pages (aligned where a side is
    mapped), the plan takes one entry per page (whole_pages, page_runs); otherwise one per row (row_runs)."""
    dst_starts = whole_pages(dst, page_size, aligned=dst_rows is not None)
    src_starts = None if dst_starts is None else whole_pages(src, page_size, aligned=src_rows is not None)
    if src_starts is not None and dst_starts.numel() == src_starts.numel():
        return page_runs(_mapped(dst_rows, dst_starts), _mapped(src_rows, src_starts), page_size)
    return row_runs(_mapped(dst_rows, dst), _mapped(src_rows, src))


def _mapped(to_rows, slots: torch.Tensor) -> torch.Tensor:
    if to_rows is None:
        return slots
    if isinstance(to_rows, TokenRows):  # the caller checked the slots (runs_of): only their range is
        return to_rows(slots, checked=True)
    return to_rows(slots)


def copy_runs(pairs, runs: Runs, *, mode: str = "auto") -> str:
    """copy_rows for runs already planned: each run's rows, for every pair."""
    pairs = pairs if isinstance(pairs, Pairs) else Pairs(pairs)
    return CopyPlan(pairs, runs).run(pairs, mode=mode)


class CopyPlan:
    """The copies of one transfer, planned once for every layer that shares its indices.

    SGLang loads a request layer by layer with the same two index tensors, and
    the layers of a pool differ only in their base addresses. So the runs, the
    bounds check and the copy descriptors are made once, for the pairs of the
    first call, and a later call on pairs of the same geometry (strides, row
    sizes, row counts) only shifts the pointer columns by the bases' difference:
    two tensor additions instead of a plan. Measured on the H200: the per-call
    planning was what kept 16K-token loads of 64-token pages under half the
    link beside compute (docs/BENCHMARKS.md).
    """

    __slots__ = ("runs", "spans", "geometry", "dst_ptr", "src_ptr", "words", "n_runs")

    def __init__(self, pairs: Pairs, runs: Runs):
        check_bounds(runs, pairs.dst_rows, pairs.src_rows)
        self.geometry = pairs.geometry
        self.dst_ptr, self.src_ptr = pairs.dst_ptr, pairs.src_ptr
        self.runs = runs
        self.spans = None  # the CPU path's (dst, src, length) tuples, made on first use
        if pairs.device is not None and len(runs) and bool(pairs.packed.any()):
            runs = split_runs(runs, max(1, MAX_COPY_BYTES // int(pairs.row_bytes.max())))
        self.n_runs = len(runs)
        self.words = describe_copies(pairs, runs) if pairs.device is not None else None

    def fits(self, pairs: Pairs) -> bool:
        """Whether this plan's copies are those of ``pairs`` up to their base addresses."""
        return pairs.geometry == self.geometry

    def run(self, pairs: Pairs, *, mode: str = "auto", part: tuple[int, int] | None = None) -> str:
        """Copies the planned rows of ``pairs`` (which must fit this plan); returns what ran (copy_rows).
        ``part`` = (first, end): only runs first:end, of every pair (a staged backup sends a chunk's runs
        when its buffer is full), of a plan none of whose runs was split."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not self.fits(pairs):
            raise ValueError("pairs differ from the ones this copy plan was made for (strides, row sizes or row "
                             "counts); plan the transfer for them")
        if part is not None:
            if self.n_runs != len(self.runs) or not 0 <= part[0] <= part[1] <= self.n_runs:
                raise ValueError(f"part {part} is not a range of this plan's {len(self.runs)} runs (split into "
                                 f"{self.n_runs} copies)")
        if pairs.device is None:
            if self.spans is None:
                self.spans = self.runs.as_tuples()
            _copy_on_cpu(pairs, self.spans if part is None else self.spans[part[0]:part[1]])
            return "torch"
        return _copy_on_gpu(pairs, self, mode, part)

    def descriptors(self, pairs: Pairs, part: tuple[int, int] | None = None) -> torch.Tensor:
        """The copy descriptors (contiguous rows of ``cudaMemcpy3DBatchOp``) for ``pairs``: this plan's, shifted
        from its bases to theirs; with ``part``, those of runs first:end of every pair (rows are pair-major)."""
        first, end = (0, self.n_runs) if part is None else part
        moved = False
        # The pairs this plan was made for (a staged backup's, every call) have not moved: skip four tensor ops.
        if pairs.dst_ptr is not self.dst_ptr or pairs.src_ptr is not self.src_ptr:
            d_dst, d_src = pairs.dst_ptr - self.dst_ptr, pairs.src_ptr - self.src_ptr
            moved = bool(d_dst.any()) or bool(d_src.any())
        if (first, end) == (0, self.n_runs) and not moved:
            return self.words
        # A copy, contiguous: a part of several pairs (one run each, even) is otherwise a strided view.
        words = self.words.view(len(pairs), self.n_runs, WORDS)[:, first:end].clone(
            memory_format=torch.contiguous_format)
        if moved:
            words[:, :, word("dst.ptr")] += d_dst[:, None]
            words[:, :, word("src.ptr")] += d_src[:, None]
        return words.view(-1, WORDS)


def _copy_on_cpu(pairs: Pairs, spans: list) -> None:
    for dst, src in zip(pairs.dst, pairs.src):
        for d, s, n in spans:
            dst.tensor[d:d + n].copy_(src.tensor[s:s + n])


def _copy_on_gpu(pairs: Pairs, plan: CopyPlan, requested: str, part: tuple[int, int] | None = None) -> str:
    global _batch_failure
    runtime = cuda_runtime()
    device = pairs.device
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        if requested == "batch" and not runtime.has_batch:
            raise RuntimeError(batch_status()[1])
        mode = requested
        # Batched copies are not captured into CUDA graphs here (the batch call could not be captured
        # before CUDA 13): a capture records one 2-D copy per run, which replays like any other copy.
        if torch.cuda.is_current_stream_capturing():
            if requested != "auto" and requested != "2d":
                raise RuntimeError(f"mode={requested!r} cannot run while a CUDA graph is captured; use 'auto' or "
                                   "'2d'")
            mode = "2d"
        elif mode == "auto":
            mode = "batch" if runtime.has_batch and not _batch_failure and not pairs.pageable else "2d"
        first, end = (0, plan.n_runs) if part is None else part
        if end == first:
            return mode
        words = plan.descriptors(pairs, part)
        if mode == "2d":
            runtime.memcpy_2d(words, stream.cuda_stream)
            return "2d"
        try:
            _batch_on(runtime, words, stream, device)
            return mode
        except RuntimeError as exc:
            if requested != "auto":
                raise
            # Keep transfers working: one 2-D copy per run from now on; say so once. The copies are
            # idempotent, so redoing any the failed call did enqueue is safe.
            _batch_failure = str(exc)
            log.warning("%s; the direct path uses one cudaMemcpy2DAsync per run from now on", exc)
            runtime.memcpy_2d(words, stream.cuda_stream)
            return "2d"


def _batch_on(runtime: CudaRuntime, words: torch.Tensor, stream, device: int) -> None:
    """The copies of one transfer (descriptor rows), in cudaMemcpy3DBatchAsync calls on ``stream``."""
    # One batch on one stream: spreading it over several streams does not help
    # (measured: ~4.3 us of copy-engine time per 3-D copy whatever the stream count;
    # docs/host_pool.md).
    target = stream
    if not stream.cuda_stream:
        # The batch call refuses the legacy NULL stream: run on a helper stream
        # fenced on both sides, so the copies stay ordered with the caller's work.
        target = _null_stream_helpers.get(device)
        if target is None:
            target = _null_stream_helpers[device] = torch.cuda.Stream(device)
        target.wait_stream(stream)
    try:
        runtime.memcpy_batch(words, target.cuda_stream)
    finally:
        if target is not stream:
            stream.wait_stream(target)
