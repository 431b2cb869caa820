"""Prebuilt layers and bundles at fsspec URLs (s3://, gs://, http(s)://, memory://, ...).

Needs fsspec (installed with torch) and the filesystem's own package, e.g.
s3fs or gcsfs. A remote layer has the layout of a
local one (``<url>/v1/<arch tag>/<kernel>-<key>/...``; an unpacked bundle or a
synced cache directory). A remote entry is never loaded where it lies: it is
copied into a private staging directory of the local cache, verified exactly
like a local entry (manifest, size, sha256, key, ABI), published there by
rename and loaded from there. Later processes find it in the local cache and
never touch the network, which is why remote layers are consulted after the
local cache (local prebuilt layers come before it).

Trust: a remote layer's code is run by everyone who lists the URL, so a URL
must only name storage that nobody but the operator can write to. Where the
package can check that, it does: for ``file://`` (a local directory) the
trust rules of a local prebuilt layer apply to every directory and file
copied (trust.py: owned by root, this user or a trusted owner, writable by no
one else); an unsafe source raises ``unsafe_cache`` and nothing is copied.
For object stores and HTTP the package cannot see who may write; the
manifest and sha256 checks only prove the entry is intact, not who made it.
Every manifest is checked field by field (cache.manifest_problem) before any
file is copied, and only the entry's own files are fetched.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from . import trust
from .cache import (MANIFEST, MAX_RECORD_BYTES, BuildCache, CorruptEntry, Entry, acceptable, manifest_problem,
                    verify_entry)
from ..errors import RemoteError
from .spec import LAYOUT_VERSION

log = logging.getLogger("sglang_hicache_jit")

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_ENTRY_NAME = re.compile(r"^[A-Za-z0-9_]+-[0-9a-f]{16}$")


def is_url(text: str) -> bool:
    """True for 'scheme://...' (including file://), False for a plain path."""
    return bool(_URL.match(str(text)))


def filesystem(url: str):
    """(fsspec filesystem, path inside it) for ``url``; RemoteError saying what is missing."""
    try:
        import fsspec
    except ImportError:
        raise RemoteError(
            f"{url} is an fsspec URL, but fsspec is not installed.",
            "pip install fsspec (torch normally brings it) and the filesystem's package, e.g. s3fs or gcsfs.",
            code="no_fsspec",
        ) from None
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:  # unknown scheme, or its package is missing
        raise RemoteError(f"Cannot open {url}: {exc}",
                          "install the fsspec implementation for this scheme (e.g. s3fs, gcsfs, aiohttp).",
                          code="no_fsspec") from None


# A build log of more than this is not one (a real one is a few KB).
MAX_LOG_BYTES = 16 << 20


def _read(fs, path: str, limit: int) -> bytes:
    """At most ``limit`` bytes of a remote file; OSError when it is larger (or,
    for a local file, not a regular file: a FIFO would block)."""
    if is_local(fs):
        from .. import safeio

        return safeio.read_regular(path, limit)
    with fs.open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path} is larger than {limit} bytes")
    return data


def download(url: str, target: Path) -> None:
    """Copies one remote file to a local path."""
    fs, path = filesystem(url)
    try:
        if is_local(fs):  # never block on a FIFO or follow a planted link
            from .. import safeio

            src_file = os.fdopen(safeio.open_regular(path, follow=True), "rb")
        else:
            src_file = fs.open(path, "rb")
        with src_file as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise RemoteError(f"Reading {url} failed: {exc.strerror or exc}.", "check the URL.") from None
    except Exception as exc:  # fsspec backends raise their own exception types
        raise RemoteError(f"Downloading {url} failed: {type(exc).__name__}: {exc}",
                          "check the URL, the credentials and the network.") from None


