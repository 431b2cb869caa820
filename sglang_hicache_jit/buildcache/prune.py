"""Keeping the writable cache small: what to remove, and doing it safely.

``prune`` removes, in this order:

1. debris: staging directories whose builder is gone (on this host: its pid is
   dead; from another host: older than a day) and leftovers in ``.trash``;
2. with ``stale``: other cache layout versions, corrupt entries, and entries
   this installation would never load (another package, torch, Python or
   source version, or a toolkit of another CUDA minor: cache.acceptable);
3. with ``failures``: failed-build records (the next use retries the build);
4. with ``older_than_days``: entries not loaded for that long;
5. with ``max_size``: least recently used entries until the rest fits.

It never removes an entry whose lock another process holds (a build of that
entry): it takes the lock without waiting and skips the entry when that
fails, and holds it while deleting, so a builder that comes next waits and
then builds a fresh entry. Loading processes are unaffected: an entry goes by
one rename out of sight (readers see all of it or none), and a loader reads
and maps the library through a descriptor it opened before (loader.py).

Only what this package provably created is ever deleted: layout directories
carrying its marker (cache.LAYOUT_MARKER), and inside them only names of the
forms it gives (arch tags, entry names, failure records, its own staging and
trash directories). A cache root pointed at a directory with someone else's
``v2/`` keeps it. And only in a cache the loader would trust (BuildCache.check_safe):
a cache owned by another user, or one that other users can write to, raises
``unsafe_cache`` and loses nothing.

``clean`` (the ``clean`` command) removes every entry, failure record and
leftover the same way, with the same locks: it skips entries being built and
staging directories whose builder or importer is still running.

"Last used" is the mtime of the entry's ``last_used`` marker, refreshed at
most hourly on load (cache.touch_used), else the manifest's (the build).
Prebuilt layers are never pruned.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import filelock

from .. import settings
from .cache import ARCH_TAG, BuildCache, CorruptEntry, acceptable, entry_size, is_marked, last_used, verify_entry
from ..errors import BadSettingError, write_error
from .spec import KERNEL, LAYOUT_VERSION

log = logging.getLogger("sglang_hicache_jit")

_DAY = 86400.0
_MAX_PID = (1 << 31) - 1  # pid_t is a signed 32-bit int


@dataclass
class PruneReport:
    removed: list[tuple[Path, str, int]] = field(default_factory=list)  # path, why, bytes
    skipped_locked: list[Path] = field(default_factory=list)
    total_before: int = 0  # bytes of entries in the current layout
    total_after: int = 0

    @property
    def freed(self) -> int:
        return sum(size for _, _, size in self.removed)


def _try_lock(path: Path) -> filelock.FileLock | None:
    """The lock, taken without waiting; None when another process holds it."""
    lock = filelock.FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        return None
    except OSError as exc:  # a read-only or full lock directory
        raise write_error(exc, f"the lock {path}") from None
    return lock


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _staging_owner(name: str) -> tuple[str, str, int] | None:
    """'<entry>.<host>.<pid>.<random>' -> (entry, host, pid); hosts may contain dots."""
    parts = name.split(".")
    # The settings' whole-number reader: '²' passes str.isdigit and then fails int().
    pid = settings.whole_number(parts[-2], 1, _MAX_PID) if len(parts) >= 4 else None
    if pid is None:
        return None  # not a name this package gives
    return parts[0], ".".join(parts[1:-2]), pid


def _entry_locks(cache: BuildCache, entry_name: str) -> list[Path]:
    directory = cache.lock_dir()
    return sorted(directory.glob(f"*-{entry_name}.lock")) if directory.is_dir() else []


def _remove_tree(path: Path) -> bool:
    """Deletes ``path`` (a directory or a file); True when it is gone. Errors
    other than 'already gone' raise CacheWriteError: a removal that did not
    happen is never reported as made."""
    errors: list[OSError] = []

    def note(function, failed_path, exc_info):
        exc = exc_info[1]
        if not isinstance(exc, FileNotFoundError):
            errors.append(exc)

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, onerror=note)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            errors.append(exc)
    if errors:
        raise write_error(errors[0], f"{path} (in the cache)") from None
    return not os.path.lexists(path)


def kill_stale_build(staging: Path) -> None:
    """Kills what is left of a dead builder's compile (ninja, nvcc, cicc): every
    process whose working directory is inside ``staging``. The directory's
    name is unique (host, pid and a random part) and only that build's
    processes work in it, so nothing unrelated is touched. Linux only (/proc);
    processes of other users are not visible and are left alone."""
    root = os.path.realpath(staging)
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            if cwd == root or cwd.startswith(root + "/"):
                os.kill(pid, signal.SIGKILL)
        except OSError:
            continue


def _staging_gone(owner: tuple[str, str, int] | None, age: float, host: str, max_age: float) -> bool:
    """Whether a staging directory's builder is gone: on this host its pid is
    dead; on another host (or unknown) it is older than ``max_age``."""
    if owner is None:
        return False  # not a name this package gives: not ours to remove
    _, owner_host, pid = owner
    return (owner_host == host and not _pid_alive(pid)) or age > max_age


def reap_stale_staging(cache: BuildCache, entry_name: str) -> None:
    """Called by a builder that holds ``entry_name``'s lock: removes the staging
    directories of earlier builders of that entry on this host that died
    (SIGKILL, OOM), after killing any compiler they left running."""
    staging = cache.layout_root / ".staging"
    host = socket.gethostname()
    try:
        candidates = sorted(staging.glob(f"{entry_name}.*"))
    except OSError:
        return
    for path in candidates:
        owner = _staging_owner(path.name)
        if owner is None or owner[0] != entry_name or owner[1] != host or owner[2] == os.getpid() \
                or _pid_alive(owner[2]):
            continue
        kill_stale_build(path)
        try:
            _remove_tree(path)
            log.info("removed %s, left by a builder that died", path)
        except Exception as exc:  # housekeeping: never stops the build
            log.warning("could not remove %s: %s", path, exc)


def _prune_debris(cache: BuildCache, report: PruneReport, now: float, max_age: float = _DAY) -> None:
    staging = cache.layout_root / ".staging"
    host = socket.gethostname()
    for path in sorted(staging.iterdir()) if staging.is_dir() else []:
        owner = _staging_owner(path.name)
        try:
            age = now - path.lstat().st_mtime
        except OSError:
            continue
        if not _staging_gone(owner, age, host, max_age):
            continue
        kill_stale_build(path)
        # A builder in another PID namespace (a container with the same host name) still holds the entry lock.
        _remove_unless_locked(path, _entry_locks(cache, owner[0]),
                              "staging directory of a builder that is gone", report, record_locked=False)
    trash = cache.layout_root / ".trash"
    for path in sorted(trash.iterdir()) if trash.is_dir() else []:
        size = _tree_size(path)
        if _remove_tree(path):  # another process may be deleting it too: harmless
            report.removed.append((path, "an entry left half-deleted", size))


def _remove_unless_locked(path: Path, lock_paths: list[Path], reason: str, report: "PruneReport", *,
                          record_locked: bool) -> None:
    """Removes ``path`` while holding every lock in ``lock_paths``; skips it if any is held elsewhere."""
    locks = []
    try:
        for p in lock_paths:
            locks.append(_try_lock(p))
        if any(lock is None for lock in locks):
            if record_locked:
                report.skipped_locked.append(path)
            return
        size = _tree_size(path)
        if _remove_tree(path):
            report.removed.append((path, reason, size))
    finally:
        for lock in locks:
            if lock is not None:
                lock.release()


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _prune_other_layouts(cache: BuildCache, report: PruneReport) -> None:
    if not cache.root.is_dir():
        return
    for path in sorted(cache.root.iterdir()):
        # Only layout directories this package made (marked); an unrelated v2/ or v10/ is not ours.
        if path.name == LAYOUT_VERSION or not path.is_dir() or path.is_symlink() or not is_marked(path):
            continue
        # An older version may be building there right now.
        _remove_unless_locked(path, sorted((path / ".locks").glob("*.lock")), "cache of another layout version",
                              report, record_locked=True)


def _remove_failures(cache: BuildCache, report: PruneReport) -> None:
    for record in cache.failures():
        log_file = record.with_suffix("").with_suffix(".failed.log")
        size = sum(p.lstat().st_size for p in (record, log_file) if os.path.lexists(p))
        removed = False
        for p in (record, log_file):
            if os.path.lexists(p):
                removed |= _remove_tree(p)
        if removed:
            report.removed.append((record, "failed-build record", size))


class _Usability:
    """Whether this installation could ever load an entry (for stale pruning)."""

    def __init__(self):
        from .toolchain import find_toolkit

        toolkit = find_toolkit()
        self.toolkit = toolkit.identity if toolkit else None
        self.abi_keys: dict[tuple, str | None] = {}

    def __call__(self, manifest: dict) -> bool:
        from .arch import parse_arch_list
        from .spec import BuildSpec

        if manifest.get("kernel") != KERNEL:
            return False
        archs = tuple(manifest["components"]["archs"])  # a list of str: cache.manifest_problem checked it
        if archs not in self.abi_keys:
            try:
                self.abi_keys[archs] = BuildSpec.for_archs(parse_arch_list(";".join(archs))).abi_key
            except (ValueError, OSError):
                self.abi_keys[archs] = None
        abi_key = self.abi_keys[archs]
        return abi_key is not None and acceptable(manifest, abi_key, self.toolkit)


def _check_days(older_than_days) -> None:
    if older_than_days is None:
        return
    if isinstance(older_than_days, bool) or not isinstance(older_than_days, (int, float)) \
            or not math.isfinite(older_than_days) or older_than_days <= 0:
        raise BadSettingError(f"--older-than {older_than_days!r} cannot be used: it must be a finite number of "
                              "days above 0.", "write e.g. --older-than 30 (days since an entry was last loaded).")


def _owned(cache: BuildCache) -> bool:
    """Whether the cache's layout directory is this package's (marked); logs why not."""
    if not cache.layout_root.is_dir():
        return False
    if not is_marked(cache.layout_root):
        log.warning("%s was not made by sglang-hicache-jit (no %s marker): nothing is removed there",
                    cache.layout_root, ".sglang-hicache-jit")
        return False
    return True


def prune(cache: BuildCache, *, max_size: int | None = None, older_than_days: float | None = None,
          stale: bool = True, failures: bool = True, keep: tuple[Path, ...] = (), now: float | None = None
          ) -> PruneReport:
    """Removes what the module docstring lists; returns what was removed and what was skipped."""
    assert not cache.prebuilt, "a prebuilt layer is never pruned"
    _check_days(older_than_days)
    cache.check_safe()  # the loader's trust rule: an untrusted cache is refused, never cleaned up
    now = time.time() if now is None else now
    report = PruneReport()
    if stale:
        _prune_other_layouts(cache, report)
    if not _owned(cache):
        return report
    _prune_debris(cache, report, now)
    if failures:
        _remove_failures(cache, report)

    usable = _Usability() if stale else None
    keep = {Path(p) for p in keep}
    candidates = []  # (last used, path, size, why-if-stale)
    for path in cache.entry_dirs():
        size = entry_size(path)
        why = None
        if usable is not None:
            try:
                manifest = verify_entry(path, key=path.name.rsplit("-", 1)[-1]).manifest
                if not usable(manifest):
                    why = "built for another package, torch, Python, source or CUDA version"
            except CorruptEntry as exc:
                why = f"corrupt ({exc})"
        candidates.append((last_used(path), path, size, why))
    report.total_before = total = sum(size for _, _, size, _ in candidates)

    def remove(path: Path, size: int, why: str) -> bool:
        nonlocal total
        if path in keep:
            return False
        if _remove_entry(cache, path, report, recheck_corrupt=why.startswith("corrupt")):
            report.removed.append((path, why, size))
            total -= size
            return True
        return False

    remaining = []
    for used, path, size, why in candidates:
        if why is not None and remove(path, size, why):
            continue
        if older_than_days is not None and used < now - older_than_days * _DAY \
                and remove(path, size, f"not used for {older_than_days:g} days"):
            continue
        remaining.append((used, path, size))
    if max_size is not None:
        for used, path, size in sorted(remaining, key=lambda c: c[0]):  # least recently used first
            if total <= max_size:
                break
            remove(path, size, f"least recently used, over the size cap of {max_size} bytes")
    report.total_after = total
    return report


def _remove_entry(cache: BuildCache, path: Path, report: PruneReport, *, recheck_corrupt: bool = False) -> bool:
    """Removes one published entry under its lock; False when locked, gone, or (with
    recheck_corrupt) rebuilt meanwhile."""
    kernel, key = path.name.rsplit("-", 1)
    lock = _try_lock(cache.lock_path(path.parent.name, kernel, key))
    if lock is None:
        report.skipped_locked.append(path)
        return False
    try:
        if not path.exists():
            return False  # someone else removed it
        if recheck_corrupt:
            try:  # it may have been rebuilt since it was looked at: check again under the lock
                verify_entry(path, key=key)
                return False
            except CorruptEntry:
                pass
        try:
            cache.remove_entry(path)
        except OSError as exc:
            raise write_error(exc, f"{path} (in the cache)") from None
        return not path.exists()
    finally:
        lock.release()


def clean(cache: BuildCache, *, failed_only: bool = False) -> PruneReport:
    """Removes every failure record, and unless ``failed_only`` every entry and
    leftover (staging, trash), the way prune does: under the entries' locks,
    skipping an entry being built and the staging directory of a live builder
    or importer. Only in a layout directory this package made."""
    assert not cache.prebuilt, "a prebuilt layer is never cleaned"
    cache.check_safe()  # another user's world-writable (or foreign) cache: refused, as the loader refuses it
    report = PruneReport()
    if not _owned(cache):
        return report
    _remove_failures(cache, report)
    if failed_only:
        return report
    for path in cache.entry_dirs():
        size = entry_size(path)
        if _remove_entry(cache, path, report):
            report.removed.append((path, "removed by clean", size))
    _prune_debris(cache, report, time.time(), max_age=math.inf)
    for arch in sorted(cache.layout_root.iterdir()):  # empty arch directories
        if ARCH_TAG.match(arch.name) and arch.is_dir() and not arch.is_symlink():
            try:
                arch.rmdir()
            except OSError:
                pass  # not empty (an entry kept, or one published meanwhile)
    return report


def apply_size_cap(cache: BuildCache, keep: tuple[Path, ...] = ()) -> PruneReport | None:
    """SGLANG_HICACHE_JIT_CACHE_MAX_SIZE, applied after a build or import publishes
    (never on the warm path). Housekeeping: a problem is logged, never raised."""
    try:
        limit = settings.cache_max_size()
        if limit is None:
            return None
        report = prune(cache, max_size=limit, keep=keep, stale=False, failures=False)
    except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: HicacheJitError (read-only cache ...)
        log.warning("could not apply %s: %s", settings.CACHE_MAX_SIZE, exc)
        return None
    if report.removed:
        log.info("%s: removed %d cache entries (%d bytes)", settings.CACHE_MAX_SIZE, len(report.removed),
                 report.freed)
    return report
