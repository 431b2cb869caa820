"""Adversarial: faults (killed builders, transient failures, bundle bombs), reproducible
bundles, and the container recipe tried as an unprivileged user."""

import io
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from adversarial_helpers import NOBODY, as_user, cli_env, needs_root, public_tmp, skip_unless_user_can_run_here  # noqa: F401
from fleet_helpers import ROOT, cli, env_for, fake_entry, snapshot
from sglang_hicache_jit.buildcache import bundle as bundle_module
from sglang_hicache_jit.buildcache import loader
from sglang_hicache_jit.buildcache.arch import parse_arch_list
from sglang_hicache_jit.buildcache.bundle import export_bundle, import_bundle
from sglang_hicache_jit.buildcache.cache import BuildCache
from sglang_hicache_jit.errors import BuildFailedError, BundleError
from sglang_hicache_jit.buildcache.toolchain import find_toolkit

ARCHS = parse_arch_list("9.0")
needs_toolkit = pytest.mark.skipif(find_toolkit() is None, reason="needs the CUDA toolkit (nvcc)")


# ---- killed builders ---------------------------------------------------------------------------------

def _stale_builder(cache: BuildCache, entry_name: str, tmp_path: Path):
    """A staging directory left by a builder that died (dead pid on this host), with a compiler
    process (a sleep standing in for nvcc, in a process group of its own as ninja makes them)
    still working inside it."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    staging = cache.layout_root / ".staging" / f"{entry_name}.{socket.gethostname()}.{dead.pid}.dead"
    (staging / "build").mkdir(parents=True)
    orphan = subprocess.Popen(["sleep", "300"], cwd=staging / "build", start_new_session=True)
    bystander = subprocess.Popen(["sleep", "300"], cwd=tmp_path, start_new_session=True)  # not ours: must live
    return staging, orphan, bystander


def _gone(proc: subprocess.Popen, seconds: float = 5.0) -> bool:
    try:
        proc.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_the_next_builder_reaps_a_dead_builders_staging_and_compiler(tmp_path):
    from sglang_hicache_jit.buildcache.prune import reap_stale_staging

    cache = BuildCache(tmp_path / "cache")
    cache.ensure_root()
    name = "hicache_transfer-" + "a" * 16
    staging, orphan, bystander = _stale_builder(cache, name, tmp_path)
    other_entry, other_orphan, _ = _stale_builder(cache, "hicache_transfer-" + "b" * 16, tmp_path)
    try:
        reap_stale_staging(cache, name)
        assert _gone(orphan), "the dead builder's compiler is still running"
        assert not staging.exists()
        assert other_entry.exists() and other_orphan.poll() is None  # another entry's: prune's business
        assert bystander.poll() is None
    finally:
        for proc in (orphan, bystander, other_orphan):
            proc.kill()
            proc.wait()


def test_prune_also_kills_what_a_dead_builder_left(tmp_path):
    from sglang_hicache_jit.buildcache.prune import prune

    cache = BuildCache(tmp_path / "cache")
    cache.ensure_root()
    staging, orphan, bystander = _stale_builder(cache, "hicache_transfer-" + "c" * 16, tmp_path)
    try:
        prune(cache, stale=False)
        assert _gone(orphan) and not staging.exists() and bystander.poll() is None
    finally:
        for proc in (orphan, bystander):
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.build
def test_sigkill_of_a_builder_takes_its_compiler_down(tmp_path):
    """A real build, its builder SIGKILLed while nvcc runs: no compiler may survive it."""
    env = env_for(tmp_path / "cache")
    builder = subprocess.Popen([sys.executable, "-m", "sglang_hicache_jit", "prewarm", "--arch", "8.0"], env=env,
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staging_root = tmp_path / "cache" / "v1" / ".staging"

    def compilers():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.readlink(f"/proc/{pid}/cwd").startswith(str(staging_root)):
                    found.append(int(pid))
            except OSError:
                pass
        return found

    deadline = time.time() + 60
    while time.time() < deadline and not any(
            b"nvcc" in Path(f"/proc/{p}/cmdline").read_bytes() or b"ninja" in Path(f"/proc/{p}/cmdline").read_bytes()
            for p in compilers() if Path(f"/proc/{p}/cmdline").exists()):
        time.sleep(0.1)
    assert time.time() < deadline, "the compile never started"
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    deadline = time.time() + 3  # the compile itself would go on for several more seconds
    while compilers() and time.time() < deadline:
        time.sleep(0.1)
    assert compilers() == [], "compiler processes outlived their builder"


# ---- transient failures are retried ------------------------------------------------------------------

@needs_toolkit
def test_a_killed_compile_is_recorded_as_transient_and_retried(tmp_path, monkeypatch):
    from sglang_hicache_jit.buildcache import build

    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
    killer = tmp_path / "compile.py"
    calls = tmp_path / "calls"
    killer.write_text(f"import os, signal\nopen({str(calls)!r}, 'a').write('x')\n"
                      "os.kill(os.getpid(), signal.SIGKILL)\n")
    monkeypatch.setattr(build, "_COMPILE_SCRIPT", killer)
    with pytest.raises(BuildFailedError) as info:
        loader.ensure_built(ARCHS)
    assert info.value.transient and "killed by signal 9" in info.value.reason
    assert "next call builds again" in info.value.fix
    record = json.loads(next((tmp_path / "cache" / "v1").glob("*/*.failed.json")).read_text())
    assert record["cause"] == "killed" and record["transient"] is True
    with pytest.raises(BuildFailedError) as info:
        loader.ensure_built(ARCHS)
    assert "failed earlier" not in info.value.reason and calls.read_text() == "xx"  # it compiled again
    assert list((tmp_path / "cache" / "v1" / ".staging").iterdir()) == [], "staging directories were left behind"


@needs_toolkit
def test_a_compile_error_is_remembered_but_a_full_disk_is_not(tmp_path, monkeypatch):
    from sglang_hicache_jit.buildcache import build

    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
    calls = tmp_path / "calls"
    script = tmp_path / "compile.py"
    monkeypatch.setattr(build, "_COMPILE_SCRIPT", script)
    for message, transient in (("nvcc fatal: No space left on device", True), ("error: expected ';'", False)):
        script.write_text(f"import sys\nopen({str(calls)!r}, 'a').write('x')\nprint({message!r})\nsys.exit(1)\n")
        with pytest.raises(BuildFailedError) as info:
            loader.ensure_built(ARCHS)
        assert info.value.transient is transient
    count = len(calls.read_text())
    with pytest.raises(BuildFailedError, match="failed earlier"):  # the compile error is final: no new compile
        loader.ensure_built(ARCHS)
    assert len(calls.read_text()) == count


# ---- bundle bombs --------------------------------------------------------------------------------------

@pytest.fixture
def bundle_parts(tmp_path, monkeypatch):
    """(members of a real one-entry bundle, target cache)."""
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "source"))
    fake_entry(BuildCache(tmp_path / "source"))
    bundle = tmp_path / "b.tar.gz"
    export_bundle([ARCHS], str(bundle))
    with tarfile.open(bundle, "r:gz") as tar:
        members = [(m, tar.extractfile(m).read() if m.isreg() else b"") for m in tar.getmembers()]
    target = tmp_path / "target"
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(target))
    return members, target


def _pack(path: Path, members, fmt=tarfile.PAX_FORMAT) -> Path:
    with tarfile.open(path, "w:gz", format=fmt) as tar:
        for info, data in members:
            if info.isreg():
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return path


def test_a_size_bomb_is_refused_before_anything_is_written(bundle_parts, tmp_path, monkeypatch):
    members, target = bundle_parts
    bomb = []
    for info, data in members:
        if info.name.endswith(".so"):
            data = bytes(64 << 20)  # 64 MB of zeros: ~64 KB compressed; the manifest says 4 KB
        bomb.append((info, data))
    path = _pack(tmp_path / "bomb.tar.gz", bomb)
    assert path.stat().st_size < 1 << 20
    unpacked = []
    real_unpack = bundle_module._unpack
    monkeypatch.setattr(bundle_module, "_unpack", lambda *a: unpacked.append(1) or real_unpack(*a))
    with pytest.raises(BundleError, match="its manifest says") as info:
        import_bundle(str(path))
    assert info.value.code == "bundle_corrupt" and unpacked == [], "bytes were unpacked before the size check"
    assert snapshot(target) == {}


def test_a_huge_pax_header_is_refused_without_reading_it(bundle_parts, tmp_path):
    members, target = bundle_parts
    info, data = next((m, d) for m, d in members if m.name.endswith(".so"))
    info.pax_headers = {"comment": "x" * (8 << 20)}  # 8 MB header: valid PAX, read whole by tarfile
    path = _pack(tmp_path / "pax.tar.gz", members)
    with pytest.raises(BundleError, match="extended header") as exc:
        import_bundle(str(path))
    assert exc.value.code == "bundle_unsafe" and snapshot(target) == {}


def test_a_huge_gnu_long_name_is_refused(bundle_parts, tmp_path):
    members, target = bundle_parts
    info = tarfile.TarInfo("v1/" + "a" * (1 << 20))
    info.size = 1
    path = _pack(tmp_path / "gnu.tar.gz", members + [(info, b"x")], fmt=tarfile.GNU_FORMAT)
    with pytest.raises(BundleError, match="extended header"):
        import_bundle(str(path))
    assert snapshot(target) == {}


def test_tarfiles_data_filter_is_a_second_guard(bundle_parts, tmp_path, monkeypatch):
    if not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python has no tarfile data filter")
    members, target = bundle_parts
    path = _pack(tmp_path / "ok.tar.gz", members)
    seen = []

    def refusing_filter(member, dest):
        seen.append(member.name)
        raise tarfile.FilterError(f"{member.name} refused")

    monkeypatch.setattr(tarfile, "data_filter", refusing_filter)
    with pytest.raises(BundleError, match="data filter"):
        import_bundle(str(path))
    assert seen and snapshot(target) == {}


# ---- reproducible bundles ------------------------------------------------------------------------------

def test_two_exports_an_hour_apart_are_byte_identical(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
    fake_entry(BuildCache(tmp_path / "cache"))
    fake_entry(BuildCache(tmp_path / "cache"), "8.0")
    first, second = tmp_path / "one.tar.gz", tmp_path / "two" / "two.tar.gz"
    export_bundle([parse_arch_list("9.0"), parse_arch_list("8.0")], str(first))
    # An hour later, without waiting for it: the clock and every file time of the cache move on.
    later = time.time() + 3600
    monkeypatch.setattr(time, "time", lambda: later)
    monkeypatch.setattr(time, "time_ns", lambda: int(later * 1e9))
    for dirpath, _, files in os.walk(tmp_path / "cache"):
        for name in files + [""]:
            os.utime(os.path.join(dirpath, name), (later, later))
    export_bundle([parse_arch_list("8.0"), parse_arch_list("9.0")], str(second))  # another order, too
    assert first.read_bytes() == second.read_bytes()
    with tarfile.open(first, "r:gz") as tar:
        index = json.loads(tar.extractfile("bundle.json").read())
        assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and not m.uname for m in tar.getmembers())
    assert "created" not in index and "host" not in index


# ---- the container recipe, as an unprivileged user ----------------------------------------------------

def _recipe_layer(public_tmp: Path) -> Path:
    """docs/operators.md: export, `import --into` a layer, `chmod -R a-w` (all as root)."""
    env = env_for(public_tmp / "build-cache")
    fake_entry(BuildCache(public_tmp / "build-cache"))
    out = cli("export", "--arch", "9.0", "-o", str(public_tmp / "hicache.tar.gz"), env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    layer = public_tmp / "opt" / "hicache-prebuilt"
    out = cli("import", str(public_tmp / "hicache.tar.gz"), "--into", str(layer), env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    subprocess.run(["chmod", "-R", "a-w", str(layer)], check=True)
    return layer


_LOAD = ("from sglang_hicache_jit.buildcache.loader import ensure_built\nfrom sglang_hicache_jit.buildcache.arch import parse_arch_list\n"
         "try:\n    print(ensure_built(parse_arch_list('9.0'), build=False).action)\n"
         "except Exception as exc:\n    print(type(exc).__name__, getattr(exc, 'code', ''))\n")


@needs_root
def test_the_container_recipe_layer_is_readable_by_others_and_writable_by_none(public_tmp):
    layer = _recipe_layer(public_tmp)
    for dirpath, dirs, files in os.walk(layer):
        for path in [dirpath] + [os.path.join(dirpath, f) for f in files]:
            mode = stat.S_IMODE(os.lstat(path).st_mode)
            assert mode & 0o444 == 0o444 and mode & 0o222 == 0, (path, oct(mode))
        assert ".staging" not in dirs and ".locks" not in dirs and ".trash" not in dirs, dirpath
    user_cache = public_tmp / "user-cache"
    user_cache.mkdir()
    os.chown(user_cache, NOBODY, NOBODY)
    env = cli_env(user_cache, SGLANG_HICACHE_JIT_PREBUILT_DIRS=layer)
    out = as_user(NOBODY, "-c", _LOAD, env=env)
    assert out.stdout.strip() == "prebuilt", out.stdout + out.stderr
    out = as_user(NOBODY, "doctor", "--arch", "9.0", env=env)
    assert "Traceback" not in out.stderr, out.stderr
    assert f"ok      prebuilt {layer}" in out.stdout, out.stdout


@needs_root
def test_an_unreadable_layer_is_skipped_with_a_warning_and_reported_by_doctor(public_tmp):
    layer = _recipe_layer(public_tmp)
    os.chmod(layer / "v1", 0o500)  # like the old recipe: private to root, then a-w
    user_cache = public_tmp / "user-cache"
    user_cache.mkdir()
    os.chown(user_cache, NOBODY, NOBODY)
    env = cli_env(user_cache, SGLANG_HICACHE_JIT_PREBUILT_DIRS=layer)
    out = as_user(NOBODY, "-c", _LOAD, env=env)
    assert out.stdout.strip() == "NotBuiltError not_built", out.stdout + out.stderr
    assert "prebuilt layer" in out.stderr and "skipped" in out.stderr and "Traceback" not in out.stderr
    out = as_user(NOBODY, "doctor", "--arch", "9.0", env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"PROBLEM prebuilt {layer}" in out.stdout and "cannot be read by this user" in out.stdout, out.stdout


@needs_root
@pytest.mark.slow
@pytest.mark.build
def test_the_container_recipe_with_a_real_build_checks_ok_as_another_user(session_cache, public_tmp):
    env = env_for(session_cache)
    out = cli("export", "--arch", "9.0", "-o", str(public_tmp / "real.tar.gz"), env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    layer = public_tmp / "layer"
    assert cli("import", str(public_tmp / "real.tar.gz"), "--into", str(layer), env=env).returncode == 0
    subprocess.run(["chmod", "-R", "a-w", str(layer)], check=True)
    user_cache = public_tmp / "user-cache"
    user_cache.mkdir()
    os.chown(user_cache, NOBODY, NOBODY)
    out = as_user(NOBODY, "check", "--arch", "9.0", "--no-build",
                  env=cli_env(user_cache, SGLANG_HICACHE_JIT_PREBUILT_DIRS=layer), timeout=300)
    assert out.returncode == 0 and "9.0        ok: built and loadable" in out.stdout, out.stdout + out.stderr


@needs_root
def test_a_user_who_cannot_read_the_checkout_skips_the_test_naming_why(tmp_path):
    """Issue 18: with the checkout (or venv) in a home private to root, the tests that run a child as
    `nobody` failed with PermissionError (the child reads the kernel sources after dropping its
    privileges), and the README's test command exited 1 for root."""
    home = tmp_path / "home"  # a private home: mode 0700, owned by root
    home.mkdir(mode=0o700)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "sglang_hicache_jit", home / "sglang_hicache_jit", ignore=ignore)
    shutil.copytree(ROOT / "kernels", home / "kernels", ignore=ignore)
    with pytest.raises(pytest.skip.Exception) as info:
        skip_unless_user_can_run_here(NOBODY, root=home)
    assert f"uid {NOBODY} cannot use this interpreter" in str(info.value)
    assert f"Permission denied: {home}" in str(info.value) and "0700" in str(info.value)
    skip_unless_user_can_run_here(NOBODY)  # this checkout is readable by everyone: no skip