def upload(source: Path, url: str) -> None:
    fs, path = filesystem(url)
    try:
        parent = path.rsplit("/", 1)[0]
        if parent and parent != path:
            fs.makedirs(parent, exist_ok=True)
        fs.put_file(str(source), path)
    except Exception as exc:
        raise RemoteError(f"Uploading to {url} failed: {type(exc).__name__}: {exc}",
                          "check the URL, the credentials and the network.") from None


def is_local(fs) -> bool:
    """True for fsspec's local filesystem (file://), whose owners and modes can be checked."""
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool({"file", "local"} & set(protocol))


def _check_local(root: str, path: str) -> None:
    """For file:// layers: the trust rules of a local prebuilt layer, from the
    layer's root down to ``path`` (UnsafeCacheError when they do not hold)."""
    trust.check_chain(Path(root), Path(path), prebuilt=True)


def _candidates(fs, arch_path: str, kernel: str, key: str | None) -> list[str]:
    """Entry names to try: the exact key first (no listing needed), then whatever the listing shows."""
    names = [f"{kernel}-{key}"] if key else []
    try:
        listed = fs.ls(arch_path, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        listed = []
    for item in sorted(listed):
        name = str(item).rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(f"{kernel}-") and _ENTRY_NAME.match(name) and name not in names:
            names.append(name)
    return names


def fetch_entry(url: str, cache: BuildCache, arch_tag: str, kernel: str, abi_key: str, key: str | None,
                local_toolkit: str | None) -> Entry | None:
    """Copies an acceptable entry from the remote layer at ``url`` into ``cache``
    (verified, then published); None when the layer has none."""
    fs, root = filesystem(url)
    local = is_local(fs)
    root = root.rstrip("/") or "/"
    arch_path = f"{root.rstrip('/')}/{LAYOUT_VERSION}/{arch_tag}"
    for name in _candidates(fs, arch_path, kernel, key):
        entry_path = f"{arch_path}/{name}"
        if local:  # before anything is read from it
            if not fs.exists(entry_path):
                continue
            _check_local(root, f"{entry_path}/{MANIFEST}")
        try:
            manifest = json.loads(_read(fs, f"{entry_path}/{MANIFEST}", MAX_RECORD_BYTES))
        except FileNotFoundError:
            continue
        except (ValueError, OSError) as exc:
            log.warning("skipping %s/%s: unreadable manifest (%s)", url, name, exc)
            continue
        problem = manifest_problem(manifest)
        if problem:
            log.warning("skipping %s/%s: its manifest %s", url, name, problem)
            continue
        if not acceptable(manifest, abi_key, local_toolkit):
            continue
        entry_key = name[len(kernel) + 1:]
        cache.ensure_root()
        staging = cache.new_staging_dir(name)
        try:
            entry_dir = staging / "entry"
            entry_dir.mkdir(mode=0o700)
            log_name = manifest.get("log", "build.log")  # a plain file name: manifest_problem checked it
            for filename, limit in ((MANIFEST, MAX_RECORD_BYTES), (manifest["library"], manifest["size"]),
                                    (log_name, MAX_LOG_BYTES)):
                remote_file = f"{entry_path}/{filename}"
                try:
                    if local:
                        _check_local(root, remote_file)
                    (entry_dir / filename).write_bytes(_read(fs, remote_file, limit))
                except FileNotFoundError:
                    if filename != log_name:  # the log is informative only
                        raise CorruptEntry(f"{url}/{name}/{filename} is missing") from None
                except OSError as exc:  # too large, not a regular file
                    raise CorruptEntry(f"{url}/{name}/{filename}: {exc}") from None
            verify_entry(entry_dir, key=entry_key, abi_key=abi_key)
            entry = cache.publish(entry_dir, arch_tag, kernel, entry_key)
            log.info("copied %s/%s/%s into %s", url.rstrip("/"), arch_tag, name, cache.root)
            return entry
        except CorruptEntry as exc:
            log.warning("skipping a corrupt entry in the remote layer %s: %s", url, exc)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return None
