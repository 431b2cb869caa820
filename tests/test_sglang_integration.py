"""The installed SGLang itself, with this package installed: signatures, plugin discovery, pools.

These tests need sglang importable (``pip install --no-deps sglang==0.5.23``
and ``pip install -e ".[sglang]"``, as .ci/run does). Without it they skip,
unless SGLANG_HICACHE_JIT_REQUIRE_SGLANG=1 (set in CI), which turns the skip
into a failure. The plugin is found through the installed distribution's
entry points, so the package must be pip-installed, not just on PYTHONPATH.

Pool tests run tests/sglang_cells.py in a fresh process (the plugin patches
process-wide state) with a generated sgl_kernel stand-in first on the path
(release_kit.py): the signatures of the sglang-kernel the installed SGLang
pins, every op raising, which is the deployment this package exists for.
test_sglang_releases.py does the same for every recorded release.
"""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _sglang_or_skip():
    try:
        import sglang.kernels.ops.kvcache.hicache as upstream
    except Exception as exc:  # ImportError, or a missing dependency of sglang's import chain
        if os.environ.get("SGLANG_HICACHE_JIT_REQUIRE_SGLANG") == "1":
            pytest.fail(f"sglang is required here (SGLANG_HICACHE_JIT_REQUIRE_SGLANG=1) but does not import: {exc}")
        pytest.skip(f"needs sglang (pip install -e \".[test,sglang]\" && pip install --no-deps sglang==0.5.23): {exc}")
    return upstream


@pytest.fixture(scope="module")
def upstream():
    return _sglang_or_skip()


@pytest.fixture(scope="module")
def installed():
    """The installed SGLang's version (it must be one the release records cover)."""
    from importlib.metadata import version

    import release_kit

    found = version("sglang")
    assert found in release_kit.recorded(), f"sglang {found} is not recorded: run tools/sglang_releases.py {found}"
    return found


@pytest.fixture(scope="module")
def standin(installed, tmp_path_factory):
    """An sgl_kernel stand-in with the signatures of the sglang-kernel the installed SGLang pins."""
    import release_kit

    return release_kit.write_standin(tmp_path_factory.mktemp("standin"), installed)


def _expected_patched(version: str) -> set:
    """What the planner decides from the release's record: the patches the plugin must make."""
    import release_kit

    from sglang_hicache_jit.integrations.sglang.plan import RecordedFacts, plan

    rec = release_kit.record(version)
    return {f"{d.target.name} -> {d.path}" for d in plan(RecordedFacts(rec, release_kit.kernel_record(rec["sglang_kernel"])))
            if d.patched}


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


UPSTREAM_HICACHE = (
    "can_use_hicache_jit_kernel", "can_use_write_back_jit_kernel", "can_use_page_unified_load_back_jit_kernel",
    "transfer_hicache_one_layer", "transfer_hicache_one_layer_mla", "transfer_hicache_all_layer",
    "transfer_hicache_all_layer_mla", "transfer_hicache_all_layer_staged_lf_pf",
    "transfer_hicache_all_layer_mla_staged_lf_pf", "transfer_hicache_one_layer_page_unified_lf",
    "transfer_hicache_one_layer_mla_page_unified_lf", "transfer_hicache_all_layer_staged_lf_page_unified",
    "transfer_hicache_all_layer_mla_staged_lf_page_unified",
)


def test_compat_covers_every_public_transfer_function(upstream):
    from sglang_hicache_jit import compat

    public = {n for n, f in vars(upstream).items()
              if callable(f) and not n.startswith("_") and getattr(f, "__module__", "") == upstream.__name__
              and (n.startswith("transfer_") or n.startswith("can_use_"))}
    assert public == set(UPSTREAM_HICACHE)
    assert set(compat.__all__) == public


@pytest.mark.parametrize("name", UPSTREAM_HICACHE)
def test_compat_signature_equals_installed_sglang(upstream, name):
    from sglang_hicache_jit import compat

    assert _params(getattr(compat, name)) == _params(getattr(upstream, name))


def test_routed_ops_take_every_call_the_installed_ops_take(upstream):
    from sglang_hicache_jit.integrations.sglang import matching
    from sglang_hicache_jit.integrations.sglang import ops as routed

    for name in routed.HICACHE_OPS:
        assert matching.replacement_mismatch(matching.params_of(getattr(upstream, name)),
                                             matching.params_of(getattr(routed, name))) is None, name


