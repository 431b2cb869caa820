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

"Last used" is the mtime of the entry's ``last_used`` marker, refreshed at
most hourly on load (cache.touch_used), else the manifest's (the build).
Prebuilt layers are never pruned.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import filelock

from . import settings
from .cache import BuildCache, CorruptEntry, acceptable, entry_size, last_used, verify_entry
from .spec import KERNEL, LAYOUT_VERSION

log = logging.getLogger("sglang_hicache_jit")

_DAY = 86400.0
_LAYOUT_DIR = re.compile(r"^v\d+$")


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
    lock = filelock.FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        return None
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
    if len(parts) < 4 or not parts[-2].isdigit():
        return None
    return parts[0], ".".join(parts[1:-2]), int(parts[-2])


def _entry_locks(cache: BuildCache, entry_name: str) -> list[Path]:
    directory = settings.lock_dir() or cache.layout_root / ".locks"
    return sorted(directory.glob(f"*-{entry_name}.lock")) if directory.is_dir() else []


def _prune_debris(cache: BuildCache, report: PruneReport, now: float) -> None:
    staging = cache.layout_root / ".staging"
    host = socket.gethostname()
    for path in sorted(staging.iterdir()) if staging.is_dir() else []:
        owner = _staging_owner(path.name)
        try:
            age = now - path.stat().st_mtime
        except OSError:
            continue
        if owner is None:
            gone = age > _DAY
        else:
            entry_name, owner_host, pid = owner
            gone = (owner_host == host and not _pid_alive(pid)) or age > _DAY
        if not gone:
            continue
        # A builder in another PID namespace (a container with the same host name) still holds the entry lock.
        _remove_unless_locked(path, _entry_locks(cache, owner[0]) if owner else [],
                              "staging directory of a builder that is gone", report, record_locked=False)
    trash = cache.layout_root / ".trash"
    for path in sorted(trash.iterdir()) if trash.is_dir() else []:
        size = _tree_size(path)
        shutil.rmtree(path, ignore_errors=True)  # another process may be deleting it too: harmless
        report.removed.append((path, "an entry left half-deleted", size))


def _remove_unless_locked(path: Path, lock_paths: list[Path], reason: str, report: "PruneReport", *,
                          record_locked: bool) -> None:
    """Removes ``path`` while holding every lock in ``lock_paths``; skips it if any is held elsewhere."""
    locks = [_try_lock(p) for p in lock_paths]
    try:
        if any(lock is None for lock in locks):
            if record_locked:
                report.skipped_locked.append(path)
            return
        size = _tree_size(path)
        shutil.rmtree(path, ignore_errors=True)
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
        if not path.is_dir() or path.name == LAYOUT_VERSION or not _LAYOUT_DIR.match(path.name):
            continue
        # An older version may be building there right now.
        _remove_unless_locked(path, sorted((path / ".locks").glob("*.lock")), "cache of another layout version",
                              report, record_locked=True)


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
        archs = tuple(manifest.get("components", {}).get("archs", []))
        if archs not in self.abi_keys:
            try:
                self.abi_keys[archs] = BuildSpec.for_archs(parse_arch_list(";".join(archs))).abi_key
            except (ValueError, OSError):
                self.abi_keys[archs] = None
        abi_key = self.abi_keys[archs]
        return abi_key is not None and acceptable(manifest, abi_key, self.toolkit)


def prune(cache: BuildCache, *, max_size: int | None = None, older_than_days: float | None = None,
          stale: bool = True, failures: bool = True, keep: tuple[Path, ...] = (), now: float | None = None
          ) -> PruneReport:
    """Removes what the module docstring lists; returns what was removed and what was skipped."""
    assert not cache.prebuilt, "a prebuilt layer is never pruned"
    now = time.time() if now is None else now
    report = PruneReport()
    if not cache.layout_root.is_dir():
        return report
    _prune_debris(cache, report, now)
    if stale:
        _prune_other_layouts(cache, report)
    if failures:
        for record in cache.failures():
            log_file = record.with_suffix("").with_suffix(".failed.log")
            size = sum(p.stat().st_size for p in (record, log_file) if p.exists())
            for p in (record, log_file):
                p.unlink(missing_ok=True)
            report.removed.append((record, "failed-build record", size))

    usable = _Usability() if stale else None
    keep = {Path(p) for p in keep}
    candidates = []  # (last used, path, size, why-if-stale)
    for arch in sorted(p for p in cache.layout_root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for path in sorted(p for p in arch.iterdir() if p.is_dir()):
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
        kernel, key = path.name.rsplit("-", 1)
        lock = _try_lock(cache.lock_path(path.parent.name, kernel, key))
        if lock is None:
            report.skipped_locked.append(path)
            return False
        try:
            if not path.exists():
                return False  # someone else removed it
            if why.startswith("corrupt"):
                try:  # it may have been rebuilt since it was looked at: check again under the lock
                    verify_entry(path, key=key)
                    return False
                except CorruptEntry:
                    pass
            cache.remove_entry(path)
        finally:
            lock.release()
        report.removed.append((path, why, size))
        total -= size
        return True

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


def apply_size_cap(cache: BuildCache, keep: tuple[Path, ...] = ()) -> PruneReport | None:
    """SGLANG_HICACHE_JIT_CACHE_MAX_SIZE, applied after a build or import publishes
    (never on the warm path). Housekeeping: a problem is logged, never raised."""
    try:
        limit = settings.cache_max_size()
        if limit is None:
            return None
        report = prune(cache, max_size=limit, keep=keep, stale=False, failures=False)
    except (OSError, ValueError) as exc:
        log.warning("could not apply %s: %s", settings.CACHE_MAX_SIZE, exc)
        return None
    if report.removed:
        log.info("%s: removed %d cache entries (%d bytes)", settings.CACHE_MAX_SIZE, len(report.removed),
                 report.freed)
    return report