# ---- issue 18, T6: a CC with non-UTF-8 bytes ------------------------------------------------------------
# The compile child failed writing build.ninja (UnicodeEncodeError) and the failed build's message
# carried that traceback; it was even remembered as a final compile error.

def test_t6_build_ninja_keeps_non_utf8_bytes_of_paths_and_cc(tmp_path):
    from sglang_hicache_jit.buildcache import _compile

    cc = os.fsdecode(b"/opt/gcc\xff")  # how Python reads such a variable from the environment
    request = {"name": "x", "library": "x.so", "build_dir": str(tmp_path), "link": ["c++", "-o", "x.so"],
               "steps": [{"input": os.fsdecode(b"/src/\xfe.cu"), "output": "a.o", "command": ["nvcc", "-ccbin", cc]}]}
    path = _compile.write_ninja(request)
    data = Path(path).read_bytes()
    assert b"-ccbin '/opt/gcc\xff'" in data and b"/src/\xfe.cu" in data


@pytest.mark.build
def test_t6_a_cc_that_is_not_a_compiler_is_a_toolchain_error_line(tmp_path, monkeypatch, capsys):
    from adversarial_helpers import run_main

    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", os.fsdecode(b"/usr/bin/gcc\xff"))
    code, out, err = run_main(capsys, "prewarm", "--arch", "9.0")
    assert code == 1 and "Traceback" not in out + err and "UnicodeEncodeError" not in out + err, out + err
    assert "failed [no_cxx]: CC='/usr/bin/gcc\\udcff' (nvcc's host compiler" in out, out
    assert not list((tmp_path / "cache").glob("v1/*/*.failed.json")), "remembered as a final compile error"
    code, out, err = run_main(capsys, "doctor", "--arch", "9.0")
    assert "PROBLEM CC" in out and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.build
