"""The build cache on disk: lookup, verification, atomic publication, failures.

Layout (``<root>`` is $SGLANG_HICACHE_JIT_CACHE_DIR, else platformdirs'
user cache directory for "sglang-hicache-jit")::

    <root>/v1/                                   cache layout version
        sm90/                                    one directory per arch set
            hicache_transfer-<key>/              a published entry, never modified
                hicache_transfer_<key>.so        the library (also the op namespace)
                manifest.json                    key, components, sha256, build facts
                build.log                        compiler output
                last_used                        empty; its mtime is the last load (LRU)
            hicache_transfer-<key>.failed.json   a remembered failed build
            hicache_transfer-<key>.failed.log    ... and its compiler output
        sm80-sm90/...                            a fat build for two archs
        .locks/<arch>-hicache_transfer-<key>.lock (+ .owner: pid and host of the builder;
                                                   in $SGLANG_HICACHE_JIT_LOCK_DIR when set)
        .staging/<entry>.<host>.<pid>.<random>/  private build (and import) directories
        .trash/                                  entries being deleted

Why a hit can be trusted: the key is a sha256 over everything that changes the
binary (spec.py). An entry directory appears only by ``os.replace`` of a
complete staging directory, which is atomic on POSIX, so readers never see a
half-written entry. Every load still re-reads the manifest and checks the
library's size and sha256 against it, so a truncated or tampered library is
rejected (and rebuilt) instead of being loaded. The loader hashes the library
from the same open file it then loads (``open_verified``), so the bytes loaded
are the bytes checked, even if the entry is removed or replaced meanwhile.

Layers: the writable cache is one ``BuildCache``; a read-only prebuilt layer
(SGLANG_HICACHE_JIT_PREBUILT_DIRS) is a ``BuildCache(..., prebuilt=True)``
with the same layout, which is only ever read. Both are searched with
``find``: the exact key first, then an entry of the same ABI built by another
toolkit when ``acceptable`` allows it (see there). Trust rules for loading
(owner and write bits) are in trust.py.

Other processes: a writer never changes a published entry; it only adds one
(rename) or removes one (rename into ``.trash``, then delete). Removal (prune)
takes the entry's lock first, so it never races a build of that entry. Two
publishers of one key (machines sharing the cache without sharing locks) are
safe: the first complete entry wins and the second is dropped.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from . import settings, trust
from .spec import LAYOUT_VERSION, derive_key

MANIFEST = "manifest.json"
BUILD_LOG = "build.log"
LAST_USED = "last_used"
MANIFEST_FORMAT = 1
# The last-use marker is refreshed at most this often: pruning needs the day, not the second.
_TOUCH_INTERVAL = 3600.0

log = logging.getLogger("sglang_hicache_jit")


class CorruptEntry(Exception):
    """An entry exists but fails verification; the message says why."""


@dataclass(frozen=True)
class Entry:
    path: Path
    manifest: dict
    prebuilt: bool = False  # found in a read-only prebuilt layer (never written to)

    @property
    def library(self) -> Path:
        return self.path / self.manifest["library"]

    @property
    def key(self) -> str:
        return self.manifest["key"]

    @property
    def log(self) -> Path:
        return self.path / self.manifest.get("log", BUILD_LOG)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_entry(path: Path, *, key: str | None = None, abi_key: str | None = None) -> Entry:
    """Reads and checks an entry; raises CorruptEntry with the reason."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CorruptEntry(f"{path} has no {MANIFEST}") from None
    except (OSError, ValueError) as exc:
        raise CorruptEntry(f"{path / MANIFEST} is unreadable: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CorruptEntry(f"{path / MANIFEST} has an unknown format")
    if key is not None and manifest.get("key") != key:
        raise CorruptEntry(f"{path} holds key {manifest.get('key')!r}, expected {key!r}")
    if abi_key is not None and manifest.get("abi_key") != abi_key:
        raise CorruptEntry(f"{path} holds ABI key {manifest.get('abi_key')!r}, expected {abi_key!r}")
    # The names must follow from the contents: the key from the ABI key and the
    # toolkit, the library and op namespace from the key. An entry renamed or
    # edited by hand (or a tampered bundle) fails here.
    entry_key, name = manifest.get("key"), manifest.get("name")
    if not isinstance(manifest.get("abi_key"), str) or not isinstance(manifest.get("toolkit"), str) \
            or entry_key != derive_key(manifest["abi_key"], manifest["toolkit"]):
        raise CorruptEntry(f"{path / MANIFEST}: its key {entry_key!r} does not follow from its ABI key and toolkit")
    if name != f"{manifest.get('kernel')}_{entry_key}":
        raise CorruptEntry(f"{path / MANIFEST}: the library name {name!r} does not match its key")
    library = manifest.get("library")
    if library != f"{name}.so":
        raise CorruptEntry(f"{path / MANIFEST} names no valid library file")
    entry = Entry(path, manifest)
    try:
        size = entry.library.stat().st_size
    except OSError:
        raise CorruptEntry(f"{entry.library} is missing") from None
    if size != manifest.get("size"):
        raise CorruptEntry(f"{entry.library} has {size} bytes, the manifest says {manifest.get('size')}")
    try:
        digest = file_sha256(entry.library)
    except OSError as exc:  # removed meanwhile (a prune): as good as corrupt for this reader
        raise CorruptEntry(f"{entry.library} vanished while it was checked ({exc.strerror})") from None
    if digest != manifest.get("sha256"):
        raise CorruptEntry(f"{entry.library} does not match the sha256 in its manifest")
    return entry


def open_verified(entry: Entry) -> int:
    """Opens the library and checks, on that open file, its owner and mode
    (trust.py), size and sha256; returns the descriptor. Loading through it
    (``/proc/self/fd/N``) loads exactly the checked bytes."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(entry.library, flags)
    except FileNotFoundError:
        raise CorruptEntry(f"{entry.library} is missing") from None
    except OSError as exc:  # ELOOP: a symlink where the library should be
        raise CorruptEntry(f"{entry.library} cannot be opened: {exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptEntry(f"{entry.library} is not a regular file")
        trust.check_stat(st, entry.library, prebuilt=entry.prebuilt)
        if st.st_size != entry.manifest.get("size"):
            raise CorruptEntry(f"{entry.library} has {st.st_size} bytes, the manifest says {entry.manifest.get('size')}")
        digest = hashlib.sha256()
        with os.fdopen(os.dup(fd), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != entry.manifest.get("sha256"):
            raise CorruptEntry(f"{entry.library} does not match the sha256 in its manifest")
        return fd
    except BaseException:
        os.close(fd)
        raise


_TOOLKIT_VERSION = re.compile(r"^cuda-(\d+\.\d+)-")


def toolkit_version(identity: str | None) -> str | None:
    """'cuda-13.0-nvcc12345' -> '13.0' (a toolkit identity, see toolchain.Toolkit)."""
    match = _TOOLKIT_VERSION.match(identity or "")
    return match.group(1) if match else None


def acceptable(manifest: dict, abi_key: str, local_toolkit: str | None) -> bool:
    """Whether an entry built elsewhere may be loaded here. The rule:

    * the ABI must match exactly (``abi_key``: sources, flags, archs, torch and
      its CUDA, Python, machine, package version): never negotiable;
    * with a CUDA toolkit here, the entry's toolkit must be the same CUDA
      major.minor as the local one (``local_toolkit`` is its identity); patch
      releases may differ, because they emit the same machine code for the same
      arch and the runtime is torch's either way. Another minor is rebuilt;
    * without a toolkit any entry of this ABI is taken: the builder already
      checked that its nvcc had torch's CUDA major version.
    """
    if manifest.get("abi_key") != abi_key:
        return False
    if local_toolkit is None:
        return True
    return toolkit_version(manifest.get("toolkit")) == toolkit_version(local_toolkit)


_SASS_FLAG = re.compile(r"code=sm_(\d+[af]?)")


def sass_numbers(manifest: dict) -> set[str]:
    """Arch numbers ('90', '90a') the library has machine code for, from the
    nvcc flags recorded in its manifest (PTX-only archs are not included)."""
    flags = manifest.get("components", {}).get("cuda_flags", [])
    return {number for flag in flags for number in _SASS_FLAG.findall(flag)}


def touch_used(entry: Entry) -> None:
    """Records a load for LRU pruning: at most one write per entry per hour,
    none in a prebuilt layer. Failures are ignored (a read-only filesystem
    only makes pruning fall back to the build time)."""
    if entry.prebuilt:
        return
    marker = entry.path / LAST_USED
    now = time.time()
    try:
        if now - os.stat(marker).st_mtime < _TOUCH_INTERVAL:
            return
        os.utime(marker, (now, now))
    except FileNotFoundError:
        try:
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600))
        except OSError:
            pass
    except OSError:
        pass


def write_manifest(entry_dir: Path, manifest: dict) -> dict:
    """Completes ``manifest`` with the library's size and sha256 and writes it."""
    library = entry_dir / manifest["library"]
    manifest = dict(manifest, format=MANIFEST_FORMAT, size=library.stat().st_size, sha256=file_sha256(library))
    (entry_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _private_dir(path: Path) -> Path:
    """Creates ``path`` and any missing parent with mode 0700 (Path.mkdir(parents=True)
    would create the parents with the umask's mode, usually 0755)."""
    if path.is_dir():
        return path
    missing = []
    current = path
    while not current.exists() and current != current.parent:
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            pass
    return path


def entry_size(path: Path) -> int:
    """Bytes of the files in an entry directory (entries are flat)."""
    total = 0
    try:
        for child in os.scandir(path):
            try:
                total += child.stat(follow_symlinks=False).st_size
            except OSError:
                pass
    except OSError:
        pass
    return total


def last_used(path: Path) -> float:
    """When an entry was last loaded (or published, if never loaded since)."""
    times = []
    for name in (LAST_USED, MANIFEST):
        try:
            times.append(os.stat(path / name).st_mtime)
        except OSError:
            pass
    return max(times, default=0.0)


class BuildCache:
    """One cache root: the writable cache, or a read-only prebuilt layer (prebuilt=True)."""

    def __init__(self, root: Path, *, prebuilt: bool = False):
        self.root = Path(root)
        self.layout_root = self.root / LAYOUT_VERSION
        self.prebuilt = prebuilt

    def __repr__(self) -> str:
        return f"BuildCache({str(self.root)!r}{', prebuilt=True' if self.prebuilt else ''})"

    def ensure_root(self) -> None:
        """Creates the root and layout directories private to the user, and
        refuses (UnsafeCacheError) a root that other users could write to."""
        assert not self.prebuilt, "a prebuilt layer is never written to"
        _private_dir(self.layout_root)
        trust.check_chain(self.root, self.layout_root, prebuilt=False)

    # ---- paths -------------------------------------------------------------
    def arch_dir(self, arch_tag: str) -> Path:
        return self.layout_root / arch_tag

    def entry_path(self, arch_tag: str, kernel: str, key: str) -> Path:
        return self.arch_dir(arch_tag) / f"{kernel}-{key}"

    def lock_path(self, arch_tag: str, kernel: str, key: str) -> Path:
        # Lock names carry the full key, so one lock directory may serve several caches.
        directory = settings.lock_dir() or self.layout_root / ".locks"
        return _private_dir(directory) / f"{arch_tag}-{kernel}-{key}.lock"

    def failure_path(self, arch_tag: str, kernel: str, key: str) -> Path:
        return self.arch_dir(arch_tag) / f"{kernel}-{key}.failed.json"

    # ---- lookup ------------------------------------------------------------
    def lookup(self, arch_tag: str, kernel: str, key: str) -> Entry | None:
        """The verified entry, None when absent; CorruptEntry when present but bad."""
        path = self.entry_path(arch_tag, kernel, key)
        if not path.exists():
            return None
        self.check_trust(path)
        return self._entry(verify_entry(path, key=key))

    def find_abi(self, arch_tag: str, kernel: str, abi_key: str, local_toolkit: str | None = None
                 ) -> Entry | None:
        """The newest verified entry of this ABI that ``acceptable`` allows here."""
        candidates = []
        for manifest_path in self.arch_dir(arch_tag).glob(f"{kernel}-*/{MANIFEST}"):
            try:
                candidates.append((manifest_path.stat().st_mtime, manifest_path.parent))
            except OSError:  # removed meanwhile
                continue
        for _, path in sorted(candidates, reverse=True):
            try:
                entry = verify_entry(path, key=path.name[len(kernel) + 1:])
            except CorruptEntry:
                continue
            if acceptable(entry.manifest, abi_key, local_toolkit):
                self.check_trust(path)
                return self._entry(entry)
        return None

    def find(self, arch_tag: str, kernel: str, abi_key: str, key: str | None, local_toolkit: str | None
             ) -> Entry | None:
        """The exact key first, then an acceptable entry of the same ABI. A
        corrupt exact entry raises CorruptEntry in the writable cache (the
        caller rebuilds it) and is skipped in a prebuilt layer (it cannot be
        fixed there)."""
        if key is not None:
            try:
                entry = self.lookup(arch_tag, kernel, key)
                if entry is not None and entry.manifest.get("abi_key") == abi_key:
                    return entry
            except CorruptEntry as exc:
                if not self.prebuilt:
                    raise
                log.warning("skipping a corrupt entry in the prebuilt layer %s: %s", self.root, exc)
        return self.find_abi(arch_tag, kernel, abi_key, local_toolkit)

    def check_trust(self, path: Path) -> None:
        """UnsafeCacheError unless the root, every directory down to ``path`` and its manifest are safe."""
        trust.check_chain(self.root, path, prebuilt=self.prebuilt)
        trust.check_path(path / MANIFEST, prebuilt=self.prebuilt)

    def _entry(self, entry: Entry) -> Entry:
        return Entry(entry.path, entry.manifest, self.prebuilt)

    # ---- building ----------------------------------------------------------
    def new_staging_dir(self, entry_name: str) -> Path:
        staging = _private_dir(self.layout_root / ".staging")
        name = f"{entry_name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
        return _private_dir(staging / name)

    def publish(self, staged_entry: Path, arch_tag: str, kernel: str, key: str) -> Entry:
        """Moves a complete entry into place with one rename. When a complete
        entry of this key is already there (another process, perhaps on another
        machine, published first), that one is kept and returned."""
        assert not self.prebuilt, "a prebuilt layer is never written to"
        entry = verify_entry(staged_entry, key=key)
        os.chmod(staged_entry, 0o700)  # whoever staged it: published entries are private like the rest
        final = self.entry_path(arch_tag, kernel, key)
        _private_dir(final.parent)
        for _ in range(3):
            try:
                os.replace(staged_entry, final)  # atomic; refuses to replace a non-empty directory
                return Entry(final, entry.manifest)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
            try:
                return verify_entry(final, key=key)
            except CorruptEntry:
                self._discard(final)  # a corrupt entry: move it aside, then try again
        raise OSError(f"could not publish {final}: it keeps reappearing in a corrupt state")

    def discard_corrupt(self, arch_tag: str, kernel: str, key: str) -> None:
        path = self.entry_path(arch_tag, kernel, key)
        if path.exists():
            self._discard(path)

    def _discard(self, path: Path) -> None:
        """Removes an entry: one rename out of sight (readers see all or nothing), then delete."""
        assert not self.prebuilt, "a prebuilt layer is never written to"
        trash = _private_dir(self.layout_root / ".trash") / f"{path.name}.{secrets.token_hex(4)}"
        try:
            os.replace(path, trash)
        except FileNotFoundError:
            return  # someone else removed it first
        shutil.rmtree(trash, ignore_errors=True)

    def remove_entry(self, path: Path) -> None:
        """Deletes a published entry (the caller holds its lock)."""
        self._discard(path)

    # ---- failures ----------------------------------------------------------
    def record_failure(self, arch_tag: str, kernel: str, key: str, reason: str, log_text: str) -> Path:
        path = self.failure_path(arch_tag, kernel, key)
        _private_dir(path.parent)
        log_path = path.with_suffix("").with_suffix(".failed.log")
        log_path.write_text(log_text)
        record = {"key": key, "reason": reason, "log": log_path.name, "time": time.time(),
                  "host": socket.gethostname(), "pid": os.getpid()}
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
        return log_path

    def read_failure(self, arch_tag: str, kernel: str, key: str) -> dict | None:
        path = self.failure_path(arch_tag, kernel, key)
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        record["log_path"] = str(path.parent / record.get("log", ""))
        return record

    def clear_failure(self, arch_tag: str, kernel: str, key: str) -> None:
        path = self.failure_path(arch_tag, kernel, key)
        for p in (path, path.with_suffix("").with_suffix(".failed.log")):
            p.unlink(missing_ok=True)

    # ---- listing and cleaning ---------------------------------------------
    def entries(self) -> list[tuple[Path, Entry | None, str]]:
        """Every entry directory with its verified Entry, or None and the problem."""
        found = []
        if not self.layout_root.is_dir():
            return found
        for arch in sorted(p for p in self.layout_root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            for path in sorted(p for p in arch.iterdir() if p.is_dir()):
                try:
                    found.append((path, verify_entry(path), ""))
                except CorruptEntry as exc:
                    found.append((path, None, str(exc)))
        return found

    def failures(self) -> list[Path]:
        if not self.layout_root.is_dir():
            return []
        return sorted(self.layout_root.glob("*/*.failed.json"))

    def clean(self, *, failed_only: bool = False) -> list[Path]:
        """Removes failure records (and with failed_only=False every entry and
        staging directory). Returns what was removed."""
        removed = []
        for record in self.failures():
            for p in (record, record.with_suffix("").with_suffix(".failed.log")):
                if p.exists():
                    p.unlink()
                    removed.append(p)
        if failed_only or not self.layout_root.is_dir():
            return removed
        for child in sorted(self.layout_root.iterdir()):
            if child.name == ".locks":
                continue  # a live builder may hold one; lock files are empty and harmless
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
            removed.append(child)
        return removed
