"""Where a transfer goes (the JIT kernel, the copy engines or staging), and the copy engines' one plan cache.

Every choice the host pools (host_pool.py) and SGLang's routed ops and hooks (integrations/sglang/ops.py,
pools.py) make about a transfer's path is made here, each by one small function or table with the
measurement it rests on beside it:

* the probe's verdict: ``pool_path`` (a host pool's path, once, at construction) and ``kernel_works``
  (per row size and process, for the routed ops);
* the copy-engines-only scope: ``copy_engines_only()``, a block in which every routed transfer takes the
  copy engines (or, for SGLang's io_backend='direct', all but the small copies), and ``kernel_available``,
  the verdict under it;
* small copies: ``SMALL_COPY_BYTES`` and ``small_copies``, the copies 'direct' gives the kernel at one CTA;
* the ``auto`` policy: ``AUTO_PATHS`` and ``auto_path``; ``io_path`` maps every ``io_backend`` of a host
  pool to a path, ``hook_path`` the backends of SGLang's per-layer hooks;
* staging: ``pool_stages`` and ``routed_stages``, which backups go through the device staging area;
* the plan cache: ``copy`` plans a copy-engine transfer once per index bytes and geometry
  (``PlanCache``), so a load's layers share one plan and changed indices are never served an old one.

The callers validate their index tensors (the index contract, equal lengths) once per operation and pass
them on; nothing here validates them again.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import logging
import threading

import torch

from . import direct
from .probe import probe

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# The probe's verdict.

def pool_path(first_layer, *, pinned: bool, row_bytes: int) -> tuple[str, str]:
    """A host pool's path and why, decided once at construction from its first device layer: the kernel where
    the probe says it works for ``row_bytes`` on that GPU, else the copy engines ('direct')."""
    if not first_layer.is_cuda:
        return "direct", (f"the device pool is on {first_layer.device}, not a GPU: transfers run as plain tensor "
                          "copies")
    if not pinned:
        return "direct", "the host pool is not pinned (pin_memory=False); the kernel needs pinned host memory"
    result = probe(row_bytes, device=first_layer.device.index)
    if result.available:
        return "kernel", f"the probe says: {result.reason}"
    fix = f" Fix: {result.fix}" if result.fix else ""
    return "direct", f"the probe says the kernel is unavailable [{result.code}]: {result.reason}{fix}"


_verdicts: dict = {}  # row bytes -> whether the kernel works for them (the routed ops'; reset() forgets)
_verdict_lock = threading.Lock()


def kernel_works(row_bytes: int, *, before_probe=None) -> bool:
    """What the probe says for rows of ``row_bytes`` on the current GPU, asked once per row size and process;
    ``before_probe()`` runs before the first question (the plugin logs its start line there). A row size the
    kernel does not take is logged once at WARNING."""
    ok = _verdicts.get(row_bytes)
    if ok is None:
        if before_probe is not None:
            before_probe()
        with _verdict_lock:
            result = probe(row_bytes)
            ok = _verdicts[row_bytes] = result.available
            if not ok:
                log.warning("sglang-hicache-jit: rows of %s B use the copy-engine path: [%s] %s", row_bytes,
                            result.code, result.reason)
    return ok


# ---------------------------------------------------------------------------
# The copy-engines-only scope.

_engines_only = contextvars.ContextVar("sglang_hicache_jit_copy_engines_only", default=False)


@contextlib.contextmanager
def copy_engines_only(*, small_copies_on_kernel: bool = False):
    """Within this block every routed transfer uses the copy engines. With ``small_copies_on_kernel`` the
    block means SGLang's io_backend='direct' (a pool asked for it on a layout whose direct branch it lacks,
    so its kernel branch runs, held to the copy engines): copies under SMALL_COPY_BYTES then take the kernel
    at SMALL_COPY_CTAS as io_path's 'direct' does (``small_copies``); without it, every copy (tests)."""
    token = _engines_only.set("direct" if small_copies_on_kernel else True)
    try:
        yield
    finally:
        _engines_only.reset(token)


def in_direct_scope() -> bool:
    """Whether this is a copy_engines_only(small_copies_on_kernel=True) block."""
    return _engines_only.get() == "direct"


def kernel_available(row_bytes: int, *, before_probe=None) -> bool:
    """Whether a routed transfer of ``row_bytes`` rows takes the kernel: the probe's verdict, outside a
    copy_engines_only() block."""
    return kernel_works(row_bytes, before_probe=before_probe) and not _engines_only.get()


