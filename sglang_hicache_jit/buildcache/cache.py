"""The build cache on disk: lookup, verification, atomic publication, failures.

Why one long module: the on-disk format is one contract: the layout's names, manifests, verification
and atomic publication share the naming rules and trust checks, and whoever audits what a load may
trust reads them together (removal is in prune.py).

Layout (``<root>`` is $SGLANG_HICACHE_JIT_CACHE_DIR, else platformdirs'
user cache directory for "sglang-hicache-jit")::

    <root>/v1/                                   cache layout version
        .sglang-hicache-jit                      marker: this package made the directory
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

Only directories carrying the marker, and inside them only names of the forms
above, are ever deleted (prune, clean): a cache root pointed at a directory
that holds someone else's ``v2/`` loses nothing.

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
import shutil
import socket
import stat
import time
from pathlib import Path

from .. import safeio, settings
from . import trust
from ..errors import BadSettingError, UnsafeCacheError, write_error
from .record import record
from .spec import LAYOUT_VERSION, derive_key

MANIFEST = "manifest.json"
BUILD_LOG = "build.log"
LAST_USED = "last_used"
MANIFEST_FORMAT = 1
LAYOUT_MARKER = ".sglang-hicache-jit"
# A manifest or failure record is a few KB; anything much larger is not one.
MAX_RECORD_BYTES = 1 << 20


class _LazyPattern:
    """A regex compiled at its first match, not at import: the warm load never uses the directory-name
    patterns below, and compiling them cost ~0.3 ms of its 5 ms (issue 10)."""

    __slots__ = ("_text", "_compiled")

    def __init__(self, text: str):
        self._text = text
        self._compiled = None

    def match(self, string: str):
        if self._compiled is None:
            self._compiled = re.compile(self._text)
        return self._compiled.match(string)


# The names this package gives to what it creates (see the layout above).
ARCH_TAG = _LazyPattern(r"^sm\d+[af]?(\+ptx)?(-sm\d+[af]?(\+ptx)?)*$")
ENTRY_NAME = _LazyPattern(r"^[a-z0-9_]+-[0-9a-f]{16}$")
class _FileName:
    """``^[A-Za-z0-9_][A-Za-z0-9_.-]*$`` without a regex: manifests name their log, checked on every load,
    and compiling the pattern cost ~0.2 ms of the warm load."""

    _FIRST = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
    _REST = _FIRST | frozenset(".-")

    def match(self, string: str) -> bool:
        return bool(string) and string[0] in self._FIRST and all(c in self._REST for c in string)


FILE_NAME = _FileName()
FAILURE_NAME = _LazyPattern(r"^[a-z0-9_]+-[0-9a-f]{16}\.failed\.(json|log)$")
_HEX = frozenset("0123456789abcdef")


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in _HEX for c in text)
_SERVICE_DIRS = (".locks", ".staging", ".trash")
# The last-use marker is refreshed at most this often: pruning needs the day, not the second.
_TOUCH_INTERVAL = 3600.0

log = logging.getLogger("sglang_hicache_jit")


class CorruptEntry(Exception):
    """An entry exists but fails verification; the message says why."""


class Entry(record("Entry", ["path", "manifest", "prebuilt"], defaults=(False,))):  # see arch.Arch
    """A verified entry: its directory (Path), its manifest (dict) and whether it was found in a
    read-only prebuilt layer (prebuilt, never written to)."""

    __slots__ = ()

    @property
    def library(self) -> Path:
        return self.path / self.manifest["library"]

    @property
    def key(self) -> str:
        return self.manifest["key"]

    @property
    def log(self) -> Path:
        return self.path / self.manifest.get("log", BUILD_LOG)

    @property
    def files(self) -> list[str]:
        """The names of the entry's files that travel with it (library, manifest, log)."""
        return [self.manifest["library"], MANIFEST, self.manifest.get("log", BUILD_LOG)]


