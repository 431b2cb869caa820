"""Adversarial: hangs. Every command runs in a subprocess with a timeout: a hang fails
the test instead of wedging the suite."""

import os
import subprocess
import sys

import pytest

from adversarial_helpers import cli_env
from fleet_helpers import ROOT, cli, fake_entry
from sglang_hicache_jit.buildcache.cache import BuildCache
from sglang_hicache_jit.buildcache.toolchain import find_toolkit

TIMEOUT = 30  # a command here takes about a second; a hang is a hang


def _run(*args, env):
    try:
        return cli(*args, env=env, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`sglang-hicache-jit {' '.join(args)}` hung for {TIMEOUT} s")


@pytest.fixture
def fifo_cache(tmp_path):
    """A cache whose entry (the exact key of this machine's toolkit) has a FIFO for a manifest."""
    toolkit = find_toolkit()
    cache = BuildCache(tmp_path / "cache")
    entry = fake_entry(cache, toolkit=toolkit.identity) if toolkit else fake_entry(cache)
    other = fake_entry(cache, toolkit="cuda-13.0-nvccOTHER")  # a same-ABI entry: found by find_abi's listing
    for path in (entry.path, other.path):
        (path / "manifest.json").unlink()
        os.mkfifo(path / "manifest.json")
    return cache


@pytest.mark.parametrize("args", [("check", "--arch", "9.0", "--no-build"), ("info",), ("info", "--json"),
                                  ("prune",), ("prewarm", "--arch", "9.0"), ("doctor", "--arch", "9.0"),
                                  ("export", "--arch", "9.0", "-o", "OUT")])
def test_a_fifo_for_a_manifest_does_not_hang(fifo_cache, tmp_path, args):
    # CXX=/bin/false: where the entry is (rightly) found corrupt, prewarm and export stop at the compiler
    # check instead of compiling for 10 s.
    args = tuple(str(tmp_path / "b.tar.gz") if a == "OUT" else a for a in args)
    out = _run(*args, env=cli_env(fifo_cache.root, CXX="/bin/false"))
    assert "Traceback" not in out.stderr, out.stderr


def test_load_kernels_with_a_fifo_manifest_does_not_hang(fifo_cache):
    code = "from sglang_hicache_jit.buildcache import loader\ntry:\n    loader.load_kernels('9.0', build=False)\n" \
           "except Exception as exc:\n    print(type(exc).__name__, getattr(exc, 'code', ''))\n"
    try:
        out = subprocess.run([sys.executable, "-c", code], env=cli_env(fifo_cache.root), cwd=ROOT,
                             capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail("load_kernels hung on a FIFO manifest")
    assert "NotBuiltError not_built" in out.stdout, out.stdout + out.stderr


def test_a_fifo_given_as_a_bundle_does_not_hang(tmp_path):
    fifo = tmp_path / "bundle.tar.gz"
    os.mkfifo(fifo)
    out = _run("import", str(fifo), env=cli_env(tmp_path / "cache"))
    assert out.returncode == 1 and "bundle_unreadable" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_fifo_failure_record_or_owner_file_does_not_hang(tmp_path, monkeypatch):
    """The failure memo and the lock holder file are read by waiting processes too."""
    cache = BuildCache(tmp_path / "cache")
    cache.ensure_root()
    fifo_record = cache.failure_path("sm90", "hicache_transfer", "a" * 16)
    fifo_record.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo_record)
    owner = tmp_path / "x.owner"
    os.mkfifo(owner)
    code = ("from sglang_hicache_jit.buildcache import loader\nfrom sglang_hicache_jit.buildcache.cache import BuildCache\n"
            f"c = BuildCache({str(cache.root)!r})\n"
            "print(c.read_failure('sm90', 'hicache_transfer', 'a' * 16))\n"
            f"print(loader._read_owner(__import__('pathlib').Path({str(owner)!r})))\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], env=cli_env(cache.root), cwd=ROOT, capture_output=True,
                             text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail("reading a FIFO record hung")
    assert out.stdout.split() == ["None", "another", "process"], out.stdout + out.stderr


@pytest.mark.parametrize("value", ["nan", "1e999"])  # 1e999 is inf
def test_an_endless_lock_timeout_is_refused_not_waited_on(tmp_path, value):
    """A holder keeps the build lock; with LOCK_TIMEOUT=nan/inf the old code waited forever."""
    cache = BuildCache(tmp_path / "cache")
    env = cli_env(cache.root, SGLANG_HICACHE_JIT_LOCK_TIMEOUT=value)
    holder_code = ("import sys\nfrom sglang_hicache_jit.buildcache import loader\n"
                   "from sglang_hicache_jit.buildcache.arch import parse_arch_list\nfrom sglang_hicache_jit.buildcache.spec import BuildSpec\n"
                   "from sglang_hicache_jit.buildcache.toolchain import find_toolkit\n"
                   "spec = BuildSpec.for_archs(parse_arch_list('9.0'))\n"
                   "with loader._build_lock(loader.writable_cache(), spec, spec.key(find_toolkit().identity)):\n"
                   "    print('held', flush=True); sys.stdin.read()\n")
    if find_toolkit() is None:
        pytest.skip("needs a CUDA toolkit (prewarm stops earlier without one)")
    holder = subprocess.Popen([sys.executable, "-c", holder_code], env=cli_env(cache.root), cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        out = _run("prewarm", "--arch", "9.0", env=env)
        assert out.returncode == 2 and "SGLANG_HICACHE_JIT_LOCK_TIMEOUT" in out.stderr, out.stdout + out.stderr
        assert "Traceback" not in out.stderr
        doctor = _run("doctor", "--arch", "9.0", env=env)
        assert doctor.returncode == 1 and "no problems" not in doctor.stdout
        assert "SGLANG_HICACHE_JIT_LOCK_TIMEOUT" in doctor.stdout
    finally:
        holder.communicate("", timeout=30)
