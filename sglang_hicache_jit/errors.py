"""Errors of the JIT loader: a stable code, a sentence for a person, and the fix.

The codes are the probe's codes too (see probe.py), so a failure reads the same
whether it is raised by ``load_kernels`` or reported by ``probe``.
"""

from __future__ import annotations


class HicacheJitError(RuntimeError):
    """Base class. ``code`` is stable and machine-readable; ``fix`` says what to do."""

    code = "error"

    def __init__(self, reason: str, fix: str = "", *, code: str | None = None, log_path: str | None = None):
        self.reason = reason
        self.fix = fix
        self.log_path = log_path
        if code is not None:
            self.code = code
        message = reason if not fix else f"{reason} Fix: {fix}"
        super().__init__(message)


class DisabledError(HicacheJitError):
    code = "disabled"


class NoArchError(HicacheJitError):
    """No GPU to build for and no arch named."""

    code = "no_arch"


class ArchUnsupportedError(HicacheJitError):
    """The GPU's arch is not in the build, or nvcc cannot target the arch."""

    code = "arch_unsupported"


class ToolchainError(HicacheJitError):
    """nvcc, ninja or the host compiler is missing or does not match torch.

    Codes: ``no_nvcc``, ``no_ninja``, ``cuda_version_mismatch``, ``no_torch``.
    """

    code = "toolchain"


class BuildFailedError(HicacheJitError):
    """The compile failed; ``log_path`` holds the compiler output.

    ``transient`` is True when the cause was the environment (the compiler was
    killed, the disk was full, the staging directory vanished), not the
    sources: such a failure is not remembered as final, the next call retries.
    """

    code = "build_failed"

    def __init__(self, reason: str, fix: str = "", *, transient: bool = False, cause: str = "compile_error",
                 **kwargs):
        super().__init__(reason, fix, **kwargs)
        self.transient = transient
        self.cause = cause  # compile_error, killed, no_space or vanished (recorded in the failure memo)


class NotBuiltError(HicacheJitError):
    """The entry is not in the cache and building was not allowed."""

    code = "not_built"


class LockTimeoutError(HicacheJitError):
    """Another process held the build lock for longer than the timeout."""

    code = "lock_timeout"


class UnsafeCacheError(HicacheJitError):
    """A cache path that other users could write to, or that another user owns."""

    code = "unsafe_cache"


class BadSettingError(HicacheJitError, ValueError):
    """An environment variable or command-line value that cannot be used; the
    reason names it. Also a ValueError, which is what callers caught before."""

    code = "bad_setting"


class CacheWriteError(HicacheJitError):
    """The cache (or an ``--into`` directory) cannot be written: read-only,
    no permission, or full. Codes: ``cache_unwritable``, ``no_space``."""

    code = "cache_unwritable"


def write_error(exc: OSError, what: str, fix: str = "") -> CacheWriteError:
    """A CacheWriteError for an OSError met while writing ``what`` (a path or a description)."""
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CacheWriteError(f"{what}: no space left ({exc.strerror}).",
                               fix or "free some space (`sglang-hicache-jit prune`), or move the cache "
                               "(SGLANG_HICACHE_JIT_CACHE_DIR).", code="no_space")
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) not in what else ""
    return CacheWriteError(f"{what} cannot be written: {exc.strerror or exc}{where}.",
                           fix or "point SGLANG_HICACHE_JIT_CACHE_DIR at a writable directory of your own, or fix "
                           "the permissions.", code="cache_unwritable")


class BundleError(HicacheJitError):
    """A bundle that cannot be imported; nothing was changed.

    Codes: ``bundle_unsafe`` (a member that could write outside the cache: an
    absolute path, '..', a link or a device), ``bundle_corrupt`` (a checksum,
    manifest or key that does not hold), ``bundle_mismatch`` (built for another
    torch, CUDA, Python or package version), ``bundle_unreadable``.
    """

    code = "bundle_corrupt"


class RemoteError(HicacheJitError):
    """An fsspec URL that cannot be used. Codes: ``no_fsspec``, ``remote_failed``."""

    code = "remote_failed"


class TransferIndexError(IndexError):
    """A kernel met an index past the end of its pool and skipped that row."""
