"""Hardening: private directories, refusing writable or foreign caches, locks elsewhere, SASS for the GPU."""

import os
import stat

import pytest

from fleet_helpers import cli, env_for, fake_entry
from sglang_hicache_jit.buildcache import loader, trust
from sglang_hicache_jit.buildcache.arch import Arch, parse_arch_list
from sglang_hicache_jit.buildcache.cache import BuildCache, open_verified, sass_numbers
from sglang_hicache_jit.errors import ArchUnsupportedError, NotBuiltError, UnsafeCacheError
from sglang_hicache_jit.buildcache.loader import KernelLibrary, ensure_built, load_kernels

ARCHS = parse_arch_list("9.0")


def test_every_created_directory_is_private(tmp_path):
    cache = BuildCache(tmp_path / "a" / "b" / "cache")
    entry = fake_entry(cache)
    for path in (tmp_path / "a", tmp_path / "a" / "b", cache.root, cache.layout_root, entry.path.parent, entry.path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path


@pytest.mark.parametrize("where", ["root", "layout", "arch", "entry"])
@pytest.mark.parametrize("bits", [0o020, 0o002])
def test_group_or_world_writable_cache_is_refused(tmp_path, monkeypatch, where, bits):
    cache = BuildCache(tmp_path / "cache")
    entry = fake_entry(cache)
    path = {"root": cache.root, "layout": cache.layout_root, "arch": entry.path.parent, "entry": entry.path}[where]
    os.chmod(path, 0o700 | bits)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(cache.root))
    with pytest.raises(UnsafeCacheError) as info:
        ensure_built(ARCHS, build=False)
    assert info.value.code == "unsafe_cache" and str(path) in info.value.reason
    assert "writable by" in info.value.reason and "chmod go-w" in info.value.fix


def test_a_writable_cache_is_refused_for_builds_too(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeCacheError):
        BuildCache(root).ensure_root()


def test_group_writable_library_is_not_loaded(tmp_path):
    entry = fake_entry(BuildCache(tmp_path / "cache"))
    os.chmod(entry.library, 0o664)
    with pytest.raises(UnsafeCacheError, match="writable by its group"):
        open_verified(entry)


def test_another_users_cache_is_refused_and_a_prebuilt_layer_only_if_its_owner_is_trusted(tmp_path, monkeypatch):
    st = os.stat(tmp_path)
    other = os.geteuid() + 1 if os.geteuid() else 12345

    def owned_by(uid):
        return os.stat_result((stat.S_IFDIR | 0o755, st.st_ino, st.st_dev, 2, uid, 0, 0, 0, 0, 0))

    with pytest.raises(UnsafeCacheError, match="owned by uid"):
        trust.check_stat(owned_by(other), tmp_path, prebuilt=False)
    trust.check_stat(owned_by(0), tmp_path, prebuilt=True)  # root-owned, in an image
    trust.check_stat(owned_by(os.geteuid()), tmp_path, prebuilt=True)
    with pytest.raises(UnsafeCacheError, match="neither root nor this user"):
        trust.check_stat(owned_by(other), tmp_path, prebuilt=True)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_TRUSTED_OWNERS", str(other))
    trust.check_stat(owned_by(other), tmp_path, prebuilt=True)  # named by the operator


def test_cli_reports_the_refusal(tmp_path):
    cache = BuildCache(tmp_path / "cache")
    fake_entry(cache)
    os.chmod(cache.root, 0o770)
    out = cli("check", "--arch", "9.0", "--no-build", env=env_for(cache.root))
    assert out.returncode == 1 and "unsafe_cache" in out.stdout and "chmod go-w" in out.stdout


