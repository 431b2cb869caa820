"""Shared by tests/test_adversarial_*.py: acting as another user, small and read-only filesystems,
in-process CLI runs that must end in one `error:` line."""

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fleet_helpers import ROOT

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to act as another user or mount)")

# Runs the CLI as another user. The interpreter and site-packages live under /root (mode 0700) here,
# so the modules are imported first and the privileges dropped after, before any cache access.
_AS_USER = """
import os, sys
import ctypes, json, pwd, tarfile, tempfile, shutil, gzip, zlib, decimal, hashlib  # noqa
import filelock, platformdirs, sysconfig  # noqa
sysconfig.get_config_vars()  # the cache key's SOABI: read from a module of the (perhaps private) stdlib
# torch (1.5 s of each child) only where the command loads a library or reads torch's facts at run time;
# one that imports it late as that user fails with PermissionError where the interpreter is private.
if sys.argv[2] in ("check", "info", "bench", "demo") or (sys.argv[2] == "-c" and "torch" in sys.argv[3]):
    import torch  # noqa
import sglang_hicache_jit.cli, sglang_hicache_jit.buildcache.loader, sglang_hicache_jit.buildcache.doctor  # noqa
import sglang_hicache_jit.buildcache.bundle, sglang_hicache_jit.buildcache.prune, sglang_hicache_jit.buildcache.remote  # noqa
import sglang_hicache_jit.bench.command  # noqa  (the CLI's parser holds bench's options)
from sglang_hicache_jit.buildcache import spec, toolchain
spec.kernels_dir(); toolchain.torch_info()
uid = int(sys.argv[1])
try:
    gid = pwd.getpwuid(uid).pw_gid
except KeyError:
    gid = uid
os.setgroups([]); os.setgid(gid); os.setuid(uid)
if sys.argv[2] == "-c":
    exec(sys.argv[3])
else:
    sys.exit(sglang_hicache_jit.cli.main(sys.argv[2:]))
"""


# What the child above still reads after dropping its privileges: the kernel sources (and the package's
# directory, for any module imported late). Run as the user first, so that a checkout or interpreter in
# a home private to root (mode 0700) skips the test with the reason instead of failing it with a
# PermissionError from inside the child.
_CAN_RUN = """
import os, pwd, sys
from sglang_hicache_jit.buildcache import spec
uid = int(sys.argv[1])
try:
    gid = pwd.getpwuid(uid).pw_gid
except KeyError:
    gid = uid
directory = spec.kernels_dir()
os.setgroups([]); os.setgid(gid); os.setuid(uid)
try:
    os.listdir(os.path.dirname(spec.__file__))
    for name in spec.SOURCES + spec.HEADERS:
        open(os.path.join(directory, name), "rb").close()
except OSError as exc:
    print(f"{exc.strerror}: {exc.filename}")
"""
_runs_here: dict = {}


def skip_unless_user_can_run_here(uid: int, root: Path = ROOT) -> None:
    """Skips the test, saying why, when ``uid`` cannot read this checkout (``root``) or interpreter's files."""
    if (uid, root) not in _runs_here:
        out = subprocess.run([sys.executable, "-c", _CAN_RUN, str(uid)], env=dict(os.environ, PYTHONPATH=str(root)),
                             cwd="/", capture_output=True, text=True, timeout=60)
        if out.returncode != 0:  # the interpreter itself failed as that user
            _runs_here[uid, root] = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
        else:
            _runs_here[uid, root] = out.stdout.strip()
    if _runs_here[uid, root]:
        pytest.skip(f"uid {uid} cannot use this interpreter and checkout ({_runs_here[uid, root]}): they lie in a "
                    "directory private to another user (e.g. a venv or checkout under /root, mode 0700); run the "
                    "tests from a checkout and environment other users can read to include this test")


def as_user(uid: int, *args: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    """`sglang-hicache-jit ARGS` (or `-c CODE`) run as ``uid``; skips the test when that user cannot
    read what the child needs (skip_unless_user_can_run_here)."""
    skip_unless_user_can_run_here(uid)
    return subprocess.run([sys.executable, "-c", _AS_USER, str(uid), *args], env=env, cwd="/", capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def public_tmp():
    """A directory every user can reach (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="hicache-adv-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    for dirpath, dirs, _ in os.walk(path):
        for d in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(dirpath, d), 0o755)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_user():
    """``make_user(role)`` creates a real account (useradd, no home, no login) and returns its uid; every
    account made is removed after the test. Skips without root or without useradd."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create user accounts")
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("useradd/userdel are not installed")
    import pwd

    made = []

    def make(role: str) -> int:
        name = f"hj{role[:8]}{os.urandom(3).hex()}"
        out = subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
                             capture_output=True, text=True)
        if out.returncode != 0:
            pytest.skip(f"useradd {name} failed: {out.stderr.strip()}")
        made.append(name)
        return pwd.getpwnam(name).pw_uid

    yield make
    for name in made:
        subprocess.run(["userdel", name], capture_output=True)


def chown_tree(path: Path, uid: int) -> None:
    for dirpath, dirs, files in os.walk(path):
        os.chown(dirpath, uid, uid)
        for name in files:
            os.lchown(os.path.join(dirpath, name), uid, uid)


@contextlib.contextmanager
def small_fs(path: Path, size: str = "64k"):
    """A tmpfs of ``size`` mounted at ``path`` (root only; skips where mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount_read_only(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)


def run_main(capsys, *args) -> tuple[int, str, str]:
    """The CLI's main() in this process: (exit code, stdout, stderr). An exception escaping
    main() (a traceback for the user) fails the test."""
    from sglang_hicache_jit.cli import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_error_line(code: int, err: str, *needles: str) -> None:
    """Non-zero exit, no traceback, an `error: ...` line naming each of ``needles``."""
    assert code != 0, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def cli_env(cache: Path, **extra) -> dict:
    from fleet_helpers import env_for

    env = env_for(cache, **extra)
    for name in ("SGLANG_HICACHE_JIT_LOCK_TIMEOUT", "SGLANG_HICACHE_JIT_BUILD_JOBS", "TORCH_CUDA_ARCH_LIST",
                 "SGLANG_HICACHE_JIT_TRUSTED_OWNERS"):
        if name not in extra:
            env.pop(name, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


__all__ = ["NOBODY", "ROOT", "as_user", "assert_one_error_line", "chown_tree", "cli_env", "make_user", "needs_root",
           "public_tmp", "remount_read_only", "run_main", "skip_unless_user_can_run_here", "small_fs"]
