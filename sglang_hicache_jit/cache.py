"""The build cache on disk: lookup, verification, atomic publication, failures.

Layout (``<root>`` is $SGLANG_HICACHE_JIT_CACHE_DIR, else platformdirs'
user cache directory for "sglang-hicache-jit")::

    <root>/v1/                                   cache layout version
        sm90/                                    one directory per arch set
            hicache_transfer-<key>/              a published entry, never modified
                hicache_transfer_<key>.so        the library (also the op namespace)
                manifest.json                    key, components, sha256, build facts
                build.log                        compiler output
            hicache_transfer-<key>.failed.json   a remembered failed build
            hicache_transfer-<key>.failed.log    ... and its compiler output
        sm80-sm90/...                            a fat build for two archs
        .locks/<arch>-hicache_transfer-<key>.lock (+ .owner: pid and host of the builder)
        .staging/<entry>.<host>.<pid>.<random>/  private build directories

Why a hit can be trusted: the key is a sha256 over everything that changes the
binary (spec.py). An entry directory appears only by ``os.replace`` of a
complete staging directory, which is atomic on POSIX, so readers never see a
half-written entry. Every load still re-reads the manifest and checks the
library's size and sha256 against it, so a truncated or tampered library is
rejected (and rebuilt) instead of being loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from .spec import LAYOUT_VERSION

MANIFEST = "manifest.json"
BUILD_LOG = "build.log"
MANIFEST_FORMAT = 1


class CorruptEntry(Exception):
    """An entry exists but fails verification; the message says why."""


@dataclass(frozen=True)
class Entry:
    path: Path
    manifest: dict

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
    library = manifest.get("library")
    if not isinstance(library, str) or "/" in library or library.startswith("."):
        raise CorruptEntry(f"{path / MANIFEST} names no valid library file")
    entry = Entry(path, manifest)
    try:
        size = entry.library.stat().st_size
    except OSError:
        raise CorruptEntry(f"{entry.library} is missing") from None
    if size != manifest.get("size"):
        raise CorruptEntry(f"{entry.library} has {size} bytes, the manifest says {manifest.get('size')}")
    if file_sha256(entry.library) != manifest.get("sha256"):
        raise CorruptEntry(f"{entry.library} does not match the sha256 in its manifest")
    return entry


def write_manifest(entry_dir: Path, manifest: dict) -> dict:
    """Completes ``manifest`` with the library's size and sha256 and writes it."""
    library = entry_dir / manifest["library"]
    manifest = dict(manifest, format=MANIFEST_FORMAT, size=library.stat().st_size, sha256=file_sha256(library))
    (entry_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


class BuildCache:
    """One writable cache root."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.layout_root = self.root / LAYOUT_VERSION

    # ---- paths -------------------------------------------------------------
    def arch_dir(self, arch_tag: str) -> Path:
        return self.layout_root / arch_tag

    def entry_path(self, arch_tag: str, kernel: str, key: str) -> Path:
        return self.arch_dir(arch_tag) / f"{kernel}-{key}"

    def lock_path(self, arch_tag: str, kernel: str, key: str) -> Path:
        return _private_dir(self.layout_root / ".locks") / f"{arch_tag}-{kernel}-{key}.lock"

    def failure_path(self, arch_tag: str, kernel: str, key: str) -> Path:
        return self.arch_dir(arch_tag) / f"{kernel}-{key}.failed.json"

    # ---- lookup ------------------------------------------------------------
    def lookup(self, arch_tag: str, kernel: str, key: str) -> Entry | None:
        """The verified entry, None when absent; CorruptEntry when present but bad."""
        path = self.entry_path(arch_tag, kernel, key)
        if not path.exists():
            return None
        return verify_entry(path, key=key)

    def find_abi(self, arch_tag: str, kernel: str, abi_key: str) -> Entry | None:
        """Any verified entry built for this ABI by any toolkit (the newest first)."""
        candidates = sorted(self.arch_dir(arch_tag).glob(f"{kernel}-*/{MANIFEST}"),
                            key=lambda p: p.stat().st_mtime, reverse=True)
        for manifest in candidates:
            try:
                return verify_entry(manifest.parent, abi_key=abi_key)
            except CorruptEntry:
                continue
        return None

    # ---- building ----------------------------------------------------------
    def new_staging_dir(self, entry_name: str) -> Path:
        staging = _private_dir(self.layout_root / ".staging")
        name = f"{entry_name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
        return _private_dir(staging / name)

    def publish(self, staged_entry: Path, arch_tag: str, kernel: str, key: str) -> Entry:
        """Moves a complete entry into place with one rename (the caller holds the lock)."""
        entry = verify_entry(staged_entry, key=key)
        final = self.entry_path(arch_tag, kernel, key)
        _private_dir(final.parent)
        if final.exists():  # a corrupt entry: move it aside first, rename cannot replace a full directory
            self._discard(final)
        os.replace(staged_entry, final)
        return Entry(final, entry.manifest)

    def discard_corrupt(self, arch_tag: str, kernel: str, key: str) -> None:
        path = self.entry_path(arch_tag, kernel, key)
        if path.exists():
            self._discard(path)

    def _discard(self, path: Path) -> None:
        trash = _private_dir(self.layout_root / ".trash") / f"{path.name}.{secrets.token_hex(4)}"
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

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
