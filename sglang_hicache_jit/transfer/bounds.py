"""The index rule, in one place: which indices address a row, checked before any address is computed.

An index addresses a row of a pool of ``rows`` slots when ``0 <= index < rows``; a negative index is
padding (its pair is skipped, sgl-kernel's convention). A run of ``length`` rows from ``start`` fits when
``0 <= start <= rows - length``. Both are checked on exact values: a max reduction of the indices, or
``rows - length``, neither of which can wrap, where ``start + length`` in int64 wraps past 2**63 and let a
run that starts near 2**63 pass as small. A paged layout maps a token to a row by multiplying its page
number; ``token_rows`` refuses a token outside the pool before it multiplies, since the product wraps too
(tokens 2**62 + k landed on page 0). A layer id must satisfy ``0 <= layer_id < layers``: Python's negative
indexing would otherwise pick a layer from the end.

Before any of that, an index tensor must be one (``check_index_tensor``): a dense 1-D int32 or int64
tensor that holds data, on the CPU or on the transfer's GPU. A float index would be truncated (1.9 -> row
1), and a NaN or a uint64 of 2**63 and more would turn negative in int64, which is padding: silently
skipped rows. So every other dtype is refused, naming the argument.

Every path calls these: the kernel ops (strict mode, and the pools' page-mapped indices), the direct
path's runs, the host pools, compat and the routed SGLang ops (docs/concepts.md, "The index contract").
"""

from __future__ import annotations

import operator

import torch

from ..errors import TransferIndexError

# Where a token outside its pool goes when its indices stay on the GPU (token_rows): past the end of
# any pool, so the consumer's own range check refuses it (the kernel skips the row and reports it).
PAST_THE_END = (1 << 63) - 1


_INDEX_DTYPES = (torch.int32, torch.int64)


def check_index_tensor(name: str, idx, device: int | None = None) -> None:
    """The index contract every path shares: ``idx`` (the argument ``name``) is a dense 1-D int32 or int64
    tensor that holds data (not a meta tensor), on the CPU or a GPU, and on GPU ``device`` where it is
    given. TypeError (not a tensor, not one of those dtypes, sparse or nested) or ValueError (shape,
    device) naming ``name`` otherwise."""
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 or int64 (1-D), got {type(idx).__name__}")
    if idx.layout != torch.strided or getattr(idx, "is_nested", False):
        kind = "nested" if getattr(idx, "is_nested", False) else str(idx.layout).split(".")[-1]
        raise TypeError(f"{name} must be a dense (strided) tensor of int32 or int64, got a {kind} tensor")
    if idx.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {idx.dtype}")
    if idx.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(idx.shape)}")
    if idx.is_meta:  # every path reads the indices, on the host or the GPU; torch raised NotImplementedError
        raise ValueError(f"{name} must be on the CPU or a GPU, got a meta tensor (it holds no data)")
    if idx.is_cuda:
        if device is not None and idx.device.index != device:
            raise ValueError(f"{name} is on {idx.device} but the transfer runs on cuda:{device}")
    elif idx.device.type != "cpu":
        where = "the CPU" if device is None else f"the CPU or cuda:{device}"
        raise ValueError(f"{name} must be on {where}, got {idx.device}")


def check_rows(name: str, first: torch.Tensor, rows: int, length: torch.Tensor | None = None, *,
               pool: str = "its pool") -> None:
    """Raises TransferIndexError unless every index of ``first`` addresses a row of a pool of ``rows``.

    Without ``length``, ``first`` holds indices (int32 or int64, any device) and a negative one is
    padding: one max reduction decides (for a CUDA tensor reading it waits for the GPU, so the kernel
    path calls this only in strict mode). With ``length`` (run lengths, each >= 1), ``first`` holds the
    starts of runs, which must satisfy ``0 <= start <= rows - length``: runs are made of kept pairs,
    so a negative start is an error there, not padding.
    """
    if first.dtype not in _INDEX_DTYPES:  # a float max would be truncated by int() below
        raise TypeError(f"{name} must be int32 or int64, got {first.dtype}")
    if not first.numel():
        return
    if length is None:
        top = int(first.max())
        if top >= rows:
            raise TransferIndexError(f"{name} holds index {top}, but {pool} has only {rows} slots")
        return
    bad = (first < 0) | (first > rows - length)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        _run_past_the_end(name, int(first[i]), int(length[i]), rows, pool)


def check_spans(name: str, starts: list, lengths: list, rows: int, *, pool: str = "its pool") -> None:
    """check_rows for runs given as Python ints (``starts[i]``, ``lengths[i]`` >= 1): the same rule and error,
    without a tensor op, for plans of a few runs whose fixed cost per op would dominate."""
    for start, length in zip(starts, lengths):
        if start < 0 or start > rows - length:
            _run_past_the_end(name, start, length, rows, pool)


def _run_past_the_end(name: str, start: int, length: int, rows: int, pool: str):
    # The run's last index, in Python ints: exact where int64 would wrap.
    index = start if start < 0 else start + length - 1
    raise TransferIndexError(f"{name} holds index {index}, but {pool} has only {rows} slots")


def check_layer(layer_id, layers: int, *, name: str = "layer_id", pool: str = "a pool") -> int:
    """``layer_id`` as an int in ``[0, layers)``; TypeError or ValueError naming ``name`` otherwise."""
    try:
        if isinstance(layer_id, bool) or (isinstance(layer_id, torch.Tensor) and (
                layer_id.is_meta or layer_id.dtype == torch.bool)):
            raise TypeError  # True is not layer 1; a meta tensor holds no value (its .item() raises RuntimeError)
        layer = operator.index(layer_id)
    except TypeError:
        what = (f"a {'meta ' if layer_id.is_meta else ''}{layer_id.dtype} tensor"
                if isinstance(layer_id, torch.Tensor) else type(layer_id).__name__)
        raise TypeError(f"{name} must be an int, got {what}") from None
    if not 0 <= layer < layers:
        raise ValueError(f"{name} {layer} is out of range for {pool} of {layers} layers")
    return layer


def token_rows(name: str, tokens: torch.Tensor, *, page_size: int, page_rows: int, slots: int,
               token_stride: int = 1, pool: str = "the host pool", checked: bool = False) -> torch.Tensor:
    """The row of each token of a paged layout: ``(t // page_size) * page_rows + (t % page_size) *
    token_stride``, as int64 on the tokens' device; negative tokens stay negative (padding).

    A token must be below ``slots`` (the pool's token count). On the CPU an index past that raises
    TransferIndexError naming ``name``; on a GPU, where reading the tokens would wait for it, such a
    token maps to PAST_THE_END, which the consumer's range check refuses (the kernel skips the row
    and reports it at the next op), so the caller must hand the rows to a path that knows the pool's
    row count. Either way the product is never formed for a token outside the pool. ``checked``: the caller
    already held ``tokens`` to the index contract (check_index_tensor), so it is not checked again; the range
    check stays.
    """
    if not checked:
        check_index_tensor(name, tokens)
    tokens = tokens.to(torch.int64)
    if tokens.is_cuda:
        outside = tokens >= slots
        inside = torch.where(outside, 0, tokens)
    else:
        check_rows(name, tokens, slots, pool=pool)
        inside = tokens
    # Padding (negative tokens) is multiplied too, and replaced by itself below.
    rows = torch.div(inside, page_size, rounding_mode="floor") * page_rows + inside.remainder(page_size) * token_stride
    rows = torch.where(tokens < 0, tokens, rows)
    return torch.where(outside, PAST_THE_END, rows) if tokens.is_cuda else rows
