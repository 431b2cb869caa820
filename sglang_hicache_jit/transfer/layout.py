"""Host layouts: the shape of a host buffer, the rows of one layer, and the row each token lands on.

With ``L`` layers, rows of shape ``R`` and pages of ``P`` tokens::

    layer_first        (L, slots, *R)      layer l: buf[l]         contiguous rows
    page_first         (slots, L, *R)      layer l: buf[:, l]      rows L rows apart
    page_first_direct  (pages, L, P, *R)   layer l: see below

A ``page_first_direct`` layer keeps the ``P`` rows of a page together, but its pages are ``L * P`` rows
apart, so no single slot stride describes it. Its layer is therefore viewed as the buffer's flat rows
from the layer's first row (``layer_rows``), and token ``t`` is row ``(t // P) * L * P + t % P`` of that
view (``TokenRows``); the other layouts need no map. Either path (kernel or copy engines) then sees a
plain strided layer.

Everything that addresses a host buffer by its layout goes through here: the host pools
(transfer/host_pool.py), SGLang's routed ops and hooks (integrations/sglang/ops.py, pools.py), the
benchmarks (bench/, tools/benchmarks/) and the soak (tools/soak_direct.py). The tests keep their own
reference formulas, written out, so that a mistake here cannot hide in both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import bounds

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"Unsupported layout: {layout!r} (choose one of {', '.join(LAYOUTS)})")
    return layout


def buffer_shape(layout: str, *, layers: int, slots: int, page_size: int, row_shape: tuple) -> tuple:
    """The shape of one cache's host buffer (``slots`` a multiple of ``page_size``)."""
    if layout == "layer_first":
        return (layers, slots, *row_shape)
    if layout == "page_first":
        return (slots, layers, *row_shape)
    return (slots // page_size, layers, page_size, *row_shape)


def layer_rows(buffer: torch.Tensor, layout: str, layer: int) -> torch.Tensor:
    """Layer ``layer`` of ``buffer`` (shaped as ``buffer_shape`` says) as ``(rows, *R)`` with one slot stride.

    For page_first_direct: the flat rows from the layer's first row to its last, the same count for every
    layer (so pairs of different layers share a geometry, and a copy plan serves them all); token ``t`` is
    row ``TokenRows(...)(t)`` of it. The caller checks ``layer`` against the layer count."""
    if layout == "layer_first":
        return buffer[layer]
    if layout == "page_first":
        return buffer[:, layer]
    pages, layers, page_size = buffer.shape[0], buffer.shape[1], buffer.shape[2]
    flat = buffer.view(pages * layers * page_size, *buffer.shape[3:])
    span = (pages - 1) * layers * page_size + page_size
    return flat[layer * page_size:layer * page_size + span]


class TokenRows(NamedTuple):
    """Token -> row map of a paged layout (``bounds.token_rows``): row ``(t // page_size) * page_rows +
    (t % page_size) * token_stride``; negative tokens stay negative (padding), a token at or past ``slots``
    raises TransferIndexError naming ``name``. A tuple, so that a plan cache can key on it: two maps are the
    same map exactly when their fields are equal."""

    page_size: int
    page_rows: int
    slots: int
    name: str = "host_indices"
    token_stride: int = 1
    pool: str = "the host pool"

    def __call__(self, tokens: torch.Tensor, *, checked: bool = False) -> torch.Tensor:
        return bounds.token_rows(self.name, tokens, page_size=self.page_size, page_rows=self.page_rows,
                                 slots=self.slots, token_stride=self.token_stride, pool=self.pool, checked=checked)


def token_rows(layout: str, *, layers: int, page_size: int, slots: int, name: str = "host_indices",
               pool: str = "the host pool") -> TokenRows | None:
    """The token -> row map of ``layer_rows``' view of a layer, or None where tokens are rows already
    (layer_first, page_first, and page_first_direct of one layer)."""
    if layout != "page_first_direct" or layers == 1:
        return None
    return page_first_direct_map(layers=layers, page_size=page_size, slots=slots, name=name, pool=pool)


def page_first_direct_map(*, layers: int, page_size: int, slots: int, name: str = "host_indices",
                          pool: str = "the host pool") -> TokenRows:
    """page_first_direct's token -> row map of ``layer_rows``' view, one layer included (where a caller
    bounds its tokens by ``slots`` through the map)."""
    return TokenRows(page_size, layers * page_size, slots, name, 1, pool)


def layer_offsets(layout: str, *, layers: int, row_bytes: int, page_size: int = 1, slots: int = 0) -> list:
    """The byte offset of each layer's first row from the buffer's start (rows of ``row_bytes``): the
    per-layer address tables of the all-layer ops are the buffer's address plus these."""
    step = {"layer_first": slots * row_bytes, "page_first": row_bytes,
            "page_first_direct": page_size * row_bytes}[check_layout(layout)]
    return [layer * step for layer in range(layers)]


def token_index(layout: str, layer: int, tokens: torch.Tensor, page_size: int) -> tuple:
    """The index of layer ``layer``'s rows at ``tokens`` in the buffer's own shape: ``buffer[token_index(...)]``
    reads them, ``buffer[token_index(...)] = rows`` writes them (benchmarks checking their copies)."""
    if layout == "layer_first":
        return (layer, tokens)
    if layout == "page_first":
        return (tokens, layer)
    return (tokens // page_size, layer, tokens % page_size)


def page_index(layout: str, start: int, page_size: int) -> tuple:
    """The index of the whole page starting at token ``start`` (all layers) in the buffer's own shape."""
    if layout == "layer_first":
        return (slice(None), slice(start, start + page_size))
    if layout == "page_first":
        return (slice(start, start + page_size),)
    return (slice(start // page_size, start // page_size + 1),)


def copy_bytes(layout: str, *, layers: int, row_bytes: int, page_size: int) -> int:
    """The bytes of one copy-engine copy of a whole page of one layer: the page where the layout keeps a
    layer's page contiguous, one row where its rows are strided (page_first of several layers)."""
    return row_bytes if layout == "page_first" and layers > 1 else row_bytes * page_size
