"""Prebuilt layers and bundles at fsspec URLs (s3://, gs://, http(s)://, memory://, ...).

Needs the optional extra (``pip install 'sglang-hicache-jit[remote]'``, plus
the filesystem's own package, e.g. s3fs). A remote layer has the layout of a
local one (``<url>/v1/<arch tag>/<kernel>-<key>/...``; an unpacked bundle or a
synced cache directory). A remote entry is never loaded where it lies: it is
copied into a private staging directory of the local cache, verified exactly
like a local entry (manifest, size, sha256, key, ABI), published there by
rename and loaded from there. Later processes find it in the local cache and
never touch the network, which is why remote layers are consulted after the
local cache (local prebuilt layers come before it).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

from .cache import BUILD_LOG, MANIFEST, BuildCache, CorruptEntry, Entry, acceptable, verify_entry
from .errors import RemoteError
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
            "pip install 'sglang-hicache-jit[remote]' (and the filesystem's package, e.g. s3fs or gcsfs).",
            code="no_fsspec",
        ) from None
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:  # unknown scheme, or its package is missing
        raise RemoteError(f"Cannot open {url}: {exc}",
                          "install the fsspec implementation for this scheme (e.g. s3fs, gcsfs, aiohttp).",
                          code="no_fsspec") from None


def download(url: str, target: Path) -> None:
    """Copies one remote file to a local path."""
    fs, path = filesystem(url)
    try:
        with fs.open(path, "rb") as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except FileNotFoundError:
        raise
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
    arch_path = f"{root.rstrip('/')}/{LAYOUT_VERSION}/{arch_tag}"
    for name in _candidates(fs, arch_path, kernel, key):
        try:
            manifest = json.loads(fs.cat_file(f"{arch_path}/{name}/{MANIFEST}"))
        except FileNotFoundError:
            continue
        except ValueError as exc:
            log.warning("skipping %s/%s: unreadable manifest (%s)", url, name, exc)
            continue
        if not isinstance(manifest, dict) or not acceptable(manifest, abi_key, local_toolkit):
            continue
        entry_key = name[len(kernel) + 1:]
        cache.ensure_root()
        staging = cache.new_staging_dir(name)
        try:
            entry_dir = staging / "entry"
            entry_dir.mkdir(mode=0o700)
            files = [MANIFEST, str(manifest.get("library", ""))] + [BUILD_LOG]
            for filename in files:
                if not filename or "/" in filename or filename.startswith("."):
                    raise CorruptEntry(f"{url}/{name}: the manifest names an invalid file {filename!r}")
                remote_file = f"{arch_path}/{name}/{filename}"
                try:
                    (entry_dir / filename).write_bytes(fs.cat_file(remote_file))
                except FileNotFoundError:
                    if filename != BUILD_LOG:  # the log is informative only
                        raise CorruptEntry(f"{url}/{name}/{filename} is missing") from None
            verify_entry(entry_dir, key=entry_key, abi_key=abi_key)
            entry = cache.publish(entry_dir, arch_tag, kernel, entry_key)
            log.info("copied %s/%s/%s into %s", url.rstrip("/"), arch_tag, name, cache.root)
            return entry
        except CorruptEntry as exc:
            log.warning("skipping a corrupt entry in the remote layer %s: %s", url, exc)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return None
