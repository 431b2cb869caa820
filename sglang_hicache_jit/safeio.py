"""Reading and writing files that someone else may have replaced.

Every small file the package reads (manifests, failure records, lock holder
files, bundles) could be a FIFO, a device or a symlink planted by a bug or an
attacker. Opening a FIFO for reading blocks until a writer appears, so a plain
``open`` hangs. These helpers open with O_NONBLOCK (a FIFO opens at once) and
O_NOFOLLOW (a symlink fails with ELOOP), then check with ``fstat`` on the open
file that it is a regular file and not larger than the caller expects.

Writes go to a fresh temporary file in the target's directory (``tempfile``:
a random name, O_EXCL, mode 0600) that replaces the target by ``os.replace``.
A symlink planted at the target or at a guessable temporary name is replaced,
never followed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
from pathlib import Path

_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class NotRegularFile(OSError):
    """A path that is a FIFO, device, directory or symlink where a regular file was expected."""


class TooLarge(OSError):
    """A file larger than its kind can be (a manifest of 2 GB is not a manifest)."""


def open_regular(path: Path | str, *, follow: bool = False) -> int:
    """A read-only descriptor (blocking mode restored) of the regular file at ``path``.
    Raises FileNotFoundError, NotRegularFile (FIFO, device, directory, or a
    symlink unless ``follow``) or another OSError."""
    flags = _READ_FLAGS & ~getattr(os, "O_NOFOLLOW", 0) if follow else _READ_FLAGS
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFile(errno.ELOOP, "is a symbolic link, not a regular file", str(path)) from None
        if exc.errno in (errno.EISDIR, errno.ENXIO):  # a directory, or a socket
            raise NotRegularFile(exc.errno, "is not a regular file", str(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, "is not a regular file (a FIFO, device or directory)", str(path))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path | str, limit: int) -> bytes:
    """The bytes of the regular file at ``path``, refusing anything over ``limit`` bytes."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_size > limit:
            raise TooLarge(errno.EFBIG, f"is larger than {limit} bytes", str(path))
        data = f.read(limit + 1)
    if len(data) > limit:  # grew while read
        raise TooLarge(errno.EFBIG, f"is larger than {limit} bytes", str(path))
    return data


def write_atomic(path: Path | str, data: bytes, mode: int = 0o600) -> None:
    """Writes ``data`` to ``path`` through a random temporary file in the same
    directory, then one rename: readers see the old or the new file, whole."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