# ---------------------------------------------------------------------------
# The auto policy.

# Where io_backend="auto" sends each operation when the kernel works for the rows (without it, every
# operation takes the copy engines). Measured on an H200 (driver 580.159.04), 1152-B rows, 8 layers, 16K and
# 64K tokens per call, alone / beside back-to-back bf16 8192^3 matmuls, as fractions of a contiguous pinned
# copy (docs/BENCHMARKS.md, "2026-12-06: the defaults", tools/bench.py layouts; data in docs/data/):
AUTO_PATHS = {
    # Backups are off the critical path, so they take the copy engines where the host pages are contiguous
    # across layers (page_first, page_first_direct: staged, see pool_stages): 0.76-0.93 / 0.55-0.82 at +5 to
    # +8% matmul time, the contiguous copy itself +4 to +6.5%. layer_first is the exception (LAYER_FIRST_BACKUP).
    "backup": "direct",
    # Loads are on the critical path, and the kernel moves them fastest on an idle GPU (0.77-0.83); beside the
    # matmul each per-layer launch waits for SMs (0.20-0.21 at 16K tokens, 0.76-0.79 at 64K). See
    # LOAD_ON_COPY_ENGINES_FROM for the loads that go to the copy engines instead.
    "load": "kernel",
}
# layer_first keeps one layer's page per copy: through the runtime's batched call each copy costs about 4.3 us
# of copy-engine time, so 64-token pages moved 0.40-0.41 / 0.34-0.35 against the kernel's 0.79-0.83 /
# 0.54-0.57 (at +9 to +11% matmul time, the copy engines +4 to +5%). The kernel (2 CTAs into host memory).
LAYER_FIRST_BACKUP = "kernel"
# Loads whose copies (layout.copy_bytes: one page of one layer where the layout keeps it contiguous, else one
# row) are at least this long, of fewer than LOAD_ON_COPY_ENGINES_BELOW_TOKENS tokens, with their indices on
# the host (the copy engines are planned on the CPU; GPU indices would cost a host sync), go to the copy
# engines. 256-token pages (288 KiB copies) at 16K tokens: 0.62-0.65 / 0.51-0.62 at +4.5 to +5.6%, the kernel
# 0.77-0.82 / 0.20-0.21; 64-token pages (72 KiB): 0.30-0.33 / 0.24-0.30, below the kernel both ways. At 64K
# tokens the kernel's wait for SMs is spread over longer launches and it leads beside the matmul too (0.77-0.79
# against 0.52-0.62). (It was 16 KiB while flat copies went through the driver's batch call, which returned
# wrong rows and is gone.)
LOAD_ON_COPY_ENGINES_FROM = 256 * 1024
LOAD_ON_COPY_ENGINES_BELOW_TOKENS = 32 * 1024
# Copies shorter than this never go to the copy engines one by one where the kernel works: a kernel of
# SMALL_COPY_CTAS CTA does them (what io_backend="direct" then runs, as 'kernel-small'). tools/bench.py
# small-copies (H200, 64 MiB each way in copies at random places): the batched call moved 0.01-0.02 of the
# link in single 1152-B rows, 0.11-0.15 in 18 KiB copies, 0.19-0.28 in 36 KiB, 0.33-0.42 in 72 KiB; the kernel
# with 1 CTA 0.36-0.42 at every size (2 CTAs 0.71-0.84). So below 64 KiB one CTA is at least as fast as the
# copy engines and takes one SM.
SMALL_COPY_BYTES = 64 * 1024
SMALL_COPY_CTAS = 1

IO_BACKENDS = ("kernel", "direct", "auto", "resident")


def small_copies(pairs: direct.Pairs, page_size: int = 1, *, before_probe=None) -> bool:
    """Whether SGLang's io_backend='direct' copies of ``pairs`` (tokens in pages of ``page_size``) take the
    kernel at SMALL_COPY_CTAS rather than the copy engines one copy at a time, the rule io_path applies to
    'direct' for this package's pools: each copy under SMALL_COPY_BYTES (a page of a layer where both sides
    keep its rows back to back, else one row), every pair between a GPU tensor and pinned host memory (not
    raw addresses, whose allocations the kernel path does not take as tensors), and the probe saying the
    kernel works for the rows. Never inside a plain copy_engines_only() block."""
    if _engines_only.get() is True or pairs.device is None or pairs.pageable:
        return False
    for dst, src in zip(pairs.dst, pairs.src):
        if dst.tensor is None or src.tensor is None or (dst.device is None) == (src.device is None):
            return False
    row_bytes = int(pairs.row_bytes[0])
    if any(int(b) != row_bytes for b in pairs.row_bytes):
        return False
    copy_bytes = row_bytes * page_size if bool(pairs.packed.all()) else row_bytes
    return copy_bytes < SMALL_COPY_BYTES and kernel_works(row_bytes, before_probe=before_probe)


