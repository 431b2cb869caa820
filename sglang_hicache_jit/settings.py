"""Every environment variable the package reads, next to its default.

Values are read when asked for, not at import, so a process (or a test) may
change the environment before the first build.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR = "SGLANG_HICACHE_JIT_CACHE_DIR"
ARCH = "SGLANG_HICACHE_JIT_ARCH"
DISABLE = "SGLANG_HICACHE_JIT_DISABLE"
STRICT = "SGLANG_HICACHE_JIT_STRICT"
METHOD = "SGLANG_HICACHE_JIT_METHOD"
LOCK_TIMEOUT = "SGLANG_HICACHE_JIT_LOCK_TIMEOUT"
BUILD_JOBS = "SGLANG_HICACHE_JIT_BUILD_JOBS"
TORCH_ARCH_LIST = "TORCH_CUDA_ARCH_LIST"

_TRUE = {"1", "true", "yes", "on"}


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def cache_root() -> Path:
    """Root of the writable build cache."""
    explicit = os.environ.get(CACHE_DIR, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("sglang-hicache-jit", appauthor=False))


def arch_request() -> tuple[str, str] | None:
    """The arch list named in the environment, with the variable that named it."""
    for name in (ARCH, TORCH_ARCH_LIST):
        value = os.environ.get(name, "").strip()
        if value:
            return value, name
    return None


def disabled() -> bool:
    """SGLANG_HICACHE_JIT_DISABLE=1 turns the JIT kernels off (the probe says 'disabled')."""
    return _flag(DISABLE)


def strict() -> bool:
    """SGLANG_HICACHE_JIT_STRICT=1 checks index ranges on the host before each launch."""
    return _flag(STRICT)


def method() -> str:
    """Copy method for the kernels: auto (default), plain or bulk."""
    value = os.environ.get(METHOD, "auto").strip().lower() or "auto"
    if value not in ("auto", "plain", "bulk"):
        raise ValueError(f"{METHOD} must be one of auto, plain, bulk; got {value!r}")
    return value


def lock_timeout() -> float:
    """Seconds to wait for another process's build before giving up (default 1 hour)."""
    value = os.environ.get(LOCK_TIMEOUT, "").strip()
    if not value:
        return 3600.0
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{LOCK_TIMEOUT} must be a number of seconds; got {value!r}") from None
    if seconds <= 0:
        raise ValueError(f"{LOCK_TIMEOUT} must be positive; got {value!r}")
    return seconds


def build_jobs() -> int | None:
    """Parallel compile jobs (ninja -j); None lets torch decide."""
    value = os.environ.get(BUILD_JOBS, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{BUILD_JOBS} must be a positive integer; got {value!r}")
    return int(value)
