"""Bundles: verified cache entries in one .tar.gz, to build once and ship.

Why one long module: export and import are one archive format, and import's checks (headers,
members, manifests, checksums) are read best in the order they run, to see that nothing is written
before all of them pass.

A bundle is a gzip'd tar with sorted members, zero times and owners, and no
time or host of its own (an export is a pure function of the entries: the
same entries give the same bytes, so a bundle's sha256 can be pinned)::

    bundle.json                                   format, package, and every entry's files with sha256
    v1/<arch tag>/<kernel>-<key>/manifest.json    exactly the cache layout: an unpacked bundle is a
    v1/<arch tag>/<kernel>-<key>/<name>.so        prebuilt layer
    v1/<arch tag>/<kernel>-<key>/build.log

Import is all-or-nothing for verification. Before anything is written:
every header is bounded (a 200 MB PAX header is refused, not read), every
member is checked (only regular files and directories at the expected
places: no absolute path, '..', link or device; tarfile's "data" filter as a
second opinion where Python has it), and bundle.json and every manifest are
read from the archive and checked (fields and types, key derivation, this
machine's ABI: torch, its CUDA, Python, package and sources), and each
library's size in the archive must equal its manifest's. So a small bundle
cannot make the import write gigabytes. Then the files are unpacked into a
private staging directory, every checksum is verified, and only then is each
entry published with one rename, exactly as a build publishes it; an entry
already in the cache is kept. Any problem raises BundleError (or
CacheWriteError for a full or read-only target) and leaves the target as it
was.

``--into DIR`` writes a prebuilt layer for everyone: entries readable by all
and writable by none (files 0444, directories 0555), no staging or lock
directories left behind.
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
import tarfile
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__, safeio, settings
from . import remote
from .cache import (ARCH_TAG, ENTRY_NAME, FILE_NAME, LAYOUT_MARKER, MANIFEST, MAX_RECORD_BYTES, BuildCache,
                    CorruptEntry, Entry, acceptable, file_sha256, manifest_problem, toolkit_version, verify_entry)
from ..errors import BadSettingError, BundleError, write_error
from .spec import KERNEL, LAYOUT_VERSION, derive_key

log = logging.getLogger("sglang_hicache_jit")

BUNDLE_INDEX = "bundle.json"
BUNDLE_FORMAT = 1
# Far above a real bundle (~0.5 MB per arch), far below what would fill a disk.
MAX_FILE_BYTES = 256 << 20
MAX_LOG_BYTES = 16 << 20
MAX_TOTAL_BYTES = 2 << 30
# PAX and GNU long-name headers are read whole into memory: a real one is a few hundred bytes.
MAX_HEADER_BYTES = 64 << 10


@dataclass
class BundleReport:
    path: str
    entries: list[dict] = field(default_factory=list)  # arch, key, path, action
    notes: list[str] = field(default_factory=list)


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- export ------------------------------------------------------------------

def _entry_file(entry: Entry, name: str) -> bytes:
    """One file of an entry, only if it is a regular file inside the entry (never a link)."""
    limit = {MANIFEST: MAX_RECORD_BYTES, entry.manifest["library"]: MAX_FILE_BYTES}.get(name, MAX_LOG_BYTES)
    try:
        return safeio.read_regular(entry.path / name, limit)
    except FileNotFoundError:
        if name == entry.files[2]:  # the log is informative; an empty one keeps the file list fixed
            return b""
        raise BundleError(f"{entry.path / name} is missing.", "run `sglang-hicache-jit prune`, then export again.",
                          code="bundle_corrupt") from None
    except OSError as exc:
        raise BundleError(f"{entry.path / name} cannot be packed: {exc.strerror or exc}.",
                          "run `sglang-hicache-jit prune` (it removes damaged entries), then export again.",
                          code="bundle_corrupt") from None


def export_bundle(targets: list[tuple], output: str) -> BundleReport:
    """Packs the entries for each arch tuple in ``targets`` (building missing
    ones first) into ``output``, a path or an fsspec URL."""
    from .loader import ensure_built

    if not remote.is_url(output):  # a path that cannot be written is refused before anything is built
        safeio.check_output(settings.user_path("--output", output), "--output")
    entries: list[Entry] = []
    for archs in targets:
        entries.append(ensure_built(archs, retry_failed=True).entry)
    report = BundleReport(output)
    # No time and no host: the bytes depend on the entries only.
    index = {"format": BUNDLE_FORMAT, "package": __version__, "layout": LAYOUT_VERSION, "entries": []}
    files: list[tuple[str, bytes]] = []
    for entry in entries:
        prefix = f"{LAYOUT_VERSION}/{entry.path.parent.name}/{entry.path.name}"
        record = {"path": prefix, "archs": entry.manifest["components"]["archs"], "key": entry.key,
                  "abi_key": entry.manifest["abi_key"], "toolkit": entry.manifest["toolkit"], "files": {}}
        for name in entry.files:  # library, manifest, log: plain names (cache.manifest_problem)
            data = _entry_file(entry, name)
            record["files"][name] = _sha256_bytes(data)
            files.append((f"{prefix}/{name}", data))
        index["entries"].append(record)
        report.entries.append({"arch": ";".join(record["archs"]), "key": entry.key, "path": prefix,
                               "action": "exported"})
    index["entries"].sort(key=lambda r: r["path"])
    verify_entries_against_files(entries, files)
    files.append((BUNDLE_INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()))
    _write_tar(sorted(set(files)), output)
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
    # mtime=0 in the gzip header and the tar headers, owner 0/0 without names: the same entries give the same bundle.
    with gzip.GzipFile(filename="", fileobj=buffer, mode="wb", mtime=0, compresslevel=6) as gz:
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
    target = settings.user_path("--output", output)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # A random temporary name (O_EXCL) beside the target, then one rename: a link planted at a
        # guessable name is never written through, and readers never see half a bundle. The target
        # itself must be new or a regular file (a FIFO or /dev/null is not replaced).
        safeio.write_output(target, payload, "--output")
    except OSError as exc:
        raise write_error(exc, f"the bundle {target}", "choose an output path in a writable directory with "
                          "free space.") from None


# ---- import ------------------------------------------------------------------

def _unsafe(member: str, why: str) -> BundleError:
    return BundleError(f"The bundle is unsafe: member {member!r} {why}; nothing was imported.",
                       "use a bundle made by `sglang-hicache-jit export`, and find out who changed this one.",
                       code="bundle_unsafe")


def _corrupt(why: str) -> BundleError:
    return BundleError(f"The bundle is corrupt: {why}; nothing was imported.",
                       "export the bundle again, or download it again (compare its sha256 with the source's).",
                       code="bundle_corrupt")


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile reads a PAX or GNU long-name header whole into memory before
    anything can look at it; these refuse one larger than MAX_HEADER_BYTES first."""

    def _check_header_size(self):
        if self.size > MAX_HEADER_BYTES:
            raise _unsafe(self.name, f"is an extended header of {self.size} bytes (the limit is {MAX_HEADER_BYTES})")

    def _proc_pax(self, tarfile):
        self._check_header_size()
        return super()._proc_pax(tarfile)

    def _proc_gnulong(self, tarfile):
        self._check_header_size()
        return super()._proc_gnulong(tarfile)