def test_lock_dir_setting_moves_locks(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_JIT_LOCK_DIR", str(tmp_path / "node-local" / "locks"))
    path = BuildCache(tmp_path / "shared").lock_path("sm90", "k", "abc")
    assert path.parent == tmp_path / "node-local" / "locks" and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert not (tmp_path / "shared").exists()


# ---- machine code for the GPU -------------------------------------------------

def test_sass_comes_from_the_manifest_flags(tmp_path):
    entry = fake_entry(BuildCache(tmp_path / "c"), "8.0+PTX")
    assert sass_numbers(entry.manifest) == {"80"}
    library = KernelLibrary("x", parse_arch_list("8.0+PTX"), entry, ops=None)
    assert library.supports((8, 0)) and library.supports((8, 6))
    assert not library.supports((9, 0)), "PTX alone must not count as support"


class _FakeLoad:
    """Stands in for loader._load: records what was asked, returns a library with the asked archs."""

    def __init__(self, tmp_path, fail=None):
        self.asked, self.tmp_path, self.fail = [], tmp_path, fail

    def __call__(self, archs, build):
        self.asked.append(archs)
        if self.fail is not None:
            raise self.fail
        entry = fake_entry(BuildCache(self.tmp_path / "c"), ";".join(map(str, archs)))
        return KernelLibrary("x", archs, entry, ops=None)


@pytest.fixture
def gpu_90(monkeypatch):
    monkeypatch.setattr(loader, "current_gpu_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(loader, "_by_archs", {})


def test_env_arch_without_sass_for_the_gpu_builds_for_the_gpu(tmp_path, monkeypatch, gpu_90, caplog):
    fake = _FakeLoad(tmp_path)
    monkeypatch.setattr(loader, "_load", fake)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_ARCH", "8.0+PTX")
    library = load_kernels(device=0)
    assert fake.asked == [(Arch(9, 0),)] and library.supports((9, 0))
    assert "no machine code" in caplog.text and "PTX" in caplog.text


def test_env_arch_with_sass_for_the_gpu_is_kept(tmp_path, monkeypatch, gpu_90):
    fake = _FakeLoad(tmp_path)
    monkeypatch.setattr(loader, "_load", fake)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_ARCH", "8.0;9.0")
    load_kernels(device=0)
    assert fake.asked == [parse_arch_list("8.0;9.0")]


def test_when_no_build_for_the_gpu_can_be_had_the_error_says_why(tmp_path, monkeypatch, gpu_90):
    monkeypatch.setattr(loader, "_load", _FakeLoad(tmp_path, fail=NotBuiltError("not in the cache.", "prewarm.")))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_ARCH", "8.0+PTX")
    with pytest.raises(ArchUnsupportedError, match="no machine code.*PTX.*not in the cache") as info:
        load_kernels(device=0, build=False)
    assert info.value.code == "arch_unsupported" and "add 9.0" in info.value.fix


def test_explicit_arch_for_another_gpu_is_refused(tmp_path, monkeypatch, gpu_90):
    monkeypatch.setattr(loader, "_load", _FakeLoad(tmp_path))
    with pytest.raises(ArchUnsupportedError, match="no machine code"):
        load_kernels("8.0", device=0)


def test_library_whose_manifest_lacks_sass_is_refused(tmp_path, monkeypatch, gpu_90):
    def load(archs, build):
        entry = fake_entry(BuildCache(tmp_path / "c"), "9.0", cuda_flags=["-gencode=arch=compute_90,code=compute_90"])
        return KernelLibrary("x", archs, entry, ops=None)

    monkeypatch.setattr(loader, "_load", load)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_ARCH", "9.0")
    with pytest.raises(ArchUnsupportedError, match="no machine code for compute capability 9.0"):
        load_kernels(device=0)


def test_waiting_for_a_build_is_bounded_and_names_the_holder(tmp_path, monkeypatch):
    """The holder keeps the entry's lock (in a node-local lock directory); the waiter gives up after the timeout."""
    import subprocess
    import sys
    import time
    import types

    from fleet_helpers import ROOT
    from sglang_hicache_jit.errors import LockTimeoutError

    env = env_for(tmp_path / "cache", SGLANG_HICACHE_JIT_LOCK_DIR=tmp_path / "locks")
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, types\n"
         "from sglang_hicache_jit.buildcache import loader\n"
         "from sglang_hicache_jit.buildcache.arch import parse_arch_list\n"
         "from sglang_hicache_jit.buildcache.spec import BuildSpec\n"
         "spec = BuildSpec.for_archs(parse_arch_list('9.0'))\n"
         "with loader._build_lock(loader.writable_cache(), spec, spec.key('cuda-13.0-nvccT')):\n"
         "    print('held', flush=True); sys.stdin.read()\n"],
        env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for name in ("SGLANG_HICACHE_JIT_CACHE_DIR", "SGLANG_HICACHE_JIT_LOCK_DIR"):
            monkeypatch.setenv(name, env[name])
        monkeypatch.setenv("SGLANG_HICACHE_JIT_LOCK_TIMEOUT", "0.5")
        monkeypatch.setattr(loader, "find_toolkit", lambda: types.SimpleNamespace(identity="cuda-13.0-nvccT"))
        monkeypatch.setattr(loader, "check_build_tools", lambda archs: None)
        started = time.monotonic()
        with pytest.raises(LockTimeoutError, match=f"held by pid {holder.pid} on ") as info:
            ensure_built(ARCHS)
        assert 0.45 < time.monotonic() - started < 10 and info.value.code == "lock_timeout"
        assert str(tmp_path / "locks") in info.value.fix
    finally:
        holder.communicate("", timeout=30)
