"""Every recorded SGLang release's own code, with this package installed (slow: a process per release).

For each release, its wheel (``pip download --no-deps``, checked against the
recorded sha256) is unpacked and put first on a child's path, with an
sgl_kernel stand-in carrying the signatures of the sglang-kernel it pins
(every op raising). The child runs SGLang's own ``load_plugins()``, which
finds this package through its installed entry point, and then:

* 0.5.16+: builds every pool of the cell matrix (tests/sglang_cells.py
  construct), checking that every hook registered on a pool's class finds
  every attribute it declares on the pools built, and that the device-pool
  stand-ins carry only attributes the release's own device pools define;
* 0.5.11-0.5.15: reports what it patched (their pools have no layer sharding);
* 0.5.10: has no plugin mechanism, so ``sglang-hicache-jit info`` must say so.

In every case the patches must be exactly those the planner derives from the
release's record (test_sglang_plan.py states those), and nothing may be
skipped. Without network access the wheels cannot be fetched and these tests
skip, unless SGLANG_HICACHE_JIT_REQUIRE_SGLANG=1 (set in CI). Without the
package's ``sglang`` extra (``pip install -e ".[test,sglang]"``), whose packages
SGLang's pool imports need, they skip and name it.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import release_kit
from sglang_hicache_jit.integrations.sglang.plan import RecordedFacts, plan

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
RELEASES = release_kit.recorded()
CELLS_FROM = release_kit.version_key("0.5.16")


def _mode(version: str) -> str:
    if not release_kit.record(version)["plugins"]:
        return "info"
    return "construct" if release_kit.version_key(version) >= CELLS_FROM else "plugin"


def _run(version: str, standins: Path) -> dict:
    try:
        tree = release_kit.release_tree(version)
    except (subprocess.CalledProcessError, OSError, LookupError) as exc:
        return {"unavailable": f"{type(exc).__name__}: {exc}"}
    standin = release_kit.write_standin(standins / version, version)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(standin), str(tree), str(HERE.parent)]),
               SGLANG_HICACHE_JIT_SGLANG_PLUGIN="1")
    env.pop("SGLANG_PLUGINS", None)
    mode = _mode(version)
    if mode == "info":
        args = [sys.executable, "-m", "sglang_hicache_jit", "info", "--json"]
    else:
        args = [sys.executable, str(HERE / "sglang_cells.py"), mode]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    if mode == "info":
        return {"rc": proc.returncode, "info": json.loads(proc.stdout) if proc.returncode == 0 else None,
                "stderr": proc.stderr[-3000:]}
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {"rc": proc.returncode, "records": lines, "stderr": proc.stderr[-3000:]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every release's child, two at a time (the imports are CPU-bound; CI has two cores)."""
    missing = release_kit.missing_sglang_extra()
    if missing:
        why = f"needs the sglang extra ({release_kit.SGLANG_EXTRA_HINT}); missing: {', '.join(missing)}"
        if os.environ.get("SGLANG_HICACHE_JIT_REQUIRE_SGLANG") == "1":
            pytest.fail(why)
        pytest.skip(why)
    standins = tmp_path_factory.mktemp("standins")
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(RELEASES, pool.map(lambda v: _run(v, standins), RELEASES)))


def _result(results, version):
    result = results[version]
    if "unavailable" in result:
        if os.environ.get("SGLANG_HICACHE_JIT_REQUIRE_SGLANG") == "1":
            pytest.fail(f"sglang {version} is required here but could not be fetched: {result['unavailable']}")
        pytest.skip(f"sglang {version} could not be fetched: {result['unavailable']}")
    return result


def _expected(version: str) -> set:
    rec = release_kit.record(version)
    return {f"{d.target.name} -> {d.path}"
            for d in plan(RecordedFacts(rec, release_kit.kernel_record(rec["sglang_kernel"]))) if d.patched}


@pytest.mark.parametrize("version", [v for v in RELEASES if _mode(v) != "info"])
def test_the_release_loads_the_plugin_and_gets_the_planned_patches(results, version):
    result = _result(results, version)
    assert result["records"], result["stderr"]
    header = result["records"][0]
    assert header["sglang"] == version
    assert header["plugin"]["registered"] is True, header
    assert header["skipped"] == []
    assert set(header["patched"]) == _expected(version)
    failures = [f"{r['cell']}: {r['error']}\n{r.get('trace', '')}" for r in result["records"]
                if "cell" in r and not r["ok"]]
    assert not failures, "\n".join(failures)
    assert result["rc"] == 0, result["stderr"]
    if _mode(version) == "construct":
        summary = result["records"][-1]["summary"]
        assert summary["failed"] == 0 and summary["cells"] >= 49


@pytest.mark.parametrize("version", [v for v in RELEASES if _mode(v) == "info"])
def test_info_says_a_release_without_plugins_cannot_load_it(results, version):
    result = _result(results, version)
    assert result["rc"] == 0, result["stderr"]
    described = result["info"]["sglang_plugin"]
    assert described["sglang"] == version and described["loads_plugins"] is False
    assert described["active"] is False
    assert "cannot load plugins" in described["line"] and "0.5.11" in described["line"]