def check_members(members: list[tarfile.TarInfo]) -> list[tarfile.TarInfo]:
    """Returns the file members when every member is safe and in place; else BundleError."""
    seen, files, total = set(), [], 0
    data_filter = getattr(tarfile, "data_filter", None)  # Python 3.12, 3.11.4+: a second opinion
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
        if data_filter is not None:
            try:
                data_filter(member, "/nonexistent-bundle-root")
            except tarfile.FilterError as exc:
                raise _unsafe(name, f"is refused by tarfile's data filter ({exc})") from None
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
        if len(parts) >= 2 and not ARCH_TAG.match(parts[1]):
            raise _unsafe(name, "has an invalid arch directory")
        if len(parts) >= 3 and not ENTRY_NAME.match(parts[2]):
            raise _unsafe(name, "has an invalid entry directory")
        if len(parts) == 4 and not FILE_NAME.match(parts[3]):
            raise _unsafe(name, "has an invalid file name")
        if member.isreg():
            limit = MAX_RECORD_BYTES if parts[-1] in (BUNDLE_INDEX, MANIFEST) else MAX_FILE_BYTES
            if member.size > limit:
                raise _unsafe(name, f"is {member.size} bytes, over the limit of {limit}")
            total += member.size
            files.append(member)
    if total > MAX_TOTAL_BYTES:
        raise _corrupt(f"it unpacks to {total} bytes, over the limit of {MAX_TOTAL_BYTES}")
    if BUNDLE_INDEX not in seen:
        raise _corrupt(f"it has no {BUNDLE_INDEX}")
    return files


