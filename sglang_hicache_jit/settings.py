"""Every environment variable the package reads, next to its default.

Values are read when asked for, not at import, so a process (or a test) may
change the environment before the first build.
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

from .errors import BadSettingError

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
TRUSTED_OWNERS = "SGLANG_HICACHE_JIT_TRUSTED_OWNERS"
TORCH_ARCH_LIST = "TORCH_CUDA_ARCH_LIST"
SGLANG_PLUGIN = "SGLANG_HICACHE_JIT_SGLANG_PLUGIN"
RESIDENT_BLOCKS = "SGLANG_HICACHE_JIT_RESIDENT_BLOCKS"
RESIDENT_IDLE_US = "SGLANG_HICACHE_JIT_RESIDENT_IDLE_US"
LINEINFO = "SGLANG_HICACHE_JIT_LINEINFO"
STAGING = "SGLANG_HICACHE_JIT_STAGING"
# Retired: read by no code path. The driver's cuMemcpyBatchAsync it turned on returned wrong rows without an
# error and crashed the GPU (Xid 11/32) on driver 580.159.04 (docs/troubleshooting.md); info and doctor say
# so when it is still set.
DRIVER_BATCH = "SGLANG_HICACHE_JIT_DRIVER_BATCH"
RETIRED = {DRIVER_BATCH: "the driver's batch call it turned on returned wrong rows (docs/troubleshooting.md); "
                         "the package never calls it"}
# SGLang's own setting (read by sgl-kernel 0.4.7+), which the routed MLA per-layer ops honour the same way.
SGLANG_BLOCK_QUOTA = "SGLANG_HICACHE_BLOCK_QUOTA"

METHODS = ("auto", "plain", "bulk", "resident", "resident-bulk", "resident-plain")

_TRUE = {"1", "true", "yes", "on"}


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def shown(value) -> str:
    """``value`` as a message shows it: its repr, shortened when long (a message is one line for a
    person, not a copy of 5000 digits)."""
    if isinstance(value, str) and len(value) > 80:
        return f"{value[:40]!r}... ({len(value)} characters)"
    return repr(value)


def bad(name: str, value: str, expected: str, fix: str = "") -> BadSettingError:
    """The error for a setting (an environment variable or an option) that cannot be used."""
    return BadSettingError(f"{name}={shown(value)} cannot be used: {expected}.", fix or f"correct or unset {name}.")


def user_path(name: str, text: str) -> Path:
    """``text`` (named by the setting or option ``name``) as a Path with ``~`` and ``~user`` expanded.
    A ``~user`` that is not a user here (or ``~`` without a home) is a bad setting, not pathlib's
    RuntimeError, which every command used to end in."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        user = text.split("/", 1)[0]
        raise bad(name, text, f"{user} names no user with a home directory here",
                  f"write the full path in {name}.") from None


# Kernel pseudo-filesystems: nothing can be created there, and a cache there makes no sense.
_PSEUDO_ROOTS = ("/proc", "/sys", "/dev")


def check_directory(name: str, path: Path) -> Path:
    """``path`` (named by the setting ``name``) must be a directory or creatable as one:
    not a file, not below a file, not in /proc, /sys or /dev."""
    resolved = os.path.realpath(path)
    if any(resolved == r or resolved.startswith(r + "/") for r in _PSEUDO_ROOTS):
        raise bad(name, str(path), "it lies in a kernel pseudo-filesystem (/proc, /sys or /dev)",
                  f"point {name} at a directory on a real disk (e.g. under $HOME or /tmp).")
    current = Path(resolved)
    while not current.exists() and current != current.parent:
        current = current.parent
    if not current.is_dir():
        raise bad(name, str(path), f"{current} is a file, not a directory",
                  f"point {name} at a directory (or at a path that does not exist yet).")
    return path


def cache_root() -> Path:
    """Root of the writable build cache."""
    explicit = os.environ.get(CACHE_DIR, "").strip()
    if explicit:
        return check_directory(CACHE_DIR, user_path(CACHE_DIR, explicit))
    if sys.platform.startswith("linux"):
        # platformdirs' rule for Linux, without importing it: the import alone costs ~2.7 ms, more
        # than half of the 5 ms a whole warm load may take (issue 10).
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = xdg if os.path.isabs(xdg) else os.path.expanduser("~/.cache")
        return Path(base) / "sglang-hicache-jit"
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


_FALSE = {"0", "false", "no", "off"}


