"""One call that says whether the one-layer kernel can be used here, and why not.

``probe()`` never raises: every failure becomes a result with a stable
``code`` and a ``reason`` (and usually a ``fix``). Codes:

==========================  =====================================================
ok                          the kernel is built, loaded and passed a smoke copy
disabled                    SGLANG_HICACHE_JIT_DISABLE=1
unsupported_element_size    the row size is not a positive multiple of 4 bytes
no_torch                    PyTorch is not installed
no_cuda_device              no CUDA GPU is visible (or torch is a CPU build)
no_arch                     nothing to build for (only without a GPU)
arch_unsupported            the build or nvcc does not cover this GPU's arch
no_nvcc / no_ninja / no_cxx a build tool is missing
cuda_version_mismatch       nvcc's CUDA major version differs from torch's
not_built                   build=False and the cache has no entry
build_failed                the compile failed (reason names the log)
lock_timeout                another process held the build lock too long
unsafe_cache                a cache path other users can write to (refused)
bad_setting                 an environment variable that cannot be used (named)
cache_unwritable / no_space the cache cannot be written (read-only, full)
kernel_failed               the library loaded but the smoke copy failed
error                       anything unexpected (the reason has the details)
==========================  =====================================================

The answer is cached per process, device and ``build`` flag; the row-size
check is applied on top, so probing many row sizes costs one build. Answers
whose cause may pass (a lock held too long, a full or read-only cache, a
compile that was killed, anything unexpected) are not cached.
"""

from __future__ import annotations

import operator
import threading
from dataclasses import dataclass

from .. import settings
from ..errors import HicacheJitError


@dataclass(frozen=True)
class ProbeResult:
    available: bool
    code: str
    reason: str
    fix: str = ""
    device: int | None = None
    capability: str | None = None
    element_size: int | None = None
    library: str | None = None
    method: str | None = None  # copy method the kernel picks on this GPU for 16-byte rows

    def __bool__(self) -> bool:
        return self.available

    def as_dict(self) -> dict:
        return dict(self.__dict__)


_cache: dict[tuple, ProbeResult] = {}
_TRANSIENT_CODES = {"lock_timeout", "cache_unwritable", "no_space"}
_lock = threading.Lock()


def _result(code: str, reason: str, fix: str = "", **details) -> ProbeResult:
    return ProbeResult(code == "ok", code, reason, fix, **details)


def _element_size_problem(element_size) -> ProbeResult | None:
    """None when ``element_size`` is None or a positive multiple of 4 (any
    integer type: int, numpy or torch integers); a result for anything else
    (floats, strings, lists, bools: never an exception)."""
    if element_size is None:
        return None
    try:
        size = None if isinstance(element_size, bool) else operator.index(element_size)
    except TypeError:
        size = None
    if size is None or size <= 0 or size % 4:
        try:
            shown = repr(element_size)[:80]
        except Exception:  # a hostile __repr__
            shown = f"<{type(element_size).__name__}>"
        return _result("unsupported_element_size",
                       f"a row of {shown} bytes is not supported: rows must be a positive multiple of 4 bytes",
                       "pad the KV row to a multiple of 4 bytes, or use the direct (copy-engine) path",
                       element_size=size)
    return None


def _smoke_test(device: int) -> str:
    """Copies a few random rows device -> pinned host -> device; returns the method used."""
    import torch

    from . import ops

    with torch.cuda.device(device):
        rows, row_elems = 64, 144  # 576-byte rows: not a multiple of 128, like FP8 MLA
        src = torch.randint(-2**31, 2**31 - 1, (rows, row_elems), dtype=torch.int32, device=device)
        host = torch.zeros((rows, row_elems), dtype=torch.int32, pin_memory=True)
        back = torch.zeros_like(src)
        idx = torch.randperm(rows, device=device)[:48]
        ops.transfer_one_layer_mla(host, idx, src, idx)
        method = ops.transfer_one_layer_mla(back, idx, host, idx)
        torch.cuda.synchronize(device)
        ops.check_errors(device, synchronize=False)
        if not torch.equal(back[idx], src[idx]) or back.count_nonzero() > back[idx].count_nonzero():
            raise RuntimeError("the smoke copy returned wrong data")
        return method


def _probe_device(device: int | None, build: bool) -> ProbeResult:
    try:
        import torch
    except ImportError:
        return _result("no_torch", "PyTorch is not installed.", "pip install torch")
    if not torch.cuda.is_available():
        why = "torch is a CPU-only build" if torch.version.cuda is None else "no CUDA GPU is visible"
        return _result("no_cuda_device", f"The one-layer kernel needs a CUDA GPU: {why}.",
                       "run on a machine with an NVIDIA GPU and a CUDA build of torch")
    index = torch.cuda.current_device() if device is None else torch.device("cuda", device).index
    if index is None:
        index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    details = {"device": index, "capability": f"{major}.{minor}"}
    key = (index, build)
    with _lock:
        cached = _cache.get(key)
        if cached is not None:
            return cached
        transient = False
        try:
            from ..buildcache.loader import load_kernels

            library = load_kernels(device=index, build=build)
        except HicacheJitError as exc:
            # A failure whose cause may go away (a lock held, a full disk, a killed compile) is asked again.
            transient = exc.code in _TRANSIENT_CODES or getattr(exc, "transient", False)
            library, result = None, _result(exc.code, exc.reason, exc.fix, **details)
        except Exception as exc:  # the probe must never raise; not the kernel's fault (e.g. an unreadable cache)
            transient = True
            library, result = None, _result("error", f"{type(exc).__name__}: {exc}", "", **details)
        if library is not None and not library.supports((major, minor)):
            result = _result(
                "arch_unsupported",
                f"The library was built for {', '.join(map(str, library.archs))}; cuda:{index} is "
                f"compute capability {major}.{minor}.",
                f"add {major}.{minor} to {settings.ARCH} or unset it", library=str(library.path), **details)
        elif library is not None:
            try:
                method = _smoke_test(index)
                result = _result("ok", f"The one-layer kernel is available on cuda:{index} ({major}.{minor}).",
                                 library=str(library.path), method=method, **details)
            except Exception as exc:  # the probe must never raise
                code = "arch_unsupported" if "no kernel image" in str(exc) else "kernel_failed"
                result = _result(code, f"{type(exc).__name__}: {exc}", "", **details)
        if not transient:
            _cache[key] = result
        return result


def probe(element_size: int | None = None, *, device=None, build: bool = True) -> ProbeResult:
    """Whether the one-layer kernel can copy rows of ``element_size`` bytes on
    ``device`` (default: the current GPU). build=False only inspects the cache."""
    try:
        if settings.disabled():
            return _result("disabled", f"The JIT kernels are disabled by {settings.DISABLE}=1.",
                           f"unset {settings.DISABLE}")
        problem = _element_size_problem(element_size)
        if problem is not None:
            return problem
        result = _probe_device(device, build)
        if element_size is not None:
            result = ProbeResult(**dict(result.as_dict(), element_size=element_size))
        return result
    except Exception as exc:  # the probe must never raise
        return _result("error", f"{type(exc).__name__}: {exc}")


def one_layer_kernel_available(element_size: int | None = None, *, device=None, build: bool = True) -> bool:
    return probe(element_size, device=device, build=build).available


def clear_cache() -> None:
    """Forgets cached answers (after `clean`, or in tests)."""
    with _lock:
        _cache.clear()
