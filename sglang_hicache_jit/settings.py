"""Every environment variable the package reads, next to its default.

Values are read when asked for, not at import, so a process (or a test) may
change the environment before the first build.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CACHE_DIR = "SGLANG_HICACHE_JIT_CACHE_DIR"
ARCH = "SGLANG_HICACHE_JIT_ARCH"
DISABLE = "SGLANG_HICACHE_JIT_DISABLE"
STRICT = "SGLANG_HICACHE_JIT_STRICT"
METHOD = "SGLANG_HICACHE_JIT_METHOD"
LOCK_TIMEOUT = "SGLANG_HICACHE_JIT_LOCK_TIMEOUT"
BUILD_JOBS = "SGLANG_HICACHE_JIT_BUILD_JOBS"
PREBUILT_DIRS = "SGLANG_HICACHE_JIT_PREBUILT_DIRS"
CACHE_MAX_SIZE = "SGLANG_HICACHE_JIT_CACHE_MAX_SIZE"
LOCK_DIR = "SGLANG_HICACHE_JIT_LOCK_DIR"
TORCH_ARCH_LIST = "TORCH_CUDA_ARCH_LIST"
SGLANG_PLUGIN = "SGLANG_HICACHE_JIT_SGLANG_PLUGIN"

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


def sglang_plugin_enabled() -> bool:
    """SGLANG_HICACHE_JIT_SGLANG_PLUGIN=0 leaves SGLang exactly as it is (the plugin patches nothing)."""
    return os.environ.get(SGLANG_PLUGIN, "1").strip().lower() not in {"0", "false", "no", "off"}


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


# A ':'-separated list like PATH, except that a URL keeps its own colons
# ('s3://bucket/x', 'http://host:8080/x'): a scheme, '//', and a port are not separators.
_LIST_ITEM = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/:]*(?::\d+)?[^:]*|[^:]+")


def split_path_list(text: str) -> list[str]:
    return [item.strip() for item in _LIST_ITEM.findall(text) if item.strip()]


def prebuilt_dirs() -> list[str]:
    """Read-only prebuilt layers (directories or fsspec URLs), searched in order before the cache."""
    return split_path_list(os.environ.get(PREBUILT_DIRS, ""))


def lock_dir() -> Path | None:
    """Where build locks live when not inside the cache (a node-local path for a cache on NFS)."""
    value = os.environ.get(LOCK_DIR, "").strip()
    return Path(value).expanduser() if value else None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'500M', '10G', '1.5GiB', '4096' -> bytes (K/M/G/T are powers of 1024, as du and df count)."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a size; write it like 500M, 10G or 1.5T (or a number of bytes)")
    number, unit, _ = match.groups()
    return int(float(number) * 1024 ** " kmgt".index(unit.lower() or " "))


def cache_max_size() -> int | None:
    """Size cap applied to the cache after each build or import; None: no cap."""
    value = os.environ.get(CACHE_MAX_SIZE, "").strip()
    if not value:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{CACHE_MAX_SIZE}: {exc}") from None
