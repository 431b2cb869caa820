"""Bundles: verified cache entries in one .tar.gz, to build once and ship.

A bundle is a gzip'd tar with sorted members, zero times and owners (the same
entries give the same bytes)::

    bundle.json                                   format, package, and every entry's files with sha256
    v1/<arch tag>/<kernel>-<key>/manifest.json    exactly the cache layout: an unpacked bundle is a
    v1/<arch tag>/<kernel>-<key>/<name>.so        prebuilt layer
    v1/<arch tag>/<kernel>-<key>/build.log

Import is all-or-nothing for verification: every member is checked before
anything is written (only regular files and directories at the expected
places: no absolute path, '..', link or device; bounded sizes), the files are
unpacked into a private staging directory, and every entry is verified
(bundle.json checksums, manifest, size, sha256, key derivation) and checked
against this machine's ABI (torch, its CUDA, Python, package and sources).
Only then is each entry published with one rename, exactly as a build
publishes it; an entry already in the cache is kept. Any problem raises
BundleError and leaves the target as it was.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import re
import shutil
import socket
import tarfile
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__, remote, settings
from .cache import BuildCache, CorruptEntry, Entry, acceptable, file_sha256, toolkit_version, verify_entry
from .errors import BundleError
from .spec import KERNEL, LAYOUT_VERSION

log = logging.getLogger("sglang_hicache_jit")

BUNDLE_INDEX = "bundle.json"
BUNDLE_FORMAT = 1
# Far above a real bundle (~0.5 MB per arch), far below what would fill a disk.
MAX_FILE_BYTES = 256 << 20
MAX_TOTAL_BYTES = 2 << 30

_ARCH_TAG = re.compile(r"^sm\d+[af]?(\+ptx)?(-sm\d+[af]?(\+ptx)?)*$")
_ENTRY_NAME = re.compile(r"^[a-z0-9_]+-[0-9a-f]{16}$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


@dataclass
class BundleReport:
    path: str
    entries: list[dict] = field(default_factory=list)  # arch, key, path, action
    notes: list[str] = field(default_factory=list)


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- export ------------------------------------------------------------------

def export_bundle(targets: list[tuple], output: str) -> BundleReport:
    """Packs the entries for each arch tuple in ``targets`` (building missing
    ones first) into ``output``, a path or an fsspec URL."""
    from .loader import ensure_built

    entries: list[Entry] = []
    for archs in targets:
        entries.append(ensure_built(archs, retry_failed=True).entry)
    report = BundleReport(output)
    index = {"format": BUNDLE_FORMAT, "package": __version__, "layout": LAYOUT_VERSION,
             "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": socket.gethostname(),
             "entries": []}
    files: list[tuple[str, bytes]] = []
    for entry in entries:
        prefix = f"{LAYOUT_VERSION}/{entry.path.parent.name}/{entry.path.name}"
        names = [entry.manifest["library"], "manifest.json", entry.manifest.get("log", "build.log")]
        record = {"path": prefix, "archs": entry.manifest["components"]["archs"], "key": entry.key,
                  "abi_key": entry.manifest["abi_key"], "toolkit": entry.manifest["toolkit"], "files": {}}
        for name in names:
            data = (entry.path / name).read_bytes() if (entry.path / name).exists() else b""
            record["files"][name] = _sha256_bytes(data)
            files.append((f"{prefix}/{name}", data))
        index["entries"].append(record)
        report.entries.append({"arch": ";".join(record["archs"]), "key": entry.key, "path": prefix,
                               "action": "exported"})
    verify_entries_against_files(entries, files)
    files.append((BUNDLE_INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()))
    _write_tar(sorted(files), output)
    return report


def verify_entries_against_files(entries: list[Entry], files: list[tuple[str, bytes]]) -> None:
    """The library bytes about to be packed still match their manifests (no race with a prune or rebuild)."""
    data = dict(files)
    for entry in entries:
        prefix = f"{LAYOUT_VERSION}/{entry.path.parent.name}/{entry.path.name}"
        if _sha256_bytes(data[f"{prefix}/{entry.manifest['library']}"]) != entry.manifest["sha256"]:
            raise BundleError(f"{entry.library} changed while it was being packed.", "run export again.")


def _write_tar(files: list[tuple[str, bytes]], output: str) -> None:
    buffer = io.BytesIO()
    # mtime=0 in the gzip header and the tar headers: the same entries give the same bundle.
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, compresslevel=6) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            directories = sorted({str(Path(name).parents[i]) for name, _ in files
                                  for i in range(len(Path(name).parents) - 1)})
            for directory in directories:
                info = tarfile.TarInfo(directory)
                info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
                tar.addfile(info)
            for name, data in files:
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                tar.addfile(info, io.BytesIO(data))
    payload = buffer.getvalue()
    if remote.is_url(output):
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "bundle.tar.gz"
            local.write_bytes(payload)
            remote.upload(local, output)
        return
    target = Path(output).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_bytes(payload)
    os.replace(tmp, target)  # readers of the output never see half a bundle


# ---- import ------------------------------------------------------------------

def _unsafe(member: str, why: str) -> BundleError:
    return BundleError(f"The bundle is unsafe: member {member!r} {why}; nothing was imported.",
                       "use a bundle made by `sglang-hicache-jit export`, and find out who changed this one.",
                       code="bundle_unsafe")


def _corrupt(why: str) -> BundleError:
    return BundleError(f"The bundle is corrupt: {why}; nothing was imported.",
                       "export the bundle again, or download it again (compare its sha256 with the source's).",
                       code="bundle_corrupt")


def check_members(members: list[tarfile.TarInfo]) -> list[tarfile.TarInfo]:
    """Returns the file members when every member is safe and in place; else BundleError."""
    seen, files, total = set(), [], 0
    for member in members:
        name = member.name
        parts = name.split("/")
        if name.startswith("/") or "\\" in name or re.match(r"^[A-Za-z]:", name):
            raise _unsafe(name, "has an absolute path")
        if any(part in ("..", ".", "") for part in parts):
            raise _unsafe(name, "has a '..', '.' or empty path component")
        if member.issym() or member.islnk():
            raise _unsafe(name, f"is a link (to {member.linkname!r})")
        if not (member.isreg() or member.isdir()):
            raise _unsafe(name, "is a device, FIFO or other special file")
        if name in seen:
            raise _unsafe(name, "appears twice")
        seen.add(name)
        if parts[0] != LAYOUT_VERSION and name != BUNDLE_INDEX:
            if re.match(r"^v\d+$", parts[0]):
                raise BundleError(f"The bundle holds cache layout {parts[0]}; this version reads {LAYOUT_VERSION}.",
                                  f"export the bundle with sglang-hicache-jit {__version__}.", code="bundle_mismatch")
            raise _unsafe(name, f"is outside {LAYOUT_VERSION}/")
        expected_dir = member.isdir() and len(parts) <= 3
        expected_file = member.isreg() and (name == BUNDLE_INDEX or len(parts) == 4)
        if not (expected_dir or expected_file):
            raise _unsafe(name, "is not where a bundle has files")
        if len(parts) >= 2 and not _ARCH_TAG.match(parts[1]):
            raise _unsafe(name, "has an invalid arch directory")
        if len(parts) >= 3 and not _ENTRY_NAME.match(parts[2]):
            raise _unsafe(name, "has an invalid entry directory")
        if len(parts) == 4 and not _FILE_NAME.match(parts[3]):
            raise _unsafe(name, "has an invalid file name")
        if member.isreg():
            if member.size > MAX_FILE_BYTES:
                raise _unsafe(name, f"is {member.size} bytes, over the limit of {MAX_FILE_BYTES}")
            total += member.size
            files.append(member)
    if total > MAX_TOTAL_BYTES:
        raise _corrupt(f"it unpacks to {total} bytes, over the limit of {MAX_TOTAL_BYTES}")
    if BUNDLE_INDEX not in seen:
        raise _corrupt(f"it has no {BUNDLE_INDEX}")
    return files


def _open_tar(path: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(path, mode="r:gz")
    except FileNotFoundError:
        raise BundleError(f"{path} does not exist.", "check the path.", code="bundle_unreadable") from None
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        raise BundleError(f"{path} is not a readable .tar.gz: {exc}.", "export the bundle again.",
                          code="bundle_unreadable") from None


def _unpack(tar: tarfile.TarFile, files: list[tarfile.TarInfo], staging: Path) -> None:
    """Writes the checked file members below ``staging`` ourselves (never tar.extract:
    no modes, owners or times from the archive)."""
    for member in files:
        target = staging / member.name
        for parent in reversed(target.relative_to(staging).parents):
            directory = staging / parent
            if not directory.exists():
                directory.mkdir(mode=0o700)
        source = tar.extractfile(member)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(source, out, 1 << 20)


def _abi_difference(manifest: dict, components: dict) -> str:
    theirs = manifest.get("components", {})
    labels = {"torch": "torch", "torch_cuda": "torch's CUDA", "torch_git": "torch's git revision",
              "python": "Python", "soabi": "Python ABI", "machine": "machine", "package": "package version",
              "sources": "kernel sources", "cuda_flags": "nvcc flags", "cxx_flags": "C++ flags",
              "layout": "cache layout", "kernel": "kernel"}
    diffs = []
    for k, label in labels.items():
        if theirs.get(k) == components.get(k):
            continue
        if isinstance(components.get(k), (dict, list)):  # sources and flags: too long to print
            diffs.append(f"the {label} differ")
        else:
            diffs.append(f"{label} {theirs.get(k)!r} in the bundle, {components.get(k)!r} here")
    return "; ".join(diffs) or "its ABI key does not match"


def _check_entry(entry_dir: Path, record: dict, staging: Path, local_toolkit: str | None,
                 notes: list[str]) -> tuple[str, str, str]:
    """Verifies one unpacked entry; returns (arch tag, kernel, key)."""
    from .arch import archs_tag, parse_arch_list
    from .spec import BuildSpec

    prefix = record["path"]
    listed = record.get("files")
    if not isinstance(listed, dict) or set(listed) != {p.name for p in entry_dir.iterdir()}:
        raise _corrupt(f"the files of {prefix} do not match the list in {BUNDLE_INDEX}")
    for name, digest in listed.items():
        if file_sha256(entry_dir / name) != digest:
            raise _corrupt(f"{prefix}/{name} does not match its sha256 in {BUNDLE_INDEX}")
    _, tag, entry_name = prefix.split("/")
    kernel, key = entry_name.rsplit("-", 1)
    try:
        entry = verify_entry(entry_dir, key=key)
    except CorruptEntry as exc:
        raise _corrupt(str(exc).replace(str(staging) + "/", "")) from None
    manifest = entry.manifest
    if manifest.get("kernel") != KERNEL or kernel != KERNEL:
        raise BundleError(f"{prefix} holds kernel {manifest.get('kernel')!r}; this version builds {KERNEL!r}.",
                          f"export the bundle with sglang-hicache-jit {__version__}.", code="bundle_mismatch")
    try:
        archs = parse_arch_list(";".join(manifest["components"]["archs"]))
    except (KeyError, TypeError, ValueError):
        raise _corrupt(f"{prefix}/manifest.json lists no valid archs") from None
    if archs_tag(archs) != tag:
        raise _corrupt(f"{prefix} is filed under {tag} but built for {archs_tag(archs)}")
    spec = BuildSpec.for_archs(archs)
    if manifest["abi_key"] != spec.abi_key:
        raise BundleError(
            f"{prefix} was built for another setup than this machine's: "
            f"{_abi_difference(manifest, spec.abi_components)}; nothing was imported.",
            "export the bundle on a machine (or image) with the same torch, Python and sglang-hicache-jit "
            "versions as this one.",
            code="bundle_mismatch",
        )
    if not acceptable(manifest, spec.abi_key, local_toolkit):
        notes.append(f"{prefix} was built with CUDA {toolkit_version(manifest['toolkit'])}; while CUDA "
                     f"{toolkit_version(local_toolkit)} is installed here the loader builds its own instead")
    return tag, kernel, key


def import_bundle(source: str, into: str | Path | None = None) -> BundleReport:
    """Verifies the bundle at ``source`` (a path or fsspec URL) and publishes
    its entries into ``into`` (default: the writable cache)."""
    from .toolchain import find_toolkit

    if remote.is_url(source):
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "bundle.tar.gz"
            try:
                remote.download(source, local)
            except FileNotFoundError:
                raise BundleError(f"{source} does not exist.", "check the URL.", code="bundle_unreadable") from None
            report = import_bundle(str(local), into)
            report.path = source
            return report
    path = Path(source).expanduser()
    cache = BuildCache(Path(into).expanduser() if into is not None else settings.cache_root())
    toolkit = find_toolkit()
    local_toolkit = toolkit.identity if toolkit else None
    report = BundleReport(str(path))
    with _open_tar(path) as tar:
        try:
            members = tar.getmembers()
        except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
            raise BundleError(f"{path} is damaged: {exc}.", "download or export it again.",
                              code="bundle_unreadable") from None
        files = check_members(members)  # before anything is written
        # Directories this import creates, removed again if it fails: a refused bundle leaves no trace.
        created = [p for p in (cache.root, cache.layout_root, cache.layout_root / ".staging") if not p.exists()]
        cache.ensure_root()
        staging = cache.new_staging_dir("import")
        published = False
        try:
            try:
                _unpack(tar, files, staging)
            except (tarfile.TarError, EOFError, zlib.error) as exc:
                raise _corrupt(f"it is truncated or damaged ({exc})") from None
            try:
                index = json.loads((staging / BUNDLE_INDEX).read_text())
                records = index["entries"]
                assert index.get("format") == BUNDLE_FORMAT and isinstance(records, list)
            except (OSError, ValueError, KeyError, TypeError, AssertionError):
                raise _corrupt(f"its {BUNDLE_INDEX} is unreadable or of an unknown format") from None
            listed = {r.get("path") for r in records if isinstance(r, dict)}
            present = {"/".join(m.name.split("/")[:3]) for m in files if m.name != BUNDLE_INDEX}
            if listed != present or len(listed) != len(records):
                raise _corrupt(f"its entries do not match {BUNDLE_INDEX} (listed {sorted(map(str, listed))}, "
                               f"present {sorted(present)})")
            checked = [(staging / r["path"], _check_entry(staging / r["path"], r, staging, local_toolkit,
                                                          report.notes))
                       for r in sorted(records, key=lambda r: r["path"])]
            # Everything verified: publish, each entry with one rename.
            for entry_dir, (tag, kernel, key) in checked:
                before = cache.entry_path(tag, kernel, key).exists()
                entry = cache.publish(entry_dir, tag, kernel, key)
                published = True
                report.entries.append({"arch": ";".join(entry.manifest["components"]["archs"]), "key": key,
                                       "path": str(entry.path), "action": "kept" if before else "imported"})
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            if not published:
                for directory in reversed(created):
                    try:
                        directory.rmdir()
                    except OSError:  # not empty: someone else uses it now
                        pass
    if into is None:
        from .prune import apply_size_cap

        apply_size_cap(cache, keep=tuple(Path(r["path"]) for r in report.entries))
    return report