def _switch(name: str, fix: str, *, default: bool = True) -> bool:
    """A switch: unset is ``default``; 1, true, yes or on is on; 0, false, no or off is off; anything else
    raises BadSettingError ('disable' or '2' must not leave a switch as it was without a word)."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise bad(name, os.environ[name], "it must be 1 (on) or 0 (off); true/false, yes/no and on/off also work", fix)


def sglang_plugin_enabled() -> bool:
    """SGLANG_HICACHE_JIT_SGLANG_PLUGIN=0 leaves SGLang exactly as it is (the plugin patches nothing).
    Anything but on or off raises BadSettingError. The plugin's register() turns that into "plugin not
    active" with the reason at WARNING (it never stops SGLang); info and doctor show the setting as
    invalid."""
    return _switch(SGLANG_PLUGIN, f"set {SGLANG_PLUGIN}=0 to leave SGLang unchanged, or unset it.")


def sglang_block_quota() -> int | None:
    """SGLANG_HICACHE_BLOCK_QUOTA: CTAs for SGLang's MLA per-layer transfers when the caller passes no
    block_quota, as sgl-kernel 0.4.7+ reads it; None (unset): this package's measured default."""
    return _whole_number(SGLANG_BLOCK_QUOTA, None, 1, 1 << 16)


def lineinfo() -> bool:
    """SGLANG_HICACHE_JIT_LINEINFO=1 builds with nvcc -lineinfo (profilers map machine code to source lines);
    the machine code is the same, the library three times larger, and it is a separate cache entry."""
    return _flag(LINEINFO)


def strict() -> bool:
    """SGLANG_HICACHE_JIT_STRICT=1 checks index ranges on the host before each launch."""
    return _flag(STRICT)


def method() -> str:
    """Copy method for the kernels: auto (default), plain, bulk, or resident (resident-bulk,
    resident-plain name the copy loop inside the resident kernel)."""
    value = os.environ.get(METHOD, "auto").strip().lower() or "auto"
    if value not in METHODS:
        raise bad(METHOD, value, f"it must be one of {', '.join(METHODS)}")
    return value


def whole_number(text: str, low: int, high: int) -> int | None:
    """``text`` as a whole number from ``low`` to ``high``, else None. The one reader of every integer
    setting (and of cuda.h's version): plain ASCII digits only (no sign, '_', space, or another
    script's digits such as '²', which str.isdigit accepts and int() refuses), and the length is
    checked before int(), so 5000 digits are out of range rather than Python's int-string limit
    (a ValueError from inside int())."""
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(high)):
        return None
    number = int(digits)
    return number if low <= number <= high else None


def whole_number_option(text: str) -> int:
    """argparse's ``type=`` for an option's whole number: ASCII digits 0-9 as whole_number reads them (int()
    takes other scripts' digits: '--device ٣' was device 3)."""
    number = whole_number(text.strip(), 0, 1 << 62)
    if number is None:
        import argparse

        raise argparse.ArgumentTypeError(f"{shown(text)} is not a whole number written with the digits 0-9")
    return number


def decimal_option(text: str) -> float:
    """argparse's ``type=`` for an option's decimal number: ASCII digits 0-9, a sign allowed (float() takes
    other scripts' digits and '1_0'); nan, inf and signs are left to the option's own check, which says
    what it expects."""
    plain = text.strip()
    if re.match(_DECIMAL, plain.lstrip("+-")) is None and plain.lower().lstrip("+-") not in ("nan", "inf", "infinity"):
        import argparse

        raise argparse.ArgumentTypeError(f"{shown(text)} is not a number written with the digits 0-9")
    return float(plain)


