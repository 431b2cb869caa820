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
    """The compile failed; ``log_path`` holds the compiler output."""

    code = "build_failed"


class NotBuiltError(HicacheJitError):
    """The entry is not in the cache and building was not allowed."""

    code = "not_built"


class LockTimeoutError(HicacheJitError):
    """Another process held the build lock for longer than the timeout."""

    code = "lock_timeout"


class UnsafeCacheError(HicacheJitError):
    """A cache path that other users could write to, or that another user owns."""

    code = "unsafe_cache"


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
