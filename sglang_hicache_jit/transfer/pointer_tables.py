"""Raw pointer tables (one uint64 address per layer, what SGLang's pools pass), checked against the
allocations their addresses lie in.

A pointer table carries no size, so an index past a pool would be written wherever the address arithmetic
lands. ``checked(table, name)`` reads a table, finds the allocation each address lies in (``extents.py``)
and keeps the result; ``CheckedTable.rows(stride, row_bytes, name)`` is then the number of rows every
layer's allocation holds, the bound that the kernel and the copy engines check each index against before
anything is copied (bounds.py's rule: ``0 <= index < rows``, a negative index is padding).

What runs is what was checked: the copy engines take the host copy of the addresses
(``CheckedTable.addresses``), the kernel a private CUDA copy of them (``CheckedTable.launch``, made on the
GPU from the caller's table before it was read), never the caller's table itself. The kernel also gets
the caller's CUDA table's address (``CheckedTable.live``) and compares it with the private copy before it
copies a row: a table rewritten since it was checked makes the launch copy nothing and the next op raise
TransferIndexError, rather than rows going where the caller no longer means. (A table freed while a
launch that uses it is queued on another stream is the caller's race, as for its index tensors; at worst
that memory, still torch's, reads differently and the launch copies nothing.)

A table is checked again when its contents may have changed:

* a CPU table: on every call its bytes are compared with the bytes that were checked (a rewrite through
  numpy, ctypes or ``.data`` bumps no version counter);
* a CUDA table: reading it costs a device-to-host copy and a wait for the GPU, which SGLang's scheduler
  thread must not pay on every call. It is read again when torch says its data may have changed: another
  tensor at that id, another data pointer, another version (every in-place torch op, ``set_()`` and
  ``resize_()`` bump it; an inference tensor has no version, so only the first two count). A write torch
  cannot see (through ``.data``, ctypes, DLPack, a CUDA graph) is not noticed here; the kernel notices it
  (the live comparison above), so it can neither send a copy astray nor be silently ignored;
* any table, once the registry of allocations changed (``extents.Generation``).

Tables this package builds from addresses it already holds (``build``, ``CheckedTable.shifted``) are
checked when built and never read back.
"""

from __future__ import annotations

import ctypes
import struct
import weakref

import torch

from . import extents
from .bounds import PAST_THE_END

_MASK = (1 << 64) - 1
_MAX_RECORDS = 1024  # tables kept; a pool has a few (K, V, host, device)
_records: dict = {}  # id(table) -> CheckedTable
_UNIT = (1,)