def auto_path(operation: str, *, kernel_ok: bool, copy_bytes: int = 0, indices_on_host: bool = False,
              layout: str = "page_first", tokens: int = 0) -> str:
    """The ``io_backend="auto"`` path ('kernel' or 'direct') of ``operation`` ('load' or 'backup') for a host
    pool of ``layout`` whose copies are ``copy_bytes`` long, moving ``tokens`` tokens."""
    if operation not in AUTO_PATHS:
        raise ValueError(f"operation must be 'load' or 'backup', got {operation!r}")
    if not kernel_ok:
        return "direct"
    if operation == "backup":
        return LAYER_FIRST_BACKUP if layout == "layer_first" else AUTO_PATHS["backup"]
    if (copy_bytes >= LOAD_ON_COPY_ENGINES_FROM and indices_on_host
            and tokens < LOAD_ON_COPY_ENGINES_BELOW_TOKENS):
        return "direct"
    return AUTO_PATHS["load"]


def io_path(io_backend, operation: str, *, pool_path: str, copy_bytes: int, device_indices=None,
            layout: str = "page_first", staged: bool = False, direct_mode: str = "auto") -> str:
    """What a host pool built for ``pool_path`` runs for ``io_backend``: 'kernel', 'resident', 'direct' or
    'kernel-small' (the kernel at SMALL_COPY_CTAS CTAs).

    'direct' takes the copy engines, except copies under SMALL_COPY_BYTES where the kernel works and the copy
    engines' submission is left to 'auto' (``direct_mode``: a pool told to submit its copies one way means the
    copy engines; a backup the pool stages, ``staged``, moves whole host pages and stays on them); 'kernel' the pool's
    path (the copy engines where the kernel does not work, logged at construction; never an error);
    'resident' the kernel's resident method where the kernel works; 'auto' ``auto_path``."""
    kernel_ok = pool_path == "kernel"
    if io_backend == "direct":
        small = copy_bytes < SMALL_COPY_BYTES and direct_mode == "auto" and not (operation == "backup" and staged)
        return "kernel-small" if kernel_ok and small else "direct"
    if io_backend == "kernel":
        return pool_path
    if io_backend == "resident":
        return "resident" if kernel_ok else "direct"
    if io_backend == "auto":
        on_host = device_indices is not None and not device_indices.is_cuda
        return auto_path(operation, kernel_ok=kernel_ok, copy_bytes=copy_bytes, indices_on_host=on_host,
                         layout=layout, tokens=int(device_indices.shape[0]) if on_host else 0)
    raise ValueError(f"Unsupported IO backend: {io_backend!r} (choose one of {', '.join(IO_BACKENDS)})")


def unstaged_backup_path(io_backend, *, pool_path: str, copy_bytes: int, direct_mode: str = "auto") -> str:
    """What a backup into a page-contiguous layout runs where staging does not take it (staging off or its
    buffer too small, host slots in short runs, padding, page_first_direct slots that are not whole pages, a
    graph capture): its rows would leave one copy per row (``page_first``) or per page of a layer, which the
    copy engines move at 0.01-0.02 of the link for single 1152-B rows and 0.33-0.42 for 72 KiB
    (tools/bench.py small-copies). So where the kernel works 'auto' takes it, as for layer_first
    (LAYER_FIRST_BACKUP: 0.79-0.83 alone), and 'direct' takes it at SMALL_COPY_CTAS for copies under
    SMALL_COPY_BYTES, as io_path does for layouts that never stage; else the copy engines ('direct')."""
    if pool_path != "kernel":
        return "direct"
    if io_backend == "auto":
        return LAYER_FIRST_BACKUP
    if io_backend == "direct" and copy_bytes < SMALL_COPY_BYTES and direct_mode == "auto":
        return "kernel-small"
    return "direct"