def _whole_number(name: str, default, low: int, high: int):
    """The whole number in the variable ``name`` (see whole_number), or ``default`` when it is unset."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    number = whole_number(value, low, high)
    if number is None:
        raise bad(name, value, f"it must be a whole number from {low} to {high}")
    return number


def resident_blocks() -> int:
    """CTAs the resident method keeps on the GPU (SMs taken from other work while it runs)."""
    return _whole_number(RESIDENT_BLOCKS, 4, 1, 1024)


def resident_idle_us() -> int:
    """Microseconds without a transfer after which the resident kernel exits (and gives its SMs back)."""
    return _whole_number(RESIDENT_IDLE_US, 2000, 0, 60_000_000)


# What a page_first pool's device staging area may take (both of its buffers). Beside compute each chunk's
# gather waits for SMs, so chunks must be long: 128 MiB kept 0.56-0.70 of the link beside a matmul, 512 MiB
# 0.80-0.81 (transfer/staging.py).
DEFAULT_STAGING_BYTES = 512 << 20


def staging_bytes() -> int:
    """GPU memory a page_first or page_first_direct host pool may use to stage backups (0: no staging, one copy
    per row or per page and layer instead)."""
    return _size(STAGING, DEFAULT_STAGING_BYTES, f"correct or unset {STAGING} (0 turns staging off).")


# A plain decimal number in ASCII: float() alone also takes other scripts' digits ('٣' is 3.0,
# '５' is 5.0), '_' between digits, 'inf' and 'nan', none of which a person means by a number of seconds.
_DECIMAL = r"(?a)^[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?$|^\.[0-9]+(?:[eE][+-]?[0-9]+)?$"


def positive_number(name: str, value: str) -> float:
    """A finite number above zero, written with ASCII digits (nan, inf, 0 and negatives are refused:
    each one would mean 'wait forever' or 'never', never what was meant)."""
    text = value.strip() if isinstance(value, str) else ""
    if re.match(_DECIMAL, text) is None:
        raise bad(name, value, "it must be a finite number above 0, written with the digits 0-9 (e.g. 120 or 0.5)")
    number = float(text)
    if not math.isfinite(number) or number <= 0:
        raise bad(name, value, "it must be a finite number above 0")
    return number


def lock_timeout() -> float:
    """Seconds to wait for another process's build before giving up (default 1 hour)."""
    value = os.environ.get(LOCK_TIMEOUT, "").strip()
    if not value:
        return 3600.0
    return positive_number(LOCK_TIMEOUT, value)


MAX_BUILD_JOBS = 1024


def build_jobs() -> int | None:
    """Parallel compile jobs (ninja -j); None lets torch decide."""
    return _whole_number(BUILD_JOBS, None, 1, MAX_BUILD_JOBS)


# A ':'-separated list like PATH, except that a URL keeps its own colons
# ('s3://bucket/x', 'http://host:8080/x'): a scheme, '//', and a port are not separators.
# Patterns in this module are compiled on first use (re caches them), not at import: each compile
# costs 0.1-0.2 ms of the warm load, which reads this module but usually no list or size.
_LIST_ITEM = r"[A-Za-z][A-Za-z0-9+.-]*://[^/:]*(?::[0-9]+)?[^:]*|[^:]+"


def split_path_list(text: str) -> list[str]:
    if not text.strip():
        return []
    return [item.strip() for item in re.findall(_LIST_ITEM, text) if item.strip()]


def prebuilt_dirs() -> list[str]:
    """Read-only prebuilt layers (directories, '~' expanded, or fsspec URLs), searched in order before the cache."""
    return [str(user_path(PREBUILT_DIRS, item)) if item.startswith("~") else item
            for item in split_path_list(os.environ.get(PREBUILT_DIRS, ""))]


def lock_dir() -> Path | None:
    """Where build locks live when not inside the cache (a node-local path for a cache on NFS)."""
    value = os.environ.get(LOCK_DIR, "").strip()
    return check_directory(LOCK_DIR, user_path(LOCK_DIR, value)) if value else None


# uid_t is 32 bits; (uid_t) -1 means "no user".
MAX_UID = (1 << 32) - 2


def trusted_owners() -> frozenset[int]:
    """Uids besides root and this user whose prebuilt layers may be loaded
    (SGLANG_HICACHE_JIT_TRUSTED_OWNERS: user names or uids, ',' or ':' or space separated)."""
    value = os.environ.get(TRUSTED_OWNERS, "").strip()
    uids = set()
    for item in re.split(r"[,:\s]+", value):
        if not item:
            continue
        if item.isascii() and item.isdigit():
            uid = whole_number(item, 0, MAX_UID)
            if uid is None:
                raise bad(TRUSTED_OWNERS, value, f"a uid must be a whole number from 0 to {MAX_UID}",
                          f"name existing users or uids in {TRUSTED_OWNERS}.")
            uids.add(uid)
            continue
        try:
            import pwd

            uids.add(pwd.getpwnam(item).pw_uid)
        except (ImportError, KeyError, ValueError):  # ValueError: a name pwd cannot even look up
            shown = repr(item) if len(item) <= 40 else f"{item[:20]!r}..."
            raise bad(TRUSTED_OWNERS, value, f"there is no user {shown}",
                      f"name existing users or uids in {TRUSTED_OWNERS}.") from None
    return frozenset(uids)


