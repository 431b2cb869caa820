"""Whether a cache path is safe to load code from.

A loaded library runs with the rights of the process that loads it, so it must
come from a place no other user can change. The rules:

* the writable cache (everything from its root down to the library): owned by
  this user and writable by nobody else (no group or other write bit);
* a configured prebuilt layer (local, or a ``file://`` URL): owned by root, by
  this user, or by a user named in SGLANG_HICACHE_JIT_TRUSTED_OWNERS, and
  writable by nobody else (no group or other write bit). A root-owned image
  directory is the usual case. Another unprivileged user's layer would let
  that user run code in this process, so it is refused unless named;
* the lock directory: the writable cache's rules (a planted lock or holder
  file in a directory another user controls could redirect our writes).

Each check is one ``stat`` per path (a handful on the warm path). Parents of
the cache root are not checked: a private root inside a sticky world-writable
directory (``/tmp/x``) cannot be renamed or replaced by another user.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .. import settings
from ..errors import UnsafeCacheError

_GROUP_OR_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH


def check_stat(st: os.stat_result, path: Path, *, prebuilt: bool) -> None:
    """Raises UnsafeCacheError when ``path`` (with stat result ``st``) is not safe to load from."""
    mode = stat.S_IMODE(st.st_mode)
    if prebuilt:
        if st.st_uid not in (0, os.geteuid()) and st.st_uid not in settings.trusted_owners():
            raise UnsafeCacheError(
                f"{path} in a prebuilt layer is owned by uid {st.st_uid}, which is neither root nor this user "
                f"(uid {os.geteuid()}), so that user could change the code this process loads.",
                f"have root own the layer (`chown -R root LAYER`; layers are usually root's), or name that "
                f"user in {settings.TRUSTED_OWNERS} if you trust them.",
            )
        if mode & _GROUP_OR_OTHER_WRITE:
            who = "every user" if mode & stat.S_IWOTH else "its group"
            raise UnsafeCacheError(
                f"{path} in a prebuilt layer is writable by {who} (mode {mode:04o}), so another user "
                "could replace the library before it is loaded.",
                f"chmod go-w {path} (and check who changed it), or remove the layer from {settings.PREBUILT_DIRS}.",
            )
        return
    if st.st_uid != os.geteuid():
        raise UnsafeCacheError(
            f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); code is never loaded "
            "from another user's cache.",
            f"point {settings.CACHE_DIR} at a directory of your own, or ship shared builds as a read-only "
            f"prebuilt layer ({settings.PREBUILT_DIRS}).",
        )
    if mode & _GROUP_OR_OTHER_WRITE:
        who = "every user" if mode & stat.S_IWOTH else "its group"
        raise UnsafeCacheError(
            f"{path} is writable by {who} (mode {mode:04o}), so another user could replace a library in the "
            "cache before it is loaded.",
            f"chmod go-w {path} (and check who changed it), or point {settings.CACHE_DIR} at a private directory.",
        )


def check_path(path: Path, *, prebuilt: bool) -> None:
    """Checks one existing path (symlinks followed: a cache root may be a link to another disk)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return  # absent: nothing can be loaded from it; the caller finds out
    check_stat(st, path, prebuilt=prebuilt)


def check_chain(root: Path, path: Path, *, prebuilt: bool) -> None:
    """Checks ``root`` and every directory from it down to ``path`` (inclusive)."""
    check_path(root, prebuilt=prebuilt)
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        check_path(current, prebuilt=prebuilt)