def hook_path(io_backend: str, row_bytes: int, *, before_probe=None) -> str:
    """What one layer copied by a hook on SGLang's pools runs: the kernel where ``io_backend`` asks for it and
    it works for the rows (outside a copy_engines_only() block), else the copy engines."""
    if io_backend == "kernel" and kernel_available(row_bytes, before_probe=before_probe):
        return "kernel"
    return "direct"


# ---------------------------------------------------------------------------
# Staging (staging.py): a gather on the GPU into the host's page layout, then whole pages on the copy engines.

def pool_stages(layout: str, *, layers: int, pinned: bool, budget_bytes: int, page_bytes: int) -> bool:
    """Whether a host pool's copy-engine backups go through the device staging area: page_first and
    page_first_direct, whose pages are contiguous across layers (so runs of host pages leave as single large
    copies), more than one layer (one layer's rows are already contiguous), pinned host memory (the copies are
    flat blocks between device and pinned host memory), and a budget of at least two pages of every layer and
    cache (``page_bytes``: one page of them; less would copy a page in pieces, which the row copies serve as
    well). Row by row, page_first backups reached 0.22-0.29 of the link beside a matmul; page_first_direct
    backups of 64-token pages, one copy per page and layer, 0.35; both staged 0.55-0.82 (H200; AUTO_PATHS)."""
    return layout in ("page_first", "page_first_direct") and layers > 1 and pinned and budget_bytes >= 2 * page_bytes


def routed_stages(*, num_layers: int, layout_dim: int, item_size: int, indices: tuple, hosts: tuple,
                  before_probe=None) -> bool:
    """Whether an SGLang page_first backup (``transfer_kv_all_layer*_lf_pf``) goes through the staging area
    (the caller then needs the budget for a token and pinned host buffers): several layers packed in each
    token (``layout_dim == num_layers * item_size``), CPU host buffers in one block, and both index tensors on
    the CPU, which is what SGLang hands the copy engines (io_backend 'direct'). Staging reads the indices on
    the host, and for GPU indices (SGLang's 'kernel' backend) that would be a host sync in SGLang's scheduler
    thread, which the kernel's own backup never makes. The gather takes the kernel (a few microseconds of SMs)
    even under 'direct', so the probe must say the kernel works for the rows."""
    return (num_layers >= 2 and layout_dim == num_layers * item_size and not any(i.is_cuda for i in indices)
            and not any(h.is_cuda or not h.is_contiguous() for h in hosts)
            and kernel_works(item_size, before_probe=before_probe))


# SGLang's staged write-back (its page_first backups with host indices kept on the CPU, into staging buffers
# of 64 pages it allocates) is staged in those buffers, cut in two halves, when each half holds this many
# tokens. Smaller ones (pages of a few tokens) would cut a backup into many chunks, each a gather that waits
# for SMs beside compute and a few launches of host time (an 8K-token backup in 32-token chunks: 256), so
# such a write-back goes to the kernel row by row, and the plugin never takes GPU memory beyond upstream's.
WRITE_BACK_MIN_CHUNK_TOKENS = 256


def write_back_staged(row_bytes: int, *, before_probe=None) -> bool:
    """Whether SGLang's staged write-back is served through the staging area (what the routed
    ``can_use_write_back_jit_kernel`` answers): staging on (``SGLANG_HICACHE_JIT_STAGING`` not 0) and the
    kernel, which gathers, available for the rows."""
    from .. import settings

    return settings.staging_bytes() > 0 and kernel_available(row_bytes, before_probe=before_probe)


def write_back_memory_fits(memory: tuple, *, device, dtype, token_bytes: int) -> bool:
    """Whether SGLang's staging buffers can be the staging area: on the gather's device, contiguous, of the
    host's dtype, whole tokens of ``token_bytes``, and halves of at least WRITE_BACK_MIN_CHUNK_TOKENS."""
    return all(isinstance(m, torch.Tensor) and m.device == device and m.is_contiguous() and m.dtype == dtype
               and m.numel() * m.element_size() % token_bytes == 0 for m in memory) and min(
        m.numel() * m.element_size() for m in memory) // token_bytes >= 2 * WRITE_BACK_MIN_CHUNK_TOKENS


# ---------------------------------------------------------------------------
# The copy engines' plans.

def _load_memcmp():
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):  # no C library to ask: torch compares
        return None
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    memcmp.restype = ctypes.c_int
    return memcmp