def _open_tar(path: Path) -> tarfile.TarFile:
    """The bundle, opened only if it is a regular file (a FIFO would block the import forever)."""
    try:
        fd = safeio.open_regular(path, follow=True)
    except FileNotFoundError:
        raise BundleError(f"{path} does not exist.", "check the path.", code="bundle_unreadable") from None
    except OSError as exc:
        raise BundleError(f"{path} cannot be read as a bundle: {exc.strerror or exc}.",
                          "give the path of a .tar.gz made by `sglang-hicache-jit export`.",
                          code="bundle_unreadable") from None
    raw = os.fdopen(fd, "rb")
    try:
        tar = tarfile.open(fileobj=raw, mode="r:gz", tarinfo=_BoundedTarInfo)
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        raw.close()
        raise BundleError(f"{path} is not a readable .tar.gz: {exc}.", "export the bundle again.",
                          code="bundle_unreadable") from None
    tar._hicache_raw = raw  # closed with the archive (see _close_tar)
    return tar


def _close_tar(tar: tarfile.TarFile) -> None:
    tar.close()
    tar._hicache_raw.close()


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    """A small member (bundle.json, a manifest: check_members bounded its size)."""
    return tar.extractfile(member).read(member.size)


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


def _check_record(record, by_name: dict[str, tarfile.TarInfo], tar: tarfile.TarFile, local_toolkit: str | None,
                  notes: list[str]) -> tuple[str, str, str]:
    """Checks one entry of bundle.json against the archive before anything is
    unpacked: its file list, its manifest (fields, key derivation, this
    machine's ABI) and the declared sizes. Returns (arch tag, kernel, key)."""
    from .arch import archs_tag, parse_arch_list
    from .spec import BuildSpec

    prefix = record["path"]
    listed = record.get("files")
    present = {name.rsplit("/", 1)[1] for name in by_name if name.startswith(prefix + "/")}
    if not isinstance(listed, dict) or set(listed) != present \
            or not all(isinstance(d, str) for d in listed.values()):
        raise _corrupt(f"the files of {prefix} do not match the list in {BUNDLE_INDEX}")
    if MANIFEST not in present:
        raise _corrupt(f"{prefix} has no {MANIFEST}")
    try:
        manifest = json.loads(_read_member(tar, by_name[f"{prefix}/{MANIFEST}"]))
    except ValueError:
        raise _corrupt(f"{prefix}/{MANIFEST} is not JSON") from None
    problem = manifest_problem(manifest)
    if problem:
        raise _corrupt(f"{prefix}/{MANIFEST} {problem}")
    _, tag, entry_name = prefix.split("/")
    kernel, key = entry_name.rsplit("-", 1)
    if manifest["key"] != key or key != derive_key(manifest["abi_key"], manifest["toolkit"]):
        raise _corrupt(f"{prefix}/{MANIFEST}: its key {manifest['key']!r} does not follow from its ABI key and "
                       "toolkit, or does not match its directory")
    if manifest["name"] != f"{manifest['kernel']}_{key}" or manifest["library"] != f"{manifest['name']}.so":
        raise _corrupt(f"{prefix}/{MANIFEST}: its library name does not follow from its key")
    if present - {manifest["library"], MANIFEST, manifest.get("log", "build.log")}:
        raise _corrupt(f"{prefix} holds files its manifest does not name")
    library = by_name.get(f"{prefix}/{manifest['library']}")
    if library is None:
        raise _corrupt(f"{prefix} has no library")
    if library.size != manifest["size"]:  # before unpacking: a bomb is refused without writing it
        raise _corrupt(f"{prefix}/{manifest['library']} is {library.size} bytes in the archive, its manifest says "
                       f"{manifest['size']}")
    log_member = by_name.get(f"{prefix}/{manifest.get('log', 'build.log')}")
    if log_member is not None and log_member.size > MAX_LOG_BYTES:
        raise _unsafe(log_member.name, f"is {log_member.size} bytes, over the limit of {MAX_LOG_BYTES}")
    if manifest["kernel"] != KERNEL or kernel != KERNEL:
        raise BundleError(f"{prefix} holds kernel {manifest['kernel']!r}; this version builds {KERNEL!r}.",
                          f"export the bundle with sglang-hicache-jit {__version__}.", code="bundle_mismatch")
    try:
        archs = parse_arch_list(";".join(manifest["components"]["archs"]))
    except ValueError:
        raise _corrupt(f"{prefix}/{MANIFEST} lists no valid archs") from None
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


