"""The warm path (issue 10): a load from the cache imports nothing that only a build needs.

A warm load, from `import sglang_hicache_jit` through `load_kernels()` after `import torch`, must take
under 5 ms on a 2-core machine (tools/bench.py loader measures it). Importing filelock alone took
65-80 ms there, platformdirs ~2.7 ms and torch.utils.cpp_extension far more, so these tests load in a
fresh process and fail when the warm path imported one of them, or the package's build, prune or
remote modules. Modules that `import torch` already brought in are not held against the package.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet_helpers import FAKE_TOOLKIT, env_for, fake_entry
from sglang_hicache_jit import settings
from sglang_hicache_jit.buildcache.cache import BuildCache
from sglang_hicache_jit.buildcache.toolchain import find_toolkit

ROOT = Path(__file__).resolve().parent.parent
BUILD_ONLY = ("filelock", "platformdirs", "torch.utils.cpp_extension", "sglang_hicache_jit.buildcache.build",
              "sglang_hicache_jit.buildcache.prune", "sglang_hicache_jit.buildcache.remote",
              "sglang_hicache_jit.buildcache.bundle")

# argv[1]: 'fake' replaces the dlopen (the fake library is random bytes), 'real' loads for real.
WARM_LOAD = f"""
import json, subprocess, sys, torch
def refuse(*a, **k): raise AssertionError("a subprocess was started on the warm path")
subprocess.Popen.__init__ = refuse
before = set(sys.modules)
import sglang_hicache_jit
if sys.argv[1] == "fake":
    from sglang_hicache_jit.buildcache import loader
    loader._dlopen = lambda fd, entry: None
lib = sglang_hicache_jit.load_kernels("9.0")
print(json.dumps({{"path": str(lib.path), "imported": [m for m in {BUILD_ONLY!r} if m in set(sys.modules) - before]}}))
"""


def _warm_load(env: dict, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", WARM_LOAD, mode], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_warm_load_from_the_default_cache_imports_no_build_machinery(tmp_path):
    # The default cache root (no SGLANG_HICACHE_JIT_CACHE_DIR), as a server would use it.
    env = env_for(tmp_path / "unused", XDG_CACHE_HOME=tmp_path / "xdg")
    env.pop("SGLANG_HICACHE_JIT_CACHE_DIR")
    root = tmp_path / "xdg" / "sglang-hicache-jit"
    toolkit = find_toolkit()
    # With nvcc here the entry carries its identity, so the load takes the exact-key path a real hit takes.
    entry = fake_entry(BuildCache(root), toolkit=toolkit.identity if toolkit else FAKE_TOOLKIT)
    result = _warm_load(env, "fake")
    assert result["path"] == str(entry.library)
    assert result["imported"] == []


@pytest.mark.build
def test_warm_load_after_a_real_build_imports_no_build_machinery(session_cache):
    env = env_for(session_cache)
    built = subprocess.run([sys.executable, "-m", "sglang_hicache_jit", "prewarm", "--arch", "9.0"], env=env,
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    result = _warm_load(env, "real")
    assert Path(result["path"]).is_file()
    assert result["imported"] == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux rule is written out in settings.py")
@pytest.mark.parametrize("xdg", [None, "", "relative/dir", "/abs/xdg"])
def test_default_cache_root_is_platformdirs_choice(monkeypatch, xdg):
    platformdirs = pytest.importorskip("platformdirs")
    monkeypatch.delenv(settings.CACHE_DIR, raising=False)
    if xdg is None:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    assert str(settings.cache_root()) == platformdirs.user_cache_dir("sglang-hicache-jit", appauthor=False)