@pytest.mark.parametrize("element_size", [576, 6, 0, -4, [576], 2.5, "288", None, True])
def test_can_use_never_raises(upstream, element_size):
    from sglang_hicache_jit import compat
    from sglang_hicache_jit.integrations.sglang import ops as sglang_ops

    assert isinstance(compat.can_use_hicache_jit_kernel(element_size=element_size), bool)
    assert isinstance(compat.can_use_write_back_jit_kernel(element_size=element_size), bool)
    assert isinstance(compat.can_use_page_unified_load_back_jit_kernel(group_bytes=element_size), bool)
    assert isinstance(sglang_ops.can_use_hicache_jit_kernel(element_size=element_size), bool)


def _run_cells(standin, mode: str, *, env=None, only: str = "", timeout: int = 600):
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join([str(standin), str(HERE.parent), child_env.get("PYTHONPATH", "")])
    child_env.update(env or {})
    args = [sys.executable, str(HERE / "sglang_cells.py"), mode] + (["--only", only] if only else [])
    proc = subprocess.run(args, capture_output=True, text=True, env=child_env, timeout=timeout)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, records


def _cell_failures(records):
    return [f"{r['cell']}: {r['error']}\n{r.get('trace', '')}" for r in records if "cell" in r and not r["ok"]]


@pytest.mark.slow  # a fresh process importing sglang: ~15 s on 2 cores
def test_plugin_is_discovered_and_every_pool_builds(upstream, installed, standin):
    proc, records = _run_cells(standin, "construct")
    assert records, proc.stderr[-3000:]
    header = records[0]
    assert header["plugin"]["registered"] is True, header
    assert header["skipped"] == [], header["skipped"]
    assert set(header["patched"]) == _expected_patched(installed)
    assert not _cell_failures(records), "\n".join(_cell_failures(records))
    assert records[-1]["summary"]["cells"] == 57 and proc.returncode == 0
    assert "Traceback" not in proc.stderr


# Prints, for each name a pool module calls, the module of what runs when it is called: a
# REPLACE hook wraps the original with functools.wraps, so look at the hook in the wrapper.
_WHO_RUNS = """
import inspect, logging
logging.basicConfig(level=logging.INFO)
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.mem_cache.pool_host.mla as m, sgl_kernel.kvcacheio as k
# Without CUDA the pool modules skip their sgl_kernel imports; the source module is patched either way.
d = m if hasattr(m, "transfer_kv_per_layer_mla") else k
def who(fn):
    hook = inspect.getclosurevars(fn).nonlocals.get("hook") if hasattr(fn, "__wrapped__") else None
    return (hook or fn).__module__
print(who(m.jit_transfer_hicache_one_layer_mla), who(d.transfer_kv_per_layer_mla),
      who(d.transfer_kv_all_layer_mla_lf_pf), who(m.can_use_hicache_jit_kernel))
"""