def _plan(tar: tarfile.TarFile, files: list[tarfile.TarInfo], local_toolkit: str | None,
          notes: list[str]) -> list[tuple[dict, tuple[str, str, str]]]:
    """Reads and checks bundle.json and every manifest from the archive; nothing is written."""
    by_name = {m.name: m for m in files}
    try:
        index = json.loads(_read_member(tar, by_name[BUNDLE_INDEX]))
        records = index["entries"]
        assert index.get("format") == BUNDLE_FORMAT and isinstance(records, list)
        assert all(isinstance(r, dict) and isinstance(r.get("path"), str) for r in records)
    except (ValueError, KeyError, TypeError, AttributeError, AssertionError):
        raise _corrupt(f"its {BUNDLE_INDEX} is unreadable or of an unknown format") from None
    listed = {r["path"] for r in records}
    present = {"/".join(m.name.split("/")[:3]) for m in files if m.name != BUNDLE_INDEX}
    if listed != present or len(listed) != len(records):
        raise _corrupt(f"its entries do not match {BUNDLE_INDEX} (listed {sorted(listed)}, present {sorted(present)})")
    records = sorted(records, key=lambda r: r["path"])
    return [(r, _check_record(r, by_name, tar, local_toolkit, notes)) for r in records]


def _check_unpacked(entry_dir: Path, record: dict, key: str, staging: Path) -> None:
    """The unpacked files match bundle.json's checksums and verify as an entry."""
    prefix = record["path"]
    for name, digest in record["files"].items():
        if file_sha256(entry_dir / name) != digest:
            raise _corrupt(f"{prefix}/{name} does not match its sha256 in {BUNDLE_INDEX}")
    try:
        verify_entry(entry_dir, key=key)
    except CorruptEntry as exc:
        raise _corrupt(str(exc).replace(str(staging) + "/", "")) from None


def _into_cache(into: str | Path) -> BuildCache:
    path = settings.user_path("--into", str(into))
    if path.exists() and not path.is_dir():
        raise BadSettingError(f"--into {str(path)!r} is a file, not a directory.",
                              "name a directory (it is created if missing), e.g. --into /opt/hicache-prebuilt.")
    settings.check_directory("--into", path)
    return BuildCache(path, shared=True, setting="--into")


def _layer_dirs(cache: BuildCache) -> list[Path]:
    """The directories of a layer that imports write into: the layout directory and its arch directories."""
    if not cache.layout_root.is_dir():
        return []
    return [cache.layout_root] + [p for p in cache.layout_root.iterdir()
                                  if ARCH_TAG.match(p.name) and p.is_dir() and not p.is_symlink()]