def file_sha256(path: Path) -> str:
    """sha256 of a regular file (never a FIFO or a symlink: those raise safeio.NotRegularFile)."""
    digest = hashlib.sha256()
    with os.fdopen(safeio.open_regular(path), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def manifest_problem(manifest) -> str | None:
    """What is wrong with a manifest's fields and types (None: nothing). Every
    field another part of the package reads is checked here, so a manifest
    that passes can be read without further checks (info, prune, export)."""
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return "has an unknown format"
    for name in ("name", "kernel", "key", "abi_key", "toolkit", "library"):
        if not isinstance(manifest.get(name), str):
            return f"has no valid {name!r}"
    components = manifest.get("components")
    if not isinstance(components, dict):
        return "has no valid 'components'"
    archs = components.get("archs")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        return "has no valid 'components.archs'"
    flags = components.get("cuda_flags", [])
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        return "has no valid 'components.cuda_flags'"
    if not _is_int(manifest.get("size")) or manifest["size"] < 0:
        return "has no valid 'size'"
    if not isinstance(manifest.get("sha256"), str) or not _is_sha256(manifest["sha256"]):
        return "has no valid 'sha256'"
    log_name = manifest.get("log", BUILD_LOG)
    # The log is a file of the entry: one plain name, never a path (export packs it).
    if not isinstance(log_name, str) or not FILE_NAME.match(log_name) or log_name in (MANIFEST, manifest["library"]):
        return f"names an invalid log file {log_name!r}"
    for name in ("build_seconds",):
        if name in manifest and manifest[name] is not None and not isinstance(manifest[name], (int, float)):
            return f"has an invalid {name!r}"
    for name in ("built_at", "host", "nvcc", "cxx"):
        if name in manifest and manifest[name] is not None and not isinstance(manifest[name], str):
            return f"has an invalid {name!r}"
    return None


def read_manifest(path: Path) -> dict:
    """The checked manifest of the entry at ``path``; CorruptEntry when missing, unreadable or malformed."""
    try:
        manifest = json.loads(safeio.read_regular(path / MANIFEST, MAX_RECORD_BYTES))
    except FileNotFoundError:
        raise CorruptEntry(f"{path} has no {MANIFEST}") from None
    except (OSError, ValueError) as exc:
        raise CorruptEntry(f"{path / MANIFEST} is unreadable: {exc}") from None
    problem = manifest_problem(manifest)
    if problem:
        raise CorruptEntry(f"{path / MANIFEST} {problem}")
    return manifest


def verify_entry(path: Path, *, key: str | None = None, abi_key: str | None = None, hash_library: bool = True
                 ) -> Entry:
    """Reads and checks an entry; raises CorruptEntry with the reason. hash_library=False leaves out
    the library's sha256, for a caller that checks it on the descriptor it loads (open_verified)."""
    manifest = read_manifest(path)
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
    os.close(_open_library(entry, check_trust=False, hash_library=hash_library))
    return entry


def open_verified(entry: Entry) -> int:
    """Opens the library and checks, on that open file, its owner and mode
    (trust.py), size and sha256; returns the descriptor. Loading through it
    (``/proc/self/fd/N``) loads exactly the checked bytes."""
    return _open_library(entry, check_trust=True)


def _open_library(entry: Entry, *, check_trust: bool, hash_library: bool = True) -> int:
    """The library's descriptor after checking (on it) that it is a regular file
    (not a symlink, even to an identical copy: the loader would refuse it, so
    it must count as corrupt everywhere), its size and sha256."""
    try:
        fd = safeio.open_regular(entry.library)
    except FileNotFoundError:
        raise CorruptEntry(f"{entry.library} is missing") from None
    except OSError as exc:  # a symlink, FIFO or directory where the library should be; or removed meanwhile
        raise CorruptEntry(f"{entry.library} cannot be opened: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if check_trust:
            trust.check_stat(st, entry.library, prebuilt=entry.prebuilt)
        if st.st_size != entry.manifest.get("size"):
            raise CorruptEntry(f"{entry.library} has {st.st_size} bytes, the manifest says {entry.manifest.get('size')}")
        if not hash_library:
            return fd
        digest = hashlib.sha256()
        offset = 0  # pread on the descriptor itself: no duplicate descriptor and file object (warm path)
        while block := os.pread(fd, 1 << 20, offset):
            digest.update(block)
            offset += len(block)
        if digest.hexdigest() != entry.manifest.get("sha256"):
            raise CorruptEntry(f"{entry.library} does not match the sha256 in its manifest")
        return fd
    except BaseException:
        os.close(fd)
        raise


# Patterns compile on first use (re caches them): a compile at import costs 0.1-0.2 ms of every warm load.
_TOOLKIT_VERSION = r"^cuda-(\d+\.\d+)-"


def toolkit_version(identity: str | None) -> str | None:
    """'cuda-13.0-nvcc12345' -> '13.0' (a toolkit identity, see toolchain.Toolkit)."""
    match = re.match(_TOOLKIT_VERSION, identity or "")
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


_SASS_FLAG = r"code=sm_(\d+[af]?)"


def sass_numbers(manifest: dict) -> set[str]:
    """Arch numbers ('90', '90a') the library has machine code for, from the
    nvcc flags recorded in its manifest (PTX-only archs are not included)."""
    components = manifest.get("components")
    flags = components.get("cuda_flags", []) if isinstance(components, dict) else []
    if not isinstance(flags, list):
        return set()
    return {number for flag in flags if isinstance(flag, str) for number in re.findall(_SASS_FLAG, flag)}


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


def _private_dir(path: Path, mode: int = 0o700) -> Path:
    """Creates ``path`` and any missing parent with ``mode`` (Path.mkdir(parents=True)
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
            directory.mkdir(mode=mode)
            if mode & ~0o700:
                os.chmod(directory, mode)  # mkdir applies the umask
        except FileExistsError:
            pass
    return path


def is_marked(layout_dir: Path) -> bool:
    """True when ``layout_dir`` carries the marker this package writes into the
    layout directories it creates (only those are ever deleted or cleaned)."""
    try:
        return stat.S_ISREG(os.lstat(layout_dir / LAYOUT_MARKER).st_mode)
    except OSError:
        return False


def _only_our_names(layout_dir: Path) -> bool:
    """An unmarked layout directory that holds nothing but names this package
    makes (a cache from before the marker existed, or an empty directory)."""
    for child in os.scandir(layout_dir):
        # safeio.is_temp_of: another process's marker before its rename (processes that create one cache at
        # the same moment see each other's)
        if not (child.name in _SERVICE_DIRS or child.name == LAYOUT_MARKER or ARCH_TAG.match(child.name)
                or safeio.is_temp_of(child, LAYOUT_MARKER)):
            return False
    return True


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

    def __init__(self, root: Path, *, prebuilt: bool = False, shared: bool = False, setting: str | None = None):
        self.root = Path(root)
        self.layout_root = self.root / LAYOUT_VERSION
        self.prebuilt = prebuilt
        # shared: a prebuilt layer being written (`import --into`): readable by everyone.
        self.shared = shared
        self.dir_mode = 0o755 if shared else 0o700
        self.setting = setting or settings.CACHE_DIR  # what the user changes to move it (for messages)

    def __repr__(self) -> str:
        return f"BuildCache({str(self.root)!r}{', prebuilt=True' if self.prebuilt else ''})"

    def ensure_root(self) -> None:
        """Creates the root and layout directories (private to the user unless
        shared), marks the layout directory as this package's, and refuses
        (UnsafeCacheError) a root that other users could write to. Nothing is
        created when the root is refused."""
        assert not self.prebuilt, "a prebuilt layer is never written to"
        if self.root.exists():
            if not self.root.is_dir():
                raise BadSettingError(f"{self.setting}={str(self.root)!r} is a file, not a directory.",
                                      f"point {self.setting} at a directory.")
            self.check_safe()
        try:
            if self.layout_root.is_dir() and not is_marked(self.layout_root):
                if not _only_our_names(self.layout_root):
                    raise BadSettingError(
                        f"{self.layout_root} exists but was not made by sglang-hicache-jit (it holds other "
                        "files), so the cache will not write into it or clean it.",
                        f"point {self.setting} at a new or empty directory.")
            _private_dir(self.layout_root, self.dir_mode)
            trust.check_chain(self.root, self.layout_root, prebuilt=False)
            if not is_marked(self.layout_root):
                safeio.write_atomic(self.layout_root / LAYOUT_MARKER,
                                    b"created by sglang-hicache-jit; only marked directories are ever pruned\n",
                                    0o644 if self.shared else 0o600)
        except OSError as exc:
            raise write_error(exc, f"the cache directory {self.root} ({self.setting})") from None

    def check_safe(self) -> None:
        """The trust rule (trust.py) that every reader and writer of this cache applies before it
        looks inside: the root and the layout directory, where they exist, owned by this user (for
        a prebuilt layer: root, this user or a trusted owner) and writable by nobody else.
        UnsafeCacheError otherwise: the loader will not load from such a cache, and clean, prune,
        import and builds will not change it (another user's `clean` emptied a world-writable
        cache that the loader refused)."""
        trust.check_chain(self.root, self.layout_root, prebuilt=self.prebuilt)

    # ---- paths -------------------------------------------------------------
    def arch_dir(self, arch_tag: str) -> Path:
        return self.layout_root / arch_tag

    def entry_path(self, arch_tag: str, kernel: str, key: str) -> Path:
        return self.arch_dir(arch_tag) / f"{kernel}-{key}"

    def lock_dir(self) -> Path:
        return settings.lock_dir() or self.layout_root / ".locks"

    def lock_path(self, arch_tag: str, kernel: str, key: str) -> Path:
        """The entry's lock file, in a directory created private and checked
        with the cache's trust rules: a lock directory that another user owns
        or can write to could hold planted links that redirect our writes."""
        # Lock names carry the full key, so one lock directory may serve several caches.
        directory = self.lock_dir()
        setting = settings.LOCK_DIR if settings.lock_dir() else self.setting
        try:
            _private_dir(directory)
        except OSError as exc:
            raise write_error(exc, f"the lock directory {directory} ({setting})",
                              f"point {settings.LOCK_DIR} at a writable directory of your own (e.g. "
                              "/tmp/hicache-locks-$USER).") from None
        try:
            trust.check_path(directory, prebuilt=False)
        except UnsafeCacheError as exc:
            raise UnsafeCacheError(
                f"The lock directory {exc.reason}",
                f"give each user a lock directory of their own: {settings.LOCK_DIR}=/tmp/hicache-locks-$USER "
                "(created private on first use); or: " + exc.fix) from None
        return directory / f"{arch_tag}-{kernel}-{key}.lock"

    def failure_path(self, arch_tag: str, kernel: str, key: str) -> Path:
        return self.arch_dir(arch_tag) / f"{kernel}-{key}.failed.json"

    # ---- lookup ------------------------------------------------------------
    def lookup(self, arch_tag: str, kernel: str, key: str, *, hash_library: bool = True) -> Entry | None:
        """The verified entry (see verify_entry for hash_library), None when absent; CorruptEntry when
        present but bad."""
        path = self.entry_path(arch_tag, kernel, key)
        if not path.exists():
            return None
        self.check_trust(path)
        try:
            return self._entry(verify_entry(path, key=key, hash_library=hash_library))
        except CorruptEntry:
            if not os.path.lexists(path):  # removed while read (a clean or prune): absent, not corrupt
                return None
            raise

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

    def find(self, arch_tag: str, kernel: str, abi_key: str, key: str | None, local_toolkit: str | None, *,
             hash_library: bool = True) -> Entry | None:
        """The exact key first, then an acceptable entry of the same ABI. A
        corrupt exact entry raises CorruptEntry in the writable cache (the
        caller rebuilds it) and is skipped in a prebuilt layer (it cannot be
        fixed there)."""
        if key is not None:
            try:
                entry = self.lookup(arch_tag, kernel, key, hash_library=hash_library)
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
    def _layout(self) -> None:
        """Whatever writes into the layout directory first makes (and marks) it."""
        if not is_marked(self.layout_root):
            self.ensure_root()

    def new_staging_dir(self, entry_name: str) -> Path:
        self._layout()
        staging = _private_dir(self.layout_root / ".staging")
        name = f"{entry_name}.{socket.gethostname()}.{os.getpid()}.{os.urandom(4).hex()}"
        return _private_dir(staging / name)

    def publish(self, staged_entry: Path, arch_tag: str, kernel: str, key: str) -> Entry:
        """Moves a complete entry into place with one rename. When a complete
        entry of this key is already there (another process, perhaps on another
        machine, published first), that one is kept and returned."""
        assert not self.prebuilt, "a prebuilt layer is never written to"
        entry = verify_entry(staged_entry, key=key)
        if self.shared:  # a layer for everyone: readable by all, writable by none (never modified)
            for name in os.listdir(staged_entry):
                os.chmod(staged_entry / name, 0o444)
            os.chmod(staged_entry, 0o555)
        else:
            os.chmod(staged_entry, 0o700)  # whoever staged it: published entries are private like the rest
        final = self.entry_path(arch_tag, kernel, key)
        for _ in range(5):
            _private_dir(final.parent, self.dir_mode)
            try:
                os.replace(staged_entry, final)  # atomic; refuses to replace a non-empty directory
                return Entry(final, entry.manifest)
            except FileNotFoundError:
                if not staged_entry.exists():
                    raise
                continue  # the arch directory was removed meanwhile (a clean): make it again
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
        trash = _private_dir(self.layout_root / ".trash") / f"{path.name}.{os.urandom(4).hex()}"
        try:
            os.replace(path, trash)
        except FileNotFoundError:
            return  # someone else removed it first
        shutil.rmtree(trash, ignore_errors=True)

    def remove_entry(self, path: Path) -> None:
        """Deletes a published entry (the caller holds its lock)."""
        self._discard(path)

    # ---- failures ----------------------------------------------------------
    def record_failure(self, arch_tag: str, kernel: str, key: str, reason: str, log_text: str, *,
                       cause: str = "compile_error", transient: bool = False) -> Path:
        """Remembers a failed build: why (``cause``: compile_error, killed,
        no_space, vanished) and whether the cause was the environment
        (``transient``: the next call retries instead of failing at once)."""
        path = self.failure_path(arch_tag, kernel, key)
        self._layout()
        _private_dir(path.parent)
        log_path = path.with_suffix("").with_suffix(".failed.log")
        safeio.write_atomic(log_path, log_text.encode(errors="replace"))
        record = {"key": key, "reason": reason, "cause": cause, "transient": transient, "log": log_path.name,
                  "time": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
        safeio.write_atomic(path, (json.dumps(record, indent=2) + "\n").encode())
        return log_path

    def read_failure(self, arch_tag: str, kernel: str, key: str) -> dict | None:
        """The failure record, or None when there is none or it is malformed
        (a record that cannot be read must not block builds; prune removes it). UnsafeCacheError
        for an untrusted cache: a record planted there must not decide anything."""
        self.check_safe()
        path = self.failure_path(arch_tag, kernel, key)
        try:
            record = json.loads(safeio.read_regular(path, MAX_RECORD_BYTES))
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or not isinstance(record.get("reason"), str) \
                or not isinstance(record.get("time", 0), (int, float)) or isinstance(record.get("time"), bool) \
                or not isinstance(record.get("log"), str) or not FILE_NAME.match(record["log"]) \
                or not isinstance(record.get("transient", False), bool):
            log.warning("ignoring a malformed failed-build record %s", path)
            return None
        record["log_path"] = str(path.parent / record["log"])
        return record

    def clear_failure(self, arch_tag: str, kernel: str, key: str) -> None:
        path = self.failure_path(arch_tag, kernel, key)
        for p in (path, path.with_suffix("").with_suffix(".failed.log")):
            p.unlink(missing_ok=True)

    # ---- listing and cleaning ---------------------------------------------
    def entry_dirs(self) -> list[Path]:
        """Every directory named like an entry under an arch directory (verified or not)."""
        if not self.layout_root.is_dir():
            return []
        found = []
        for arch in sorted(self.layout_root.iterdir()):
            if ARCH_TAG.match(arch.name) and arch.is_dir() and not arch.is_symlink():
                found += sorted(p for p in arch.iterdir()
                                if ENTRY_NAME.match(p.name) and p.is_dir() and not p.is_symlink())
        return found

    def entries(self) -> list[tuple[Path, Entry | None, str]]:
        """Every entry directory with its verified Entry, or None and the problem."""
        found = []
        for path in self.entry_dirs():
            try:
                found.append((path, verify_entry(path, key=path.name.rsplit("-", 1)[1]), ""))
            except CorruptEntry as exc:
                found.append((path, None, str(exc)))
        return found

    def failures(self) -> list[Path]:
        if not self.layout_root.is_dir():
            return []
        return sorted(p for p in self.layout_root.glob("*/*.failed.json")
                      if ARCH_TAG.match(p.parent.name) and FAILURE_NAME.match(p.name))