def test_t6_a_cc_whose_path_is_not_utf8_builds(tmp_path):
    compiler = Path(os.fsdecode(bytes(tmp_path) + b"/gcc\xff"))
    compiler.symlink_to(shutil.which("gcc"))
    env = env_for(tmp_path / "cache", CC=compiler)
    out = subprocess.run([sys.executable, "-m", "sglang_hicache_jit", "prewarm", "--arch", "9.0"], env=env, cwd=ROOT,
                         capture_output=True, timeout=600)
    assert out.returncode == 0, out.stdout.decode(errors="replace") + out.stderr.decode(errors="replace")
    log = next((tmp_path / "cache").glob("v1/sm90/*/build.log")).read_bytes()
    assert b"-ccbin " + bytes(tmp_path) + b"/gcc\xff" in log.replace(b"'", b"")


# ---- issue 18: a check that races clean ---------------------------------------------------------------
# The entry found by the look was removed before the load: check reported it as CorruptEntry
# (load_failed) instead of "not built".

def _race_env(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(root))
    for name in ("SGLANG_HICACHE_JIT_PREBUILT_DIRS", "SGLANG_HICACHE_JIT_LOCK_DIR"):
        monkeypatch.delenv(name, raising=False)
    fake_entry(BuildCache(root))
    return BuildCache(root)


