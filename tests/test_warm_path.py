"""The warm path (issue 10): a load from the cache imports nothing that only a build needs.

A warm load, from `import sglang_hicache_jit` through `load_kernels()` after `import torch`, must take
under 4.5 ms on a 2-core machine (tools/bench.py loader measures it). Importing filelock alone took
65-80 ms there, platformdirs ~2.7 ms and torch.utils.cpp_extension far more, so these tests load in a
fresh process and fail when the warm path imported one of them (fleet_helpers.BUILD_ONLY), or the
package's build, prune or remote modules. Modules that `import torch` already brought in are not held
against the package. The same check after a real build is part of test_build.py's
test_prewarm_then_warm_load_runs_no_subprocess (the session's one build).
"""

import sys

import pytest

from fleet_helpers import FAKE_TOOLKIT, env_for, fake_entry, warm_load
from sglang_hicache_jit import settings
from sglang_hicache_jit.buildcache.cache import BuildCache
from sglang_hicache_jit.buildcache.toolchain import find_toolkit


def test_warm_load_from_the_default_cache_imports_no_build_machinery(tmp_path):
    # The default cache root (no SGLANG_HICACHE_JIT_CACHE_DIR), as a server would use it.
    env = env_for(tmp_path / "unused", XDG_CACHE_HOME=tmp_path / "xdg")
    env.pop("SGLANG_HICACHE_JIT_CACHE_DIR")
    root = tmp_path / "xdg" / "sglang-hicache-jit"
    toolkit = find_toolkit()
    # With nvcc here the entry carries its identity, so the load takes the exact-key path a real hit takes.
    entry = fake_entry(BuildCache(root), toolkit=toolkit.identity if toolkit else FAKE_TOOLKIT)
    result = warm_load(env, "fake")
    assert result["path"] == str(entry.library)
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


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("fails", [False, True])
def test_the_warm_path_runs_with_the_collector_paused_and_restores_it(monkeypatch, enabled, fails):
    """sglang_hicache_jit.load_kernels imports the loader and loads with the cyclic collector off (a
    collection in an SGLang process took 1.1-1.4 ms of the 4.5 ms warm load), then leaves it as it was,
    whatever the load did."""
    import gc

    import sglang_hicache_jit
    from sglang_hicache_jit.buildcache import loader

    seen = []

    def fake_load(arch=None, *, device=None, build=True):
        seen.append((gc.isenabled(), arch, device, build))
        if fails:
            raise RuntimeError("no library")
        return "library"

    monkeypatch.setattr(loader, "load_kernels", fake_load)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        if fails:
            with pytest.raises(RuntimeError, match="no library"):
                sglang_hicache_jit.load_kernels("9.0", device=1, build=False)
        else:
            assert sglang_hicache_jit.load_kernels("9.0", device=1, build=False) == "library"
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [(False, "9.0", 1, False)]
