"""Token-slot allocator of a host pool: hands out whole pages, takes back only what it handed out.

Same contract as SGLang's ``HostKVCache.alloc/free``: ``alloc(n)`` returns n
free slots (CPU int64, whole pages) or None when there are not enough, and
``free(indices)`` returns slots to the pool. Unlike a bare free list, a slot
that is not currently allocated (never handed out, or freed already) cannot
come back: ``free`` raises and changes nothing, so a double free can never
hand one slot to two owners.

On a paged pool a free must be whole pages, each one page's slots in order
(``[4, 5, 6, 7]``, not ``[0, 1, 2, 5]``): ``alloc`` hands the queue out in
page-sized pieces, so a broken page would hand one slot to two owners (the
new owner's whole-page writes reach a slot the first owner still holds).

Freed slots are queued as chunks (O(len(indices)) per ``free``, no copy of
the whole free list); ``alloc`` takes from the front of the queue, so slots
are reused in the order they were freed, after the never-used ones.
"""

from __future__ import annotations

import collections
import os
import threading

import torch

from .checks import check_dense

# The bookkeeping of one slot: its "allocated" flag (1 B) and its number in the free queue (8 B).
BYTES_PER_SLOT = 9


def _memory(name: str) -> int | None:
    """Bytes of memory by sysconf's ``name`` (SC_PHYS_PAGES: all, SC_AVPHYS_PAGES: free now), None where unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf(name)
    except (AttributeError, ValueError, OSError):
        return None


class SlotAllocator:
    def __init__(self, size: int, page_size: int):
        for name, value, low in (("size", size, 0), ("page_size", page_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int of at least {low}, got {value!r}")
        if size % page_size:
            raise ValueError(f"size ({size}) must be a multiple of page_size ({page_size}): the allocator hands out "
                             "whole pages")
        self.size, self.page_size = int(size), int(page_size)
        total = _memory("SC_PHYS_PAGES")
        if total is not None and self.size * BYTES_PER_SLOT > total:  # torch's out-of-memory error otherwise
            raise ValueError(self._too_large(f"more than this machine's {total / 2**30:.1f} GiB of memory", total))
        self.lock = threading.RLock()
        self.clear()

    def _too_large(self, why: str, memory: int) -> str:
        fit = memory // BYTES_PER_SLOT // self.page_size * self.page_size
        return (f"size={self.size} slots needs {self.size * BYTES_PER_SLOT / 2**30:.1f} GiB for the slot "
                f"allocator's bookkeeping ({BYTES_PER_SLOT} B a slot), {why}; at most {fit} slots fit "
                f"(whole pages of {self.page_size})")

    def clear(self) -> None:
        with self.lock:
            try:
                allocated = torch.zeros(self.size, dtype=torch.bool)
                chunks = collections.deque([torch.arange(self.size, dtype=torch.int64)])
            except RuntimeError as exc:  # out of memory now (torch.OutOfMemoryError is a RuntimeError too)
                free = _memory("SC_AVPHYS_PAGES")
                why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
                if free is None:
                    raise ValueError(f"size={self.size} slots: the slot allocator's bookkeeping "
                                     f"({BYTES_PER_SLOT} B a slot) could not be allocated ({why})") from None
                raise ValueError(self._too_large(f"which could not be allocated ({why}); "
                                                 f"{free / 2**30:.1f} GiB are free now", free)) from None
            self._allocated, self._chunks, self._available = allocated, chunks, self.size

    def available_size(self) -> int:
        return self._available

    def alloc(self, need_size: int):
        if isinstance(need_size, bool) or not isinstance(need_size, int) or need_size < 0:
            raise ValueError(f"need_size must be a non-negative int, got {need_size!r}")
        if need_size % self.page_size:
            raise ValueError(f"need_size ({need_size}) must be a multiple of the page size ({self.page_size})")
        with self.lock:
            if need_size > self._available:
                return None
            taken, missing = [], need_size
            while missing:
                chunk = self._chunks[0]
                if chunk.numel() <= missing:
                    taken.append(self._chunks.popleft())
                    missing -= chunk.numel()
                else:
                    taken.append(chunk[:missing])
                    self._chunks[0] = chunk[missing:]
                    missing = 0
            if not taken:
                selected = torch.empty(0, dtype=torch.int64)
            else:
                selected = torch.cat(taken) if len(taken) > 1 else taken[0].clone()
            self._allocated[selected] = True
            self._available -= need_size
            return selected

    def free(self, indices) -> int:
        if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"indices must be an int32 or int64 torch.Tensor, got {type(indices).__name__}")
        check_dense("indices", indices)
        indices = indices.reshape(-1).to("cpu", torch.int64)
        if indices.numel() % self.page_size:
            raise ValueError(f"indices must free whole pages: {indices.numel()} slots is not a multiple of the "
                             f"page size ({self.page_size})")
        if not indices.numel():
            return 0
        if int(indices.min()) < 0 or int(indices.max()) >= self.size:
            raise ValueError(f"indices must lie in [0, {self.size}); got values in "
                             f"[{int(indices.min())}, {int(indices.max())}]")
        P = self.page_size
        if P > 1:
            pages = indices.view(-1, P)
            broken = (pages[:, 0] % P != 0) | (pages != pages[:, :1] + torch.arange(P)).any(dim=1)
            if bool(broken.any()):
                page = pages[broken][0].tolist()
                raise ValueError(f"indices must free whole pages: each {P} indices must be one page's slots in "
                                 f"order (a multiple of {P}, then the next {P - 1}); got {page[:8]}; nothing was "
                                 "freed")
        with self.lock:
            allocated = self._allocated[indices]
            if not bool(allocated.all()):
                bad = indices[~allocated][:8].tolist()
                raise ValueError(f"indices holds slots that are not allocated (never handed out, or freed "
                                 f"already): {bad}; nothing was freed")
            if torch.unique(indices).numel() != indices.numel():
                raise ValueError("indices names a slot more than once; nothing was freed")
            self._allocated[indices] = False
            self._chunks.append(indices.clone())
            self._available += indices.numel()
        return indices.numel()
