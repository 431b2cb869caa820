"""Loads from a page-contiguous host layout through the device staging area, a group of layers at a time.

A load layer by layer with the kernel reads host memory with SMs, and each layer's launch waits for SMs behind
whatever the GPU computes: 0.20-0.21 of the link beside a saturating matmul at 16K tokens (docs/BENCHMARKS.md).
The copy engines need no SMs but cost about a microsecond or more per copy, and one layer of a ``page_first``
host page is 64 short rows. In a ``page_first`` buffer, though, a token's rows of consecutive layers are one
contiguous block, and in a ``page_first_direct`` buffer a page's rows of consecutive layers are. So a load of
a group of G layers here

1. copies, for each run of consecutive host blocks, the G layers' part of every block into a staging buffer
   laid out as the host's blocks cut to those layers (one 2-D copy per run: G rows' width, the host block's
   pitch; for G = every layer one flat copy), on the caller's stream;
2. scatters the staged rows of the G layers to the device layers' slots in one kernel launch (or torch
   indexing on the CPU), on the same stream after them.

A group's layers are read from the host when the group is loaded: a caller that loads layer by layer (SGLang's
``load_to_device_per_layer``) loads the group at its first layer and has nothing left to do for the others.
The staging memory is the backup area's (``staging.PageStaging``): its two buffers, its lock and its events,
so loads and backups through one area never overlap on its memory.

Not a default anywhere: the host pools take it only where ``load_group`` is set (host_pool.py), and
``tools/bench.py layered`` (providers ``staged-g8``, ``staged-g32``) and ``layouts`` (``staged-g4``,
``staged-g8``) measure it against the per-layer kernel, to decide.
"""

from __future__ import annotations

import math

import torch

from . import direct
from .staging import GATHER_BLOCKS, PageStaging, plan_chunks, staged_rows


class _Group:
    """The staging geometry of one group of layers ``[first, first + layers)`` in an area: its blocks (a host
    block cut to those layers), how many fit in each of the area's two buffers, the copy pairs (staged blocks of
    both buffers, the host blocks' part), and per buffer each layer's staged rows as one view."""

    def __init__(self, area: PageStaging, first: int, layers: int):
        page, row_elems = area.page, math.prod(area.row_shape)
        block = layers * page * row_elems  # elements of one staged block
        self.first, self.layers = first, layers
        # Both buffers' blocks packed from the area's start: the area holds 2 * chunk_blocks blocks of every
        # layer, so at least as many blocks of fewer layers.
        self.capacity = area.chunk_blocks * area.layers // layers
        staged = [a.view(-1)[:2 * self.capacity * block] for a in area.areas]  # the areas are contiguous
        self.pairs = direct.Pairs([(direct.Rows(s.view(2 * self.capacity, block), "staged blocks"),
                                    direct.Rows(h[:, first:first + layers].flatten(1), "host blocks"))
                                   for s, h in zip(staged, area.host_caches)])
        self.max_run = max(1, direct.MAX_COPY_BYTES // (block * area.host_caches[0].element_size()))
        layer_rows = (self.capacity - 1) * layers * page + page
        half = self.capacity * block
        self.views = [[[s[b * half:(b + 1) * half].view(-1, *area.row_shape)[l * page:l * page + layer_rows]
                        for l in range(layers)] for s in staged] for b in (0, 1)]
        self.rows = staged_rows(self.capacity * page, page, layers).to(area.device)
        self.tables: dict = {}  # buffer -> (device LayerTable, staged LayerTable), for the kernel's scatter


class GroupLoads:
    """Group loads through ``area`` into ``device_layers`` (per cache, the device layer tensors ``(slots,
    *row)`` in the host buffer's layer order)."""

    def __init__(self, area: PageStaging, device_layers: list):
        if len(device_layers) != len(area.host_caches):
            raise ValueError(f"device_layers must hold one list of layers per cache ({len(area.host_caches)}), "
                             f"got {len(device_layers)}")
        for layers in device_layers:
            if len(layers) != area.layers:
                raise ValueError(f"device_layers must hold the host buffer's {area.layers} layers per cache, got "
                                 f"{len(layers)}")
        self.area, self.device_layers = area, [list(layers) for layers in device_layers]
        self._groups: dict = {}

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor, first_layer: int, layers: int) -> bool:
        """``device[l][device_indices[i]] = host[l][host_indices[i]]`` for the layers ``first_layer`` to
        ``first_layer + layers - 1``, staged. Returns False (and does nothing) where the rows are better copied
        layer by layer: host slots the area declines (``PageStaging.host_blocks_of``), a negative device index
        on the CPU, or a CUDA graph being captured. TransferIndexError for a host slot past the buffer or a CPU
        device index past the pool; a GPU device index past the pool is skipped by the kernel, and the next op
        on the device raises it."""
        area = self.area
        if not (isinstance(first_layer, int) and isinstance(layers, int) and layers >= 1
                and 0 <= first_layer and first_layer + layers <= area.layers):
            raise ValueError(f"layers {first_layer}..{first_layer}+{layers} are not a range of the host buffer's "
                             f"{area.layers} layers")
        if area.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False  # the copies are planned from the host indices on the host
        blocks = area.host_blocks_of(host_indices)
        if blocks is None or not len(blocks):
            return blocks is not None
        if not device_indices.is_cuda and not area.device_indices_fit(device_indices):
            return False
        group = self._groups.get((first_layer, layers))
        if group is None:
            group = self._groups[(first_layer, layers)] = _Group(area, first_layer, layers)
        plan, parts = plan_chunks(group.pairs, blocks, group.capacity, group.max_run, load=True)
        count, page = len(blocks), area.page
        with area._lock:
            stream = torch.cuda.current_stream(area.device) if area.device.type == "cuda" else None
            for b in (0, 1):  # an earlier backup or load, maybe on another stream, may still use the area
                if area.used[b] and stream is not None:
                    stream.wait_event(area.copied[b])
            for k, start in enumerate(range(0, count, group.capacity)):
                b, tokens = k % 2, min(group.capacity, count - start) * page
                plan.run(group.pairs, part=parts[k])
                self._scatter(group, b, group.rows[:tokens], device_indices[start * page:start * page + tokens])
                if stream is not None:
                    area.copied[b].record(stream)
                area.used[b] = True
        return True

    def _scatter(self, group: _Group, b: int, rows: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Staged rows ``rows`` of buffer ``b`` to the device slots ``device_indices`` of the group's layers."""
        first, count = group.first, group.layers
        if self.area.device.type != "cuda":  # the CPU stand-in: torch indexing
            idx = device_indices.to(torch.int64)
            for views, layers in zip(group.views[b], self.device_layers):
                for view, layer in zip(views, layers[first:first + count]):
                    layer.index_copy_(0, idx, view.index_select(0, rows))
            return
        from . import ops

        tables = group.tables.get(b)
        if tables is None:
            device = [layers[first:first + count] for layers in self.device_layers]
            staged = group.views[b]
            tables = group.tables[b] = (
                ops.LayerTable(device[0] if len(device) == 1 else tuple(device), name="device layers", written=True),
                ops.LayerTable(staged[0] if len(staged) == 1 else tuple(staged), name="staged rows"))
        ops.transfer_all_layer(tables[0], device_indices, tables[1], rows, block_quota=GATHER_BLOCKS)
