"""Backups into page-contiguous host layouts through a device staging area: a gather on the GPU, then whole
pages on the copy engines.

In a ``page_first`` host buffer a token is one contiguous block across layers, and in a ``page_first_direct``
buffer a page is (``page_size`` tokens x ``L`` layers x row bytes: 576 KiB for 64 tokens of 8 layers of
1152-B rows); consecutive host slots are consecutive blocks. But one layer's rows are strided (page_first)
or cut into one short block per page (page_first_direct). Copying them row by row, or page by page per
layer, costs either SMs (the kernel) or the copy engines' cost per copy (about 4.3 us each in the runtime's
batched call: 0.35-0.41 of the link for 64-token pages). So a backup here

1. gathers the rows of every layer from the device into a staging buffer on the GPU, laid out exactly as
   the host buffer (HBM speed, microseconds of SM time, one launch for all layers), on the caller's stream;
2. copies each run of consecutive host blocks (a token or a page, or ones that follow each other) as one
   flat block (``direct.CopyPlan``: the runtime's batched call, no SMs), on the same stream after it.

The staging area is two buffers of half of ``SGLANG_HICACHE_JIT_STAGING`` (default 512 MiB) each, so a
large backup runs in chunks, gathered into the two buffers in turn. Beside a saturating matmul each gather
first waits for SMs (about one matmul, 1.4 ms for a bf16 8192^3 product), which is what keeps 16K-token
backups at 0.55-0.61 of the link beside it (0.76-0.89 alone) while 64K-token ones keep 0.67-0.82 (H200,
2026-12-06, tools/bench.py layouts; docs/BENCHMARKS.md).
Ordering: everything runs on the caller's stream, so the gather sees what was written to the device cache
before the call and the copies follow their gather; a buffer that an earlier backup on another stream
used is gathered into only after that backup's copies (an event per buffer).
"""

from __future__ import annotations

import math
import threading

import torch

from . import direct
from ..errors import TransferIndexError
from .bounds import PAST_THE_END
from .layout import page_first_direct_map

# Up to this many host indices a backup reads and plans them as Python ints (a write-through of a request's
# last pages is 64-512 tokens): the tensor ops it replaces cost about 150 us of the caller's thread, SGLang's
# scheduler's, on a 2-core machine (tools/bench.py host-cost, docs/BENCHMARKS.md).
SMALL_BACKUP_TOKENS = 1024
# Host slots must come in runs of at least this many tokens on average for staging to pay: each run is one
# flat copy of run x layers x row bytes, and the copy engines' fixed cost per copy (0.3-0.8 us in a batch)
# would otherwise dominate. HiCache moves whole pages (often 64 tokens), far above it.
MIN_RUN = 16
# CTAs of the gather. It moves HBM to HBM, so more CTAs finish it sooner at about the same SM time: in an
# exploratory sweep 32 against the kernel's default 8 took a 16K-token backup from 0.86 to 0.92 of the link
# alone (H200, 2026-12-04, docs/BENCHMARKS.md). Beside a saturating matmul what costs the copy engines is
# each gather's wait for SMs, so fewer, larger chunks (the budget) matter there, not the CTA count.
GATHER_BLOCKS = 32
# Gather on the caller's stream, in order with the copies, rather than on a side stream that overlaps the
# gather of one chunk with the copies of the one before. A side stream must wait on an event for a buffer's
# copies before gathering into it again, and (the likely reason for what follows; not isolated) a stream
# waiting on an event holds up the other streams that share its hardware queue, here SGLang's. Measured
# in a Llama-3.1-8B-sized SGLang 0.5.17 server (H100, 2026-12-07, docs/BENCHMARKS.md), same machine: the
# device hit right after an 8K miss (whose 1 GiB backup is four chunks) took 48.2 ms with the side stream,
# 39.0 ms with one stream, 38.0 ms upstream (whose staged write-back also runs on one stream). One stream
# costs that backup about 5% of its rate (23.2 against 22.0 ms); a backup of one chunk loses nothing.
# Read when a staging area is made; the server harness sets it first for the A/B.
GATHER_ON_SIDE_STREAM = False