_memcmp = _load_memcmp()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous CPU int64 tensors of one length hold the same values: one memcmp (measured on a
    2-core box: about 5 us for 16K indices, where torch.equal took 18 us and 1.5 ms at 64K, its threads)."""
    n = a.numel() * 8
    if not n:
        return True
    if _memcmp is None:
        return torch.equal(a, b)
    return _memcmp(a.data_ptr(), b.data_ptr(), n) == 0


def host_indices(idx: torch.Tensor) -> torch.Tensor:
    """An index tensor (validated by the caller) as contiguous CPU int64: itself when it is one already.
    GPU indices are copied back, which waits for the GPU: copies are issued from the host."""
    return idx.to("cpu", torch.int64).contiguous()


class PlanCache:
    """The CopyPlans of the last few transfers, found by the index BYTES they were planned for.

    A plan is reused only when both index tensors hold, as read at this call, the values it was planned from
    (a copy of them is kept with the plan and compared with memcmp), for pairs of the same geometry, the
    same page size and the same token -> row map on each side (``extra``). What a tensor is, or its version
    counter, decides nothing: indices rewritten behind torch's back (through ``.data``, a raw pointer, DLPack,
    a CUDA graph replay) are planned again, a new tensor with the same values reuses the plan, and inference
    tensors (which have no version counter) work. Reading the bytes costs one memcmp per side and call: about
    5 us for 16K CPU indices on a loaded 2-core box, against about 100-300 us of planning; GPU indices are
    copied to the host first (a sync per call, where the plan of the first layer made one anyway).
    ``capacity`` bounds the memory: a plan costs about 112 B per run and pair, its index copies 8 B per index.
    Thread-safe: SGLang loads and backs up from different threads.
    """

    def __init__(self, capacity: int = 8):
        self.capacity = capacity
        self._entries: list = []  # (numels, extra, dst copy, src copy, plan), oldest first
        self._lock = threading.Lock()

    def get(self, indices_dst: torch.Tensor, indices_src: torch.Tensor, extra, make):
        """The plan for these indices (validated tensors) and ``extra`` (hashable), else ``make(dst, src)``'s,
        kept: ``dst`` and ``src`` are the indices as contiguous CPU int64 tensors."""
        dst, src = host_indices(indices_dst), host_indices(indices_src)
        numels = (dst.numel(), src.numel())
        with self._lock:
            entries = list(self._entries)
        for entry in reversed(entries):  # the newest first: a load's layers hit the plan just made
            if entry[0] == numels and entry[1] == extra and _same_bytes(entry[2], dst) and _same_bytes(entry[3], src):
                return entry[4]
        plan = make(dst, src)
        # Copies, so that a later write to the caller's tensors cannot change what this plan is filed under.
        entry = (numels, extra, dst.clone(), src.clone(), plan)
        with self._lock:
            if len(self._entries) >= self.capacity:
                del self._entries[0]
            self._entries.append(entry)
        return plan

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


PLANS = PlanCache()  # the one plan cache: the host pools, the routed ops and the hooks


def copy(pairs: direct.Pairs, indices_dst, indices_src, *, page_size: int = 1, dst_map=None, src_map=None,
         mode: str = "auto", check=None) -> str:
    """``src[indices_src[i]] -> dst[indices_dst[i]]`` for every pair of ``pairs`` on the copy engines, planned
    once per index bytes (PLANS): SGLang's per-layer load loop passes the same indices for every layer, and
    the layers' pairs differ only in their addresses, so later layers rebase the first layer's plan
    (direct.CopyPlan). ``dst_map`` / ``src_map`` map a side's tokens to rows of its pair tensors (a
    layout.TokenRows, part of the key: a map on the other side is another plan); ``page_size``: see
    direct.plan_runs. ``check(dst, src)`` runs on the CPU indices when a plan is made (a caller's named range
    check). The indices must be validated by the caller. Returns what ran (direct.copy_rows)."""
    def make(dst, src):
        if check is not None:
            check(dst, src)
        return direct.CopyPlan(pairs, direct.runs_of(dst, src, page_size, dst_rows=dst_map, src_rows=src_map))

    plan = PLANS.get(indices_dst, indices_src, (pairs.geometry, page_size, dst_map, src_map), make)
    return plan.run(pairs, mode=mode)


def reset() -> None:
    """Forgets the per-row-size verdicts and every plan (tests, or after a clean)."""
    _verdicts.clear()
    PLANS.clear()
