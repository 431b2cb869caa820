"""Real builds with nvcc for arch 9.0 (no GPU needed): the loader's contract.

Marked ``build``; skipped when no CUDA toolkit is installed. The default run
keeps the tests that share the session's one build; those that need builds
of their own are also marked ``slow``.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleet_helpers import warm_load
from sglang_hicache_jit.buildcache import spec as spec_module
from sglang_hicache_jit.buildcache.arch import parse_arch_list
from sglang_hicache_jit.errors import BuildFailedError
from sglang_hicache_jit.buildcache.loader import ensure_built

pytestmark = [pytest.mark.build]
ROOT = Path(__file__).resolve().parent.parent
ARCH = "9.0"


def _env(cache: Path, **extra) -> dict:
    env = dict(os.environ, SGLANG_HICACHE_JIT_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT), **extra)
    env.pop("SGLANG_HICACHE_JIT_ARCH", None)
    return env


def _cli(*args, env, timeout=300, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "sglang_hicache_jit", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def _prewarm_json(env, **kw):
    out = _cli("prewarm", "--arch", ARCH, "--json", env=env, **kw)
    assert out.returncode == 0, out.stdout + out.stderr
    document = json.loads(out.stdout)
    assert document["schema"] == 1 and document["ok"] is True
    (record,) = document["results"]
    return record


def test_prewarm_then_warm_load_runs_no_subprocess(session_cache):
    env = _env(session_cache)
    out = _cli("prewarm", "--arch", ARCH, "--json", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    (record,) = json.loads(out.stdout)["results"]
    assert record["action"] in ("built", "cached") and record["kernel"] == "hicache_transfer"
    assert Path(record["path"], "manifest.json").is_file()
    if record["action"] == "built":  # the first build of the session: its progress was shown, its log kept
        steps = re.findall(r"compiling hicache_transfer for sm90: \[(\d+)/(\d+)\]", out.stderr)
        assert steps and steps[-1][0] == steps[-1][1], out.stderr
        kept = Path(record["path"], "build.log")
        assert out.stderr.rstrip().endswith(f"build log: {kept}") and kept.is_file(), out.stderr
    # A fresh process loads the published library without ninja, nvcc or any subprocess, and without
    # importing what only a build needs (fleet_helpers.WARM_LOAD).
    loaded = warm_load(env, "real")
    assert loaded["imported"] == []
    assert loaded["path"] == str(Path(record["path"]) / json.load(open(Path(record["path"], "manifest.json")))["library"])


@pytest.mark.slow  # a second real build (8.0)
def test_two_arch_builds_load_side_by_side_in_one_process(session_cache):
    out = _cli("check", "--arch", "8.0;9.0", env=_env(session_cache))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("ok: built and loadable") == 2


@pytest.mark.slow  # a build of its own, 8 processes importing torch
def test_eight_concurrent_prewarms_build_once(tmp_path):
    env = _env(tmp_path / "cache")
    procs = [subprocess.Popen([sys.executable, "-m", "sglang_hicache_jit", "prewarm", "--arch", ARCH, "--json"],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(8)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-2000:] for r in results]
    actions = sorted(json.loads(out)["results"][0]["action"] for out, _ in results)
    assert actions.count("built") == 1, actions
    assert set(actions) <= {"built", "waited", "cached"}
    assert len({json.loads(out)["results"][0]["path"] for out, _ in results}) == 1


@pytest.mark.slow  # one and a half builds of its own
def test_sigkilled_builder_does_not_wedge_the_next_one(tmp_path):
    cache = tmp_path / "cache"
    env = _env(cache)
    victim = subprocess.Popen([sys.executable, "-m", "sglang_hicache_jit", "prewarm", "--arch", ARCH],
                              env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(cache.glob("v1/.staging/*/entry/build.log")):
        time.sleep(0.05)
    time.sleep(1.0)  # well inside the compile
    assert victim.poll() is None, "the build finished before it could be killed; nothing tested"
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    started = time.monotonic()
    record = _prewarm_json(env, timeout=120)
    assert record["action"] == "built"
    assert time.monotonic() - started < 60


@pytest.mark.slow  # two builds of its own
def test_truncated_library_is_rebuilt_not_loaded(tmp_path):
    env = _env(tmp_path / "cache")
    first = _prewarm_json(env)
    manifest = json.loads(Path(first["path"], "manifest.json").read_text())
    library = Path(first["path"], manifest["library"])
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 2])
    second = _prewarm_json(env)
    assert second["action"] == "built" and second["path"] == first["path"]
    assert library.stat().st_size == manifest["size"]


@pytest.mark.slow  # two real builds of its own (9-17 s); test_cache.py's same_size test runs the same path in 0.1 s
def test_same_size_corruption_is_rebuilt_by_load_kernels(tmp_path):
    # The warm path hashes the library once, on the descriptor it loads (the lookup checks only its
    # size); a mismatch there must still lead to a rebuild, not to a failure or a load.
    env = _env(tmp_path / "cache")
    first = _prewarm_json(env)
    manifest = json.loads(Path(first["path"], "manifest.json").read_text())
    library = Path(first["path"], manifest["library"])
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF
    library.write_bytes(bytes(data))
    load = ("import torch\nfrom sglang_hicache_jit import load_kernels\n"
            "print(load_kernels('9.0').path)\n")
    out = subprocess.run([sys.executable, "-c", load], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == str(library)
    assert "built again" in out.stderr
    assert library.read_bytes() != bytes(data)


def test_failed_build_is_remembered_until_cleaned(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(spec_module, "CUDA_FLAGS", spec_module.CUDA_FLAGS + ("--no-such-nvcc-flag",))
    # The binding's compile fails at once too, instead of compiling for a second beside the failed nvcc steps.
    monkeypatch.setattr(spec_module, "CXX_FLAGS", spec_module.CXX_FLAGS + ("--no-such-cxx-flag",))
    archs = parse_arch_list(ARCH)
    with pytest.raises(BuildFailedError) as first:
        ensure_built(archs)
    log = Path(first.value.log_path)
    assert "no-such-nvcc-flag" in log.read_text()
    started = time.monotonic()
    with pytest.raises(BuildFailedError, match="failed earlier") as second:
        ensure_built(archs)
    assert time.monotonic() - started < 1.0 and second.value.log_path == str(log)
    out = _cli("clean", "--failed", env=_env(tmp_path / "cache"))
    assert out.returncode == 0 and not log.exists()


@pytest.mark.slow  # a build (compile and failing link) of its own
def test_unresolved_symbol_fails_the_build_not_the_load(tmp_path, monkeypatch):
    # The builder no longer loads the library (that meant importing torch); the link refuses
    # undefined symbols instead (-z defs). Without libtorch_cuda the binding's
    # aoti_torch_get_current_cuda_stream has no definition.
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(spec_module, "LIBRARIES", tuple(n for n in spec_module.LIBRARIES if n != "torch_cuda"))
    with pytest.raises(BuildFailedError) as failed:
        ensure_built(parse_arch_list(ARCH))
    assert "undefined reference" in Path(failed.value.log_path).read_text()


@pytest.mark.slow  # a build of its own
def test_build_child_imports_no_torch(tmp_path):
    # Importing torch cost the build child 1.5-3 s on a 2-core machine, as long as the compile itself.
    env = _env(tmp_path / "cache")
    env["PYTHONPROFILEIMPORTTIME"] = "1"  # every Python process of the build writes its imports to stderr
    record = _prewarm_json(env)
    log = Path(record["path"], "build.log").read_text()
    assert "import time:" in log, "the compile child's imports were not recorded"
    imported = {line.rsplit("|", 1)[1].strip() for line in log.splitlines() if line.startswith("import time:")}
    assert "json" in imported and "torch" not in imported


@pytest.mark.slow  # pip wheel, then a build of its own
def test_wheel_install_carries_the_kernel_sources(tmp_path):
    # Built from a copy: setuptools writes build/ and *.egg-info into the tree it builds, and tests leave the
    # checkout as they found it.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                                               ".hypothesis", ".pytest_cache", ".venv", ".whl"))
    dist = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist),
                            str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = dist.glob("sglang_hicache_jit-*.whl")
    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    env = dict(_env(tmp_path / "cache"), PYTHONPATH=str(site))
    where = subprocess.run([sys.executable, "-c", "from sglang_hicache_jit.buildcache.spec import kernels_dir; print(kernels_dir())"],
                           env=env, cwd=tmp_path, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()) == site / "sglang_hicache_jit" / "kernels"
    record = _prewarm_json(env, cwd=tmp_path)
    assert record["action"] == "built"