class PageStaging:
    """The staging area of one page-contiguous host buffer (per cache) and the device pool backed up into it.

    ``page_size`` names the host block a copy moves: 1 for ``page_first`` (a token's rows of every layer,
    ``(slots, L, *row)``), the pool's page size for ``page_first_direct`` (a page's rows of every layer,
    ``(pages, L, P, *row)``). A staging buffer has the host buffer's layout, so staged block j is host block
    ``host_blocks[j]`` byte for byte. Inside a buffer, token t of layer l is row
    ``l * P + (t // P) * L * P + t % P`` of the buffer's flat rows (``staged_rows``); for P = 1 that is token
    t's layer-l row of a page_first buffer.

    ``gather(b, views, rows, device_indices)`` writes device rows ``device_indices`` of every layer into
    staging buffer ``b``: ``views[c][l]`` is layer l of cache c as flat rows starting at the layer's first row
    (one row stride for every layer), and ``rows`` the staged row of each token in it. The JIT kernel does it
    in one launch where it runs, else torch indexing (see gatherers below).

    Thread-safe: SGLang backs up from its own thread while others may too; one backup's submission (the
    gathers, the copies and the events that order them) is made under a lock, so a second backup, on any
    stream, sees the first one's events and never gathers into a buffer whose copies are still queued.
    """

    def __init__(self, host_caches: list, *, budget_bytes: int, device, device_rows: int, gather,
                 page_size: int = 1, memory: list | None = None):
        first = host_caches[0]
        self.page = int(page_size)
        self.layers = first.shape[1]
        row_shape = first.shape[2:] if self.page == 1 else first.shape[3:]
        if self.page > 1 and first.shape[2] != self.page:
            raise ValueError(f"a page_first_direct host buffer of shape {tuple(first.shape)} does not hold pages "
                             f"of {self.page} tokens")
        self.host_blocks = first.shape[0]
        self.device_rows = device_rows
        self.device = torch.device(device)
        self.gather = gather
        block_elems = self.layers * self.page * math.prod(row_shape)
        block_bytes = block_elems * first.element_size() * len(host_caches)
        if memory is not None:
            _check_memory(memory, host_caches, device)
        elif budget_bytes < 2 * block_bytes:
            raise ValueError(f"a staging budget of {budget_bytes} bytes holds no host block of {block_bytes} bytes "
                             "in each of its two buffers")
        # Never more than the host buffer could send in one backup.
        self.chunk_blocks = min(budget_bytes // (2 * block_bytes), self.host_blocks)
        if memory is not None:  # the caller's device buffers (one per cache)
            self.chunk_blocks = min(memory[0].shape[0] // 2, self.host_blocks)
        else:
            memory = [torch.empty((2 * self.chunk_blocks, *first.shape[1:]), dtype=first.dtype, device=self.device)
                      for _ in host_caches]
        # Per cache, one area of two buffers (its halves): staged block j of buffer b is the area's block
        # b * chunk_blocks + j, so one copy plan addresses both buffers and a backup is planned once.
        areas = [m[:2 * self.chunk_blocks] for m in memory]
        self.areas, self.host_caches, self.row_shape = areas, list(host_caches), tuple(row_shape)
        self.buffers = [[a[b * self.chunk_blocks:(b + 1) * self.chunk_blocks] for a in areas] for b in (0, 1)]
        # A block (token or page) of every layer as one row: consecutive host blocks are one flat block.
        self.pairs = direct.Pairs([(direct.Rows(h.view(-1, block_elems), "host blocks"),
                                    direct.Rows(a.view(-1, block_elems), "staged blocks"))
                                   for h, a in zip(host_caches, areas)])
        # The longest run one copy may take (CopyPlan splits longer ones; the plan here must not be split).
        self.max_run = max(1, direct.MAX_COPY_BYTES // (block_elems * first.element_size()))
        # Per buffer and cache, each layer as flat rows of one stride, as long as the last layer's.
        layer_rows = (self.chunk_blocks - 1) * self.layers * self.page + self.page
        self.views = [[[buf.view(-1, *row_shape)[l * self.page: l * self.page + layer_rows]
                        for l in range(self.layers)] for buf in bufs] for bufs in self.buffers]
        self.staged_rows = staged_rows(self.chunk_blocks * self.page, self.page, self.layers).to(self.device)
        self.side = torch.cuda.Stream(self.device) if GATHER_ON_SIDE_STREAM else None
        self.gathered = [torch.cuda.Event(), torch.cuda.Event()]
        self.copied = [torch.cuda.Event(), torch.cuda.Event()]
        self.used = [False, False]
        self._lock = threading.Lock()

    def backup(self, host_indices: torch.Tensor, device_indices: torch.Tensor, *, bound_on_gpu: bool = False) -> bool:
        """``host[host_indices[i]] = device[device_indices[i]]`` for every layer, staged. Returns False (and
        does nothing) where rows are better copied one by one: a negative host index, or a negative device
        index on the CPU (each skips its pair, which a block copy cannot), host slots in runs shorter than
        MIN_RUN tokens on average, for ``page_first_direct`` host slots that are not whole aligned pages, or a
        CUDA graph being captured on the current stream.

        Device indices are read on the host and refused before anything is copied (for GPU ones that waits for
        the GPU), unless ``bound_on_gpu`` (SGLang's staged write-back, from its scheduler thread) and they are
        on the GPU: then one outside the device pool, or a negative one, makes the gather skip that token and
        the next op on the device raise TransferIndexError (maybe a later chunk's gather in this call); that
        token's host slot holds stale staging bytes, so the error must not be ignored."""
        if torch.cuda.is_current_stream_capturing():
            return False  # staging reads the indices on the host; the row copies record into a graph
        blocks = self.host_blocks_of(host_indices)
        if blocks is None or not len(blocks):
            return blocks is not None  # declined, or nothing to copy
        if bound_on_gpu and device_indices.is_cuda:
            # Read on the host they would cost a device sync in the caller's thread (SGLang's scheduler). The
            # gather's kernel bounds them on the device instead: a row outside the pool is skipped and the next
            # op raises TransferIndexError. A negative one cannot be padding here (a block copy cannot skip
            # its token), so it is sent past the end to be refused the same way.
            device_indices = device_indices.to(torch.int64)
            device_indices = device_indices.masked_fill(device_indices < 0, PAST_THE_END)
        elif not self.device_indices_fit(device_indices):
            return False
        plan, parts = plan_chunks(self.pairs, blocks, self.chunk_blocks, self.max_run)
        with self._lock:
            self._submit(len(blocks), device_indices, plan, parts)
        return True

    def device_indices_fit(self, device_indices: torch.Tensor) -> bool:
        """Whether a block copy can take ``device_indices`` (read on the host): False for a negative one (padding
        a block copy cannot skip: the caller copies rows), TransferIndexError for one past the device pool."""
        low, high = (int(v) for v in torch.aminmax(device_indices))
        if low < 0:
            return False
        if high >= self.device_rows:
            raise TransferIndexError(f"device_indices holds index {high}, but the device pool has only "
                                     f"{self.device_rows} slots")
        return True

    def host_blocks_of(self, host_indices: torch.Tensor):
        """The host blocks (tokens for page_first, pages for page_first_direct) that ``host_indices`` names, in
        order: a list of ints for up to SMALL_BACKUP_TOKENS indices, else a CPU int64 tensor; None where they
        are better copied one by one (a negative index skips its pair, which a block copy cannot; blocks in
        runs shorter than MIN_RUN tokens on average; page_first_direct slots that are not whole aligned
        pages). TransferIndexError for an index past the host buffer."""
        host = host_indices.to("cpu", torch.int64)
        count = host.numel()
        if count == 0:
            return []
        small = count <= SMALL_BACKUP_TOKENS
        if small:  # Python ints: cheaper than a dozen tensor ops on a few hundred indices
            values = host.tolist()
            low, high = min(values), max(values)
        else:
            low, high = (int(v) for v in torch.aminmax(host))
        if low < 0:
            return None
        if high >= self.host_blocks * self.page:
            raise TransferIndexError(f"host_indices holds index {high}, but the host pool has only "
                                     f"{self.host_blocks * self.page} slots")
        if self.page == 1:
            blocks = values if small else host
        else:
            starts = direct.whole_pages(host, self.page, aligned=True)
            if starts is None:
                return None
            blocks = (starts // self.page).tolist() if small else starts // self.page
        if small:
            runs = 1 if _consecutive(blocks) else 1 + sum(b != a + 1 for a, b in zip(blocks, blocks[1:]))
        else:
            runs = int((blocks[1:] - blocks[:-1] != 1).sum()) + 1
        return None if runs * MIN_RUN > count else blocks

    def _submit(self, count: int, device_indices: torch.Tensor, plan, parts: list) -> None:
        stream = torch.cuda.current_stream(self.device)
        side = self.side or stream  # the area's own side stream where it was made with one
        if side is not stream:
            side.wait_stream(stream)
            if device_indices.is_cuda:  # the side stream reads them: their memory must outlive its gathers
                device_indices.record_stream(side)
        for b in (0, 1):  # an earlier backup's copies, maybe on another stream, may still read a buffer
            if self.used[b]:
                side.wait_event(self.copied[b])
        for k, first in enumerate(range(0, count, self.chunk_blocks)):
            b = k % 2
            n = min(self.chunk_blocks, count - first)
            tokens = n * self.page
            with torch.cuda.stream(side):
                if k >= 2 and side is not stream:  # on the caller's stream its order already holds
                    side.wait_event(self.copied[b])
                self.gather(b, self.views[b], self.staged_rows[:tokens],
                            device_indices[first * self.page: first * self.page + tokens])
            if side is not stream:
                self.gathered[b].record(side)
                stream.wait_event(self.gathered[b])
            plan.run(self.pairs, part=parts[k])
            self.copied[b].record(stream)
            self.used[b] = True


def plan_chunks(pairs, blocks, chunk_blocks: int, max_run: int, *, load: bool = False) -> tuple:
    """The copies of a whole staged backup of host ``blocks`` (CPU int64, or a list of ints), planned once:
    runs of consecutive host blocks that stay inside one chunk of ``chunk_blocks``, each from where its
    chunk's buffer holds it (chunk k in buffer k % 2, whose block j is row ``(k % 2) * chunk_blocks + j`` of
    the pairs' source), none longer than ``max_run`` blocks; and per chunk the (first, end) range of runs
    that empties it. One plan per chunk cost 0.3-0.4 ms of the caller's thread each, SGLang's scheduler's
    (tools/bench.py plan-cost, docs/BENCHMARKS.md). ``load``: the same copies the other way (the pairs are
    (staged, host) and each chunk's range of runs fills its buffer from the host)."""
    # Consecutive host blocks (a fresh allocation, the common case) make one run per chunk, written out
    # directly: for an 8K-token backup that replaces about 200 us of tensor ops (tools/bench.py host-cost).
    if isinstance(blocks, list):
        if blocks and _consecutive(blocks):
            return _plan_consecutive(pairs, blocks[0], len(blocks), chunk_blocks, max_run, load)
        return _plan_chunks_of_ints(pairs, blocks, chunk_blocks, max_run, load)
    count = blocks.numel()
    if count:
        first = int(blocks[0])
        if int(blocks[-1]) - first == count - 1 and torch.equal(blocks, torch.arange(first, first + count)):
            return _plan_consecutive(pairs, first, count, chunk_blocks, max_run, load)
    position = torch.arange(count)
    breaks = (blocks[1:] - blocks[:-1] != 1) | (position[1:] % chunk_blocks == 0)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks.nonzero().flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([count])])
    runs = direct.split_runs(direct.Runs(blocks[starts], starts, ends - starts), max_run)
    # Runs are in backup order and none crosses a chunk: chunk k's are those starting in its blocks.
    bounds = torch.searchsorted(runs.src_start, torch.arange(0, count + chunk_blocks, chunk_blocks)).tolist()
    staged = runs.src_start // chunk_blocks % 2 * chunk_blocks + runs.src_start % chunk_blocks
    columns = (staged, runs.dst_start) if load else (runs.dst_start, staged)
    plan = direct.CopyPlan(pairs, direct.Runs(*columns, runs.length))
    return plan, list(zip(bounds[:-1], bounds[1:]))


def _consecutive(blocks: list) -> bool:
    """Whether a non-empty list of ints is ``first, first + 1, ...`` (a fresh allocation): one list compare."""
    first, last = blocks[0], blocks[-1]
    return last - first == len(blocks) - 1 and blocks == list(range(first, last + 1))


def _plan_chunks_of_ints(pairs, blocks: list, chunk_blocks: int, max_run: int, load: bool = False) -> tuple:
    """plan_chunks for blocks given as Python ints: the same runs and parts, in one pass."""
    dst, staged, length, bounds = [], [], [], []
    previous = None
    for i, block in enumerate(blocks):
        j = i % chunk_blocks
        if j == 0:  # a new chunk: its runs start here
            bounds.append(len(dst))
        if j and block == previous + 1 and length[-1] < max_run:
            length[-1] += 1
        else:
            dst.append(block)
            staged.append(i // chunk_blocks % 2 * chunk_blocks + j)
            length.append(1)
        previous = block
    bounds.append(len(dst))
    return _plan_of(pairs, dst, staged, length, bounds, load)


def _plan_consecutive(pairs, first: int, count: int, chunk_blocks: int, max_run: int, load: bool = False) -> tuple:
    """plan_chunks for the host blocks ``first, first + 1, ..., first + count - 1``: one run per chunk, cut
    every ``max_run`` blocks."""
    dst, staged, length, bounds = [], [], [], []
    for k, start in enumerate(range(0, count, chunk_blocks)):
        bounds.append(len(dst))
        n = min(chunk_blocks, count - start)
        for offset in range(0, n, max_run):
            dst.append(first + start + offset)
            staged.append(k % 2 * chunk_blocks + offset)
            length.append(min(max_run, n - offset))
    bounds.append(len(dst))
    return _plan_of(pairs, dst, staged, length, bounds, load)


def _plan_of(pairs, host: list, staged: list, length: list, bounds: list, load: bool) -> tuple:
    """(the copy plan of these runs, each chunk's (first, end) range of them), from Python ints."""
    columns = (staged, host, length) if load else (host, staged, length)
    runs = direct.Runs(*(torch.tensor(column, dtype=torch.int64) for column in columns))
    return direct.CopyPlan(pairs, runs), list(zip(bounds[:-1], bounds[1:]))


def _check_memory(memory: list, host_caches: list, device) -> None:
    """The caller's staging buffers: one per host cache, on the staging device, contiguous, with the host
    blocks' shape and dtype, and room for a block in each half."""
    if len(memory) != len(host_caches):
        raise ValueError(f"staging memory must be one buffer per cache ({len(host_caches)}), got {len(memory)}")
    for m, h in zip(memory, host_caches):
        if (not isinstance(m, torch.Tensor) or m.device != torch.device(device) or not m.is_contiguous()
                or m.dtype != h.dtype or m.shape[1:] != h.shape[1:] or m.shape[0] < 2):
            got = f"{tuple(m.shape)} {m.dtype} on {m.device}" if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"a staging buffer must be a contiguous {h.dtype} tensor on {device} of at least two "
                             f"blocks of shape {tuple(h.shape[1:])}, got {got}")


def staged_rows(tokens: int, page: int, layers: int) -> torch.Tensor:
    """Where each of ``tokens`` staged tokens sits in a layer's flat rows of a staging buffer whose blocks are
    ``page`` tokens of ``layers`` layers, as in a page_first_direct host buffer: layout.TokenRows' map
    ``(t // page) * layers * page + t % page`` (int64, CPU)."""
    to_rows = page_first_direct_map(layers=layers, page_size=page, slots=tokens, name="staged tokens")
    return to_rows(torch.arange(tokens, dtype=torch.int64), checked=True)


# ---------------------------------------------------------------------------
# Gatherers: how the device rows reach a staging buffer.

def kernel_gather(source_table):
    """The JIT all-layer kernel, from ``source_table`` (an ops.LayerTable over the device layers)."""
    from . import ops

    tables: dict = {}

    def gather(b, views, rows, device_indices):
        table = tables.get(b)
        if table is None:
            table = tables[b] = ops.LayerTable(views[0] if len(views) == 1 else tuple(views), name="staging",
                                               written=True)
        ops.transfer_all_layer(table, rows, source_table, device_indices, block_quota=GATHER_BLOCKS)

    return gather


def pointer_table_gather(source_tables: tuple, row_bytes: int):
    """The JIT all-layer kernel from SGLang's per-layer pointer tables (one uint64 device tensor per cache)."""
    from . import ops

    tables: dict = {}

    def gather(b, views, rows, device_indices):
        table = tables.get(b)
        if table is None:
            table = tables[b] = tuple(torch.tensor([layer.data_ptr() for layer in layers], dtype=torch.uint64,
                                                   device=layers[0].device) for layers in views)
        first = views[0][0]
        ops.transfer_pointer_tables(table if len(table) > 1 else table[0], rows,
                                    source_tables if len(source_tables) > 1 else source_tables[0], device_indices,
                                    dst_stride_bytes=first.stride(0) * first.element_size(),
                                    src_stride_bytes=row_bytes, element_size=row_bytes, block_quota=GATHER_BLOCKS)

    return gather


def torch_gather(device_layers: list):
    """torch indexing, one launch per layer and cache (where the JIT kernel cannot run): ``device_layers``
    holds, per cache, the device layer tensors in host-layer order."""

    def gather(b, views, rows, device_indices):
        idx = device_indices.to(rows.device, torch.int64, non_blocking=True)
        for layer_views, layers in zip(views, device_layers):
            for view, layer in zip(layer_views, layers):
                view.index_copy_(0, rows, layer.index_select(0, idx))

    return gather
