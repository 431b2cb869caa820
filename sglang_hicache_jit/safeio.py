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

A file a user names for a command to write (``export -o``, ``bench --json``,
``--plot``) goes through ``write_output``: the rename would replace whatever
node is at that path, so anything there that is not a regular file (a FIFO,
a device, a socket, a directory, a symlink) is refused (as root, ``-o
/dev/null`` replaced the real /dev/null with a bundle).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
from pathlib import Path

from .errors import BadSettingError

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


def read_regular(path: Path | str, limit: int, *, check=None) -> bytes:
    """The bytes of the regular file at ``path``, refusing anything over ``limit`` bytes.
    ``check(st)``, when given, sees the ``fstat`` of the file opened (not of whatever the path names
    later) and raises to refuse it (an owner or mode the caller does not accept)."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if check is not None:
            check(st)
        if st.st_size > limit:
            raise TooLarge(errno.EFBIG, f"is larger than {limit} bytes", str(path))
        data = f.read(limit + 1)
    if len(data) > limit:  # grew while read
        raise TooLarge(errno.EFBIG, f"is larger than {limit} bytes", str(path))
    return data


_TEMP_SUFFIX = ".tmp"


def is_temp_of(entry: os.DirEntry, name: str) -> bool:
    """Whether ``entry`` is write_atomic's temporary file for ``name`` in the same directory, before its rename:
    a regular file (never a link) named ``.<name>.<random>.tmp``."""
    return (entry.name.startswith(f".{name}.") and entry.name.endswith(_TEMP_SUFFIX)
            and entry.is_file(follow_symlinks=False))


def write_atomic(path: Path | str, data: bytes, mode: int = 0o600, *, check=None) -> None:
    """Writes ``data`` to ``path`` through a random temporary file in the same
    directory, then one rename: readers see the old or the new file, whole.
    ``check(path)``, when given, runs again just before the rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), mode)
        if check is not None:
            check(path)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_output(path: Path | str, option: str) -> Path:
    """``path``, named by ``option``, when a command may write it: a new path or an existing regular
    file. Anything else there raises BadSettingError naming the option (see the module docstring).
    Callers check before their work (a build, a benchmark), and write_output checks again."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except OSError:  # absent (a new file), or unreachable: the write itself reports that
        return path
    if stat.S_ISREG(st.st_mode):
        return path
    kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
    raise BadSettingError(f"{option} {str(path)!r} is {kind}; it must be a new path or a regular file (writing "
                          f"would replace the {kind.split()[-1]} with a regular file).",
                          f"name a new file (or a regular file to replace) for {option}.")


def write_output(path: Path | str, data: bytes, option: str, mode: int = 0o644) -> None:
    """Writes a file the user named with ``option``: checked (check_output) before and again just before
    the rename, written atomically (write_atomic)."""
    check_output(path, option)
    write_atomic(path, data, mode, check=lambda p: check_output(p, option))