# ASCII only ((?a), [0-9]): \d would take other scripts' digits, so that 'STAGING=٣' read as 3 bytes
# and '５１２M' as 512 MiB (Decimal() reads them too).
_SIZE = r"(?ai)^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?b?)\s*$"
# 1 EiB: more than any disk, and far inside a C int64 (os, shutil and struct use those).
MAX_SIZE = 1 << 60


def parse_size(text: str) -> int:
    """'500M', '10G', '1.5GiB', '4096' -> bytes (K/M/G/T are powers of 1024, as du and df count).
    Digits are ASCII 0-9 only."""
    match = re.match(_SIZE, str(text))
    if not match:
        raise ValueError(f"{shown(text)} is not a size; write it like 500M, 10G or 1.5T (or a number of bytes), "
                         "with the digits 0-9")
    number, unit, _ = match.groups()
    # Decimal, not float: a number of 400 digits must be refused, not become inf (OverflowError).
    from decimal import Decimal  # here, not at import: decimal costs ~1.3 ms of every warm load

    size = int(Decimal(number) * 1024 ** " kmgt".index(unit.lower() or " "))
    if size > MAX_SIZE:
        raise ValueError(f"{shown(text)} is larger than 1 EiB; write a size like 500M, 10G or 1.5T")
    return size


def _size(name: str, default, fix: str):
    """The size in the variable ``name`` (see parse_size), or ``default`` when it is unset."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return parse_size(value)
    except ValueError as exc:
        raise BadSettingError(f"{name}: {exc}.", fix) from None


def cache_max_size() -> int | None:
    """Size cap applied to the cache after each build or import; None: no cap."""
    return _size(CACHE_MAX_SIZE, None, f"correct or unset {CACHE_MAX_SIZE}.")


def _raw(name: str) -> str | None:
    return os.environ.get(name, "").strip() or None


# Every variable above with its effective value and what its default means, for `sglang-hicache-jit info`.
# CUDA_HOME, CUDA_PATH and CXX choose build tools and are read (and reported) by toolchain.py.
_DESCRIBED = (
    (CACHE_DIR, lambda: str(cache_root()), "platformdirs' user cache directory"),
    (ARCH, lambda: _raw(ARCH), f"unset: {TORCH_ARCH_LIST}, else the current GPU"),
    (TORCH_ARCH_LIST, lambda: _raw(TORCH_ARCH_LIST), "unset: the current GPU"),
    (DISABLE, disabled, "off"),
    (STRICT, strict, "off"),
    (LINEINFO, lineinfo, "off"),
    (METHOD, method, "auto"),
    (RESIDENT_BLOCKS, resident_blocks, "4 CTAs"),
    (RESIDENT_IDLE_US, resident_idle_us, "2000 us"),
    (STAGING, staging_bytes, "512 MiB per page_first pool on the GPU"),
    (LOCK_TIMEOUT, lock_timeout, "3600 s"),
    (BUILD_JOBS, build_jobs, "ninja's choice (CPUs + 2)"),
    (PREBUILT_DIRS, prebuilt_dirs, "no prebuilt layers"),
    (CACHE_MAX_SIZE, cache_max_size, "no size cap"),
    (LOCK_DIR, lambda: str(lock_dir()) if lock_dir() else None, "<cache>/v1/.locks"),
    (TRUSTED_OWNERS, lambda: sorted(trusted_owners()), "root and this user only"),
    (SGLANG_PLUGIN, sglang_plugin_enabled, "on"),
    (SGLANG_BLOCK_QUOTA, sglang_block_quota, "the measured default CTAs"),
)


def effective() -> list[dict]:
    """Each setting: ``variable``, effective ``value``, ``source`` ('env' when the variable is set,
    else 'default'), what the ``default`` is, and ``error`` for a value that does not parse."""
    described = []
    for name, read, default in _DESCRIBED:
        record = {"variable": name, "value": None, "source": "env" if _raw(name) else "default",
                  "default": default, "error": None}
        try:
            record["value"] = read()
        except ValueError as exc:  # BadSettingError is one too
            record["error"] = str(exc)
        described.append(record)
    for name, why in RETIRED.items():  # listed only while still set: it has no effect, say so
        if _raw(name):
            described.append({"variable": name, "value": None, "source": "env", "default": "retired",
                              "error": None, "retired": f"retired, has no effect: {why}"})
    return described


def retired_in_use() -> list[str]:
    """One line per retired variable that is still set (doctor shows them; they change nothing)."""
    return [f"{name} is set but retired and has no effect ({why}); unset it"
            for name, why in RETIRED.items() if _raw(name)]