def _seal(cache: BuildCache, writable: bool) -> None:
    """Makes a layer's directories writable by its owner for an import
    (writable=True), or writable by nobody and readable by all afterwards."""
    for directory in _layer_dirs(cache):
        if directory.stat().st_uid == os.geteuid():
            os.chmod(directory, 0o755 if writable else 0o555)
    if not writable:
        for service in (".staging", ".trash", ".locks"):  # a layer carries entries only
            try:
                (cache.layout_root / service).rmdir()
            except OSError:
                pass
        marker = cache.layout_root / LAYOUT_MARKER
        if marker.is_file() and marker.stat().st_uid == os.geteuid():
            os.chmod(marker, 0o444)


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
    path = settings.user_path("bundle", source)
    cache = _into_cache(into) if into is not None else BuildCache(settings.cache_root())
    toolkit = find_toolkit()
    local_toolkit = toolkit.identity if toolkit else None
    report = BundleReport(str(path))
    tar = _open_tar(path)
    try:
        try:
            members = tar.getmembers()
        except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
            raise BundleError(f"{path} is damaged: {exc}.", "download or export it again.",
                              code="bundle_unreadable") from None
        files = check_members(members)
        try:
            plan = _plan(tar, files, local_toolkit, report.notes)  # everything checkable before writing
        except (tarfile.TarError, EOFError, zlib.error) as exc:
            raise _corrupt(f"it is truncated or damaged ({exc})") from None
        _publish_all(tar, files, plan, cache, report)
    finally:
        _close_tar(tar)
    if into is None:
        from .prune import apply_size_cap

        apply_size_cap(cache, keep=tuple(Path(r["path"]) for r in report.entries))
    return report


def _publish_all(tar: tarfile.TarFile, files: list[tarfile.TarInfo], plan: list, cache: BuildCache,
                 report: BundleReport) -> None:
    """Unpacks into staging, verifies, publishes. A failure leaves the target as
    it was: directories this import created are removed again."""
    created = [p for p in (cache.root, cache.layout_root) if not p.exists()]
    staging = None
    published = False
    try:
        try:
            if cache.shared:
                _seal(cache, writable=True)
            cache.ensure_root()
            staging = cache.new_staging_dir("import")
            try:
                _unpack(tar, files, staging)
            except (tarfile.TarError, EOFError, zlib.error) as exc:
                raise _corrupt(f"it is truncated or damaged ({exc})") from None
            for record, (tag, kernel, key) in plan:
                _check_unpacked(staging / record["path"], record, key, staging)
            # Everything verified: publish, each entry with one rename.
            for record, (tag, kernel, key) in plan:
                before = cache.entry_path(tag, kernel, key).exists()
                entry = cache.publish(staging / record["path"], tag, kernel, key)
                published = True
                report.entries.append({"arch": ";".join(entry.manifest["components"]["archs"]), "key": key,
                                       "path": str(entry.path), "action": "kept" if before else "imported"})
        except OSError as exc:
            raise write_error(exc, f"importing into {cache.root}") from None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if not published:
            _forget(cache, created)
        if cache.shared and cache.layout_root.is_dir():
            try:
                _seal(cache, writable=False)
                if cache.root in created and published:
                    os.chmod(cache.root, 0o555)
            except OSError as exc:
                log.warning("could not make %s read-only: %s", cache.root, exc)


def _forget(cache: BuildCache, created: list[Path]) -> None:
    """Removes the (empty) directories a failed import created, marker included."""
    if cache.layout_root in created:
        for name in (".staging", ".trash", ".locks"):
            try:
                (cache.layout_root / name).rmdir()
            except OSError:
                pass
        try:
            (cache.layout_root / LAYOUT_MARKER).unlink()
        except OSError:
            pass
    for directory in reversed(created):
        try:
            directory.rmdir()
        except OSError:  # not empty: someone else uses it now
            pass
