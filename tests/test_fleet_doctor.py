"""doctor: every check has a status, problems have fixes, exit 1 on any problem."""

import json
import os

from fleet_helpers import cli, env_for, fake_entry
from sglang_hicache_jit.buildcache import doctor, toolchain
from sglang_hicache_jit.buildcache.cache import BuildCache


def _by_name(report: dict) -> dict:
    return {c["name"]: c for c in report["checks"]}


def test_json_report_and_exit_code(tmp_path):
    out = cli("doctor", "--arch", "9.0", "--json", env=env_for(tmp_path / "cache"))
    report = json.loads(out.stdout)
    checks = _by_name(report)
    assert {"settings", "torch", "nvcc", "CUDA versions", "ninja", "host compiler", "arch 9.0", "cache directory",
            "free space", "locks", "failed builds"} <= set(checks)
    assert all(c["status"] in ("ok", "problem", "skip") for c in report["checks"])
    assert all(c["fix"] for c in report["checks"] if c["status"] == "problem")
    assert out.returncode == (0 if report["ok"] else 1)


def test_problems_are_reported_with_fixes(tmp_path, monkeypatch):
    cache = BuildCache(tmp_path / "cache")
    fake_entry(cache)
    cache.record_failure("sm80", "hicache_transfer", "0" * 16, "nvcc said no", "log")
    os.chmod(cache.root, 0o775)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(cache.root))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_LOCK_TIMEOUT", "soon")
    monkeypatch.setenv("SGLANG_HICACHE_JIT_PREBUILT_DIRS", str(tmp_path / "no-such-layer"))
    checks = {c.name: c for c in doctor.run_checks("9.0")}
    assert checks["settings"].status == "problem" and "LOCK_TIMEOUT" in checks["settings"].detail
    assert checks["cache directory"].status == "problem" and "chmod go-w" in checks["cache directory"].fix
    assert checks["failed builds"].status == "problem" and "clean --failed" in checks["failed builds"].fix
    assert checks[f"prebuilt {tmp_path / 'no-such-layer'}"].status == "problem"
    text = doctor.format_checks(list(checks.values()))
    assert "PROBLEM" in text and "fix: " in text and "problems found" in text


def test_cache_on_nfs_without_a_lock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(doctor, "filesystem_type", lambda path: "nfs4")
    checks = {c.name: c for c in doctor.run_checks("9.0")}
    assert checks["locks"].status == "problem" and "SGLANG_HICACHE_JIT_LOCK_DIR" in checks["locks"].fix
    (tmp_path / "cache").mkdir()
    (tmp_path / "locks").mkdir()
    monkeypatch.setenv("SGLANG_HICACHE_JIT_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setattr(doctor, "filesystem_type", lambda path: "nfs4" if path == tmp_path / "cache" else "ext4")
    assert {c.name: c for c in doctor.run_checks("9.0")}["locks"].status == "ok"


def test_without_nvcc_prebuilt_archs_are_fine_and_missing_ones_are_problems(tmp_path, monkeypatch):
    cache = BuildCache(tmp_path / "cache")
    fake_entry(cache)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(cache.root))
    monkeypatch.setattr(toolchain, "find_toolkit", lambda: None)
    monkeypatch.setattr(toolchain, "_candidates", lambda: [])
    toolchain._find_toolkit_cached.cache_clear()
    try:
        checks = {c.name: c for c in doctor.run_checks("9.0")}
        assert checks["nvcc"].status == "ok" and "not needed" in checks["nvcc"].detail
        assert checks["arch 9.0"].status == "ok"
        checks = {c.name: c for c in doctor.run_checks("8.0")}
        assert checks["nvcc"].status == "problem" and checks["nvcc"].fix
        assert checks["arch 8.0"].status == "problem" and "import a bundle" in checks["arch 8.0"].fix
    finally:
        toolchain._find_toolkit_cached.cache_clear()


def test_arch_nvcc_cannot_target(tmp_path, monkeypatch):
    if toolchain.find_toolkit() is None:  # the check needs nvcc's list; without nvcc the test above covers it
        monkeypatch.setattr(toolchain, "find_toolkit", lambda: None)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
    checks = {c.name: c for c in doctor.run_checks("3.0")}
    assert checks["arch 3.0"].status == "problem"