def test_a_check_racing_clean_between_look_and_load_says_not_built(tmp_path, monkeypatch, capsys):
    from adversarial_helpers import run_main
    from sglang_hicache_jit.buildcache.prune import clean

    cache = _race_env(tmp_path, monkeypatch)
    real, looks = loader.ensure_built, []

    def look_then_clean(*args, **kwargs):
        result = real(*args, **kwargs)
        looks.append(result.action)
        if len(looks) == 1:
            clean(cache)  # another process's `clean`, right after this look
        return result

    monkeypatch.setattr(loader, "ensure_built", look_then_clean)
    code, out, err = run_main(capsys, "check", "--arch", "9.0", "--no-build", "--json")
    record = json.loads(out)["results"][0]
    assert code == 1 and record["code"] == "not_built", record
    assert "CorruptEntry" not in out + err and "load_failed" not in out


def test_a_lookup_racing_clean_finds_nothing_rather_than_a_corrupt_entry(tmp_path, monkeypatch, capsys, caplog):
    from adversarial_helpers import run_main
    from sglang_hicache_jit.buildcache.prune import clean

    cache = _race_env(tmp_path, monkeypatch)
    real = BuildCache.check_trust

    def check_then_clean(self, path):  # the entry passes the trust check, then goes before it is read
        real(self, path)
        if not self.prebuilt:
            clean(cache)

    monkeypatch.setattr(BuildCache, "check_trust", check_then_clean)
    code, out, err = run_main(capsys, "check", "--arch", "9.0", "--no-build", "--json")
    assert code == 1 and json.loads(out)["results"][0]["code"] == "not_built"
    assert "failed verification" not in caplog.text and "no manifest.json" not in caplog.text, caplog.text