def _who_runs(standin, env):
    child_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(standin), os.environ.get("PYTHONPATH", "")]), **env)
    out = subprocess.run([sys.executable, "-c", _WHO_RUNS], capture_output=True, text=True, env=child_env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split(), out.stderr


@pytest.mark.slow  # a fresh process importing sglang: ~15 s on 2 cores
@pytest.mark.parametrize("env", [{"SGLANG_HICACHE_JIT_SGLANG_PLUGIN": "0"}, {"SGLANG_PLUGINS": "someone_else"}])
def test_plugin_can_be_turned_off(upstream, standin, env):
    names, _ = _who_runs(standin, env)
    assert names == ["sglang.kernels.ops.kvcache.hicache", "sgl_kernel.kvcacheio", "sgl_kernel.kvcacheio",
                     "sglang.kernels.ops.kvcache.hicache"]


@pytest.mark.slow  # a fresh process importing sglang: ~15 s on 2 cores
def test_plugin_routes_pool_modules_to_this_package(upstream, installed, standin):
    names, log = _who_runs(standin, {})
    # transfer_kv_per_layer_mla among them: sgl-kernel 0.4.7+ gives it block_quota=None, which fits.
    assert names == ["sglang_hicache_jit.integrations.sglang.ops"] * 4
    assert (f"sglang-hicache-jit: sglang {installed} (checked against sglang {installed}): routing 21 HiCache ops "
            "and 12 pool methods through this package; 0 not in this release; skipped 0.") in log


def test_register_never_raises(upstream, monkeypatch, caplog):
    from sglang_hicache_jit import settings
    from sglang_hicache_jit.integrations import sglang as plugin

    saved = dict(plugin.status)
    plugin.reload_for_tests()

    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(settings, "sglang_plugin_enabled", broken)
    try:
        plugin.register()  # must not raise
        assert plugin.status["registered"] is False
        assert "boom" in plugin.status["reason"]
        assert "plugin not active" in caplog.text
    finally:
        plugin.status.update(saved)


@pytest.mark.gpu
@pytest.mark.parametrize("disable", ["0", "1"], ids=["kernel", "jit-disabled"])
def test_every_cell_bit_exact_on_gpu(upstream, standin, disable):
    proc, records = _run_cells(standin, "transfer", env={"SGLANG_HICACHE_JIT_DISABLE": disable})
    assert records, proc.stderr[-3000:]
    failures = _cell_failures(records)
    assert not failures, "\n".join(failures)
    assert records[-1]["summary"] == {"cells": 57, "failed": 0}
    paths = {p for r in records if "path" in r for p in r["path"].values()}
    assert paths == ({"direct"} if disable == "1" else {"kernel"}), paths


@pytest.mark.parametrize("env, active", [({}, True), ({"SGLANG_HICACHE_JIT_SGLANG_PLUGIN": "0"}, False),
                                         ({"SGLANG_PLUGINS": "someone_else"}, False),
                                         ({"SGLANG_PLUGINS": "someone_else,hicache_jit"}, True),
                                         ({"SGLANG_PLUGINS": " hicache_jit ,"}, True),
                                         # SGLang reads a set but blank whitelist as "none": so does info
                                         ({"SGLANG_PLUGINS": " "}, False), ({"SGLANG_PLUGINS": ","}, False),
                                         ({"SGLANG_PLUGINS": ",,"}, False)])
def test_info_says_whether_sglang_will_run_the_plugin(upstream, installed, monkeypatch, env, active):
    from sglang_hicache_jit.integrations import sglang as plugin

    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    described = plugin.describe()
    assert described["entry_point"] == "hicache_jit"  # the package is installed, not just on the path
    assert described["sglang"] == installed and described["loads_plugins"] is True
    assert described["active"] is active, described["line"]
    assert described["line"].startswith("active" if active else ("off" if "SGLANG_HICACHE_JIT_SGLANG_PLUGIN" in env else "skipped"))
    if active:
        assert described["release"]["sglang"] == installed and "routes 21 ops and 12 pool methods" in described["line"]


def test_plugin_stands_aside_on_a_non_cuda_torch(upstream, monkeypatch, caplog):
    import torch

    from sglang_hicache_jit.integrations import sglang as plugin

    saved = dict(plugin.status)
    plugin.reload_for_tests()
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    try:
        plugin.register()
        assert plugin.status["registered"] is False and plugin.status["patched"] == []
        assert "not a CUDA build" in plugin.status["reason"]
    finally:
        plugin.status.update(saved)


def test_a_hook_sglang_refuses_leaves_its_registry_as_it_was(upstream, monkeypatch, caplog):
    """Issue 26 (M1), against the installed SGLang's own HookRegistry: the third hook is refused, and the two
    registered before it are taken out of the registry again, so the log's "SGLang runs unchanged" is true."""
    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_hicache_jit.integrations import sglang as plugin

    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "13.0")
    monkeypatch.delenv("SGLANG_HICACHE_JIT_SGLANG_PLUGIN", raising=False)
    before = {target: list(entries) for target, entries in HookRegistry._hooks.items()}
    real = HookRegistry.register.__func__
    calls = []

    def refuse_the_third(cls, target, hook, *args, **kwargs):
        calls.append(target)
        if len(calls) == 3:
            raise TypeError("refused by this test")
        return real(cls, target, hook, *args, **kwargs)

    monkeypatch.setattr(HookRegistry, "register", classmethod(refuse_the_third))
    saved = dict(plugin.status)
    plugin.reload_for_tests()
    try:
        plugin.register()
        assert len(calls) == 3
        assert {t: e for t, e in HookRegistry._hooks.items() if e} == {t: e for t, e in before.items() if e}
        assert plugin.status["patched"] == [] and "refused by this test" in plugin.status["reason"]
        assert "the 2 hooks registered before it were withdrawn" in caplog.text
        plugin.register()  # a second entry point: nothing more
        assert len(calls) == 3
    finally:
        HookRegistry._hooks.clear()
        HookRegistry._hooks.update(before)
        plugin.reload_for_tests()
        plugin.status.update(saved)