class CheckedTable:
    """One table's addresses, each found inside an allocation, and what a transfer launches with."""

    __slots__ = ("ref", "ptr", "count", "stride", "version", "raw", "addresses", "extents", "launch", "device",
                 "generation", "_rows", "_shifted", "live", "__weakref__")

    def rows(self, stride: int, row_bytes: int, name: str) -> int:
        """Rows of ``row_bytes`` at ``stride`` bytes apart that every layer's allocation holds from the
        layer's address; ValueError naming ``name`` where even the first does not fit."""
        key = (stride, row_bytes)
        rows = self._rows.get(key)
        if rows is None:
            rows = PAST_THE_END
            for layer, (address, extent) in enumerate(zip(self.addresses, self.extents)):
                room = extent.end - address
                if address < extent.start or room < row_bytes:
                    raise ValueError(
                        f"{name}[{layer}] = {address:#x}: a row of {row_bytes} bytes there does not fit in the "
                        f"allocation the address lies in ({extent!r}); the table does not address rows of that "
                        "size")
                if stride:
                    rows = min(rows, (room - row_bytes) // stride + 1)
            self._rows[key] = rows
        return rows

    def shifted(self, offset: int) -> torch.Tensor:
        """A table of these addresses plus ``offset`` bytes (for instance one head group further into each
        row), made on the table's device from the checked copy and known without being read back."""
        table = self._shifted.get(offset)
        if table is None:
            base = self.launch if self.launch is not None else _tensor(self.addresses, None)
            table = (base.view(torch.int64) + offset).view(torch.uint64) if offset else base
            _keep(_record(table, [(a + offset) & _MASK for a in self.addresses], self.extents, launch=table,
                          raw=None, generation=self.generation))
            self._shifted[offset] = table
        return table


def checked(table, name: str) -> CheckedTable:
    """``table``'s record: from the cache while the table is as it was checked (see the module's
    docstring), else read and checked now. ``name`` is the argument errors name."""
    rec = _records.get(id(table))
    if rec is not None and rec.ref() is table and rec.generation == extents.Generation.value:
        if rec.launch is not None:
            try:
                version = table._version
            except RuntimeError:  # an inference tensor tracks no version
                version = None
            if table.data_ptr() == rec.ptr and version == rec.version:
                return rec
        elif (table.data_ptr() == rec.ptr and table.numel() == rec.count and table.stride() == rec.stride
              and _bytes(table) == rec.raw):
            return rec
    return _check(table, name)


def build(addresses, device, name: str) -> torch.Tensor:
    """A uint64 table of ``addresses`` on ``device``, checked now (each address must lie in an allocation)
    and then known to ``checked`` without a read back."""
    values = [int(a) & _MASK for a in addresses]
    table = _tensor(values, device)
    _keep(_record(table, values, _extents_of(values, name, table.device.index if table.is_cuda else None),
                  launch=table if table.is_cuda else None, raw=None if table.is_cuda else _bytes(table),
                  generation=extents.Generation.value))
    return table


def clear() -> None:
    """Forgets every checked table (tests, or ops.reset())."""
    _records.clear()


def _check(table, name: str) -> CheckedTable:
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of uint64 addresses (one per layer), got "
                        f"{type(table).__name__}")
    if (table.layout != torch.strided or table.is_meta or table.dtype not in (torch.uint64, torch.int64)
            or table.dim() != 1 or not table.numel() or not (table.is_cuda or table.device.type == "cpu")):
        layout = str(table.layout).split(".")[-1]
        raise ValueError(f"{name} must be a dense 1-D uint64 tensor of one address per layer, on the CPU or a GPU; "
                         f"got a {layout} {table.dtype} tensor of shape {tuple(table.shape)} on {table.device}")
    generation = extents.Generation.value  # before the look-ups: a registration meanwhile means another check
    try:
        version = table._version
    except RuntimeError:  # an inference tensor tracks no version
        version = None
    if table.is_cuda:
        # A private copy first, on the GPU in stream order (it sees what the stream wrote before this call),
        # then that copy is read: what is checked is what the kernel will read.
        launch = table.clone(memory_format=torch.contiguous_format)
        values = [v & _MASK for v in launch.view(torch.int64).tolist()]
        raw, device = None, table.device.index
    else:
        launch, device = None, None
        raw = _bytes(table)
        values = list(struct.unpack(f"={table.numel()}Q", raw))
    rec = _record(table, values, _extents_of(values, name, device), launch=launch, raw=raw, generation=generation)
    rec.version = version
    if launch is not None:
        rec.live = table.data_ptr()  # the kernel compares what is there with the private copy
    return _keep(rec)


def _extents_of(values: list, name: str, device) -> list:
    find = extents.finder(device)
    found = []
    for layer, address in enumerate(values):
        extent = find(address)
        if extent is extents.FREED:
            raise ValueError(f"{name}[{layer}] = {address:#x} lies in {extent.source}: the table points at memory "
                             "that was freed")
        if extent is None:
            raise ValueError(
                f"{name}[{layer}] = {address:#x} lies in no allocation this process knows (no registered pool "
                "buffer, no block of torch's allocator, no memory CUDA knows): a pointer table must hold "
                "addresses of GPU memory or of pinned host memory. Fix: for memory of your own, register it "
                "first (sglang_hicache_jit.transfer.extents.register)")
        found.append(extent)
    return found


def _record(table, values, found, *, launch, raw, generation) -> CheckedTable:
    rec = CheckedTable()
    rec.ref = weakref.ref(table)
    rec.ptr, rec.count, rec.stride = table.data_ptr(), table.numel(), table.stride()
    try:
        rec.version = table._version
    except RuntimeError:
        rec.version = None
    rec.raw, rec.addresses, rec.extents, rec.launch = raw, tuple(values), tuple(found), launch
    rec.device = table.device.index if table.is_cuda else None
    rec.generation, rec._rows, rec._shifted = generation, {}, {}
    rec.live = 0  # 0: the kernel's table is the one checked (this package built it)
    return rec


def _keep(rec: CheckedTable) -> CheckedTable:
    table = rec.ref()
    if table is not None:
        if len(_records) >= _MAX_RECORDS:
            _records.clear()
        _records[id(table)] = rec
    return rec


def _bytes(table: torch.Tensor) -> bytes:
    """The bytes of a CPU table, in order."""
    if table.stride() != _UNIT and table.numel() > 1:
        table = table.contiguous()
    return ctypes.string_at(table.data_ptr(), table.numel() * 8)


def _tensor(values: list, device) -> torch.Tensor:
    signed = [v - (1 << 64) if v >= 1 << 63 else v for v in values]
    return torch.tensor(signed, dtype=torch.int64, device=device).view(torch.uint64)
