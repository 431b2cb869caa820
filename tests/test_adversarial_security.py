"""Adversarial: security holes. Each test tries the attack and checks it fails."""

import hashlib
import io
import json
import os
import re
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from adversarial_helpers import NOBODY, as_user, chown_tree, cli_env, make_user, needs_root, public_tmp  # noqa: F401
from fleet_helpers import ROOT, entry_dirs, env_for, fake_entry, snapshot
from sglang_hicache_jit.buildcache import loader
from sglang_hicache_jit.buildcache.arch import parse_arch_list
from sglang_hicache_jit.buildcache.bundle import export_bundle, import_bundle
from sglang_hicache_jit.buildcache.cache import BuildCache
from sglang_hicache_jit.errors import BundleError, HicacheJitError, NotBuiltError, UnsafeCacheError
from sglang_hicache_jit.buildcache.loader import ensure_built
from sglang_hicache_jit.buildcache.spec import BuildSpec

ARCHS = parse_arch_list("9.0")


# ---- 1. remote (file://) layers get the local trust rules -------------------------------------------

@pytest.mark.parametrize("bits", [0o002, 0o020])
def test_file_url_layer_writable_by_others_is_not_copied(tmp_path, monkeypatch, bits):
    layer, cache = tmp_path / "layer", tmp_path / "cache"
    entry = fake_entry(BuildCache(layer))
    os.chmod(entry.path, 0o755 | bits)  # another user could swap the library in
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(cache))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_PREBUILT_DIRS", f"file://{layer}")
    with pytest.raises(UnsafeCacheError) as info:
        ensure_built(ARCHS, build=False)
    assert info.value.code == "unsafe_cache" and str(entry.path) in info.value.reason
    assert entry_dirs(cache) == [], "the unsafe entry was copied into the private cache"


@needs_root
def test_file_url_layer_owned_by_another_user_is_not_copied(tmp_path, monkeypatch):
    layer, cache = tmp_path / "layer", tmp_path / "cache"
    fake_entry(BuildCache(layer))
    chown_tree(layer, NOBODY)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(cache))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_PREBUILT_DIRS", f"file://{layer}")
    with pytest.raises(UnsafeCacheError, match="neither root nor this user"):
        ensure_built(ARCHS, build=False)
    assert entry_dirs(cache) == []
    monkeypatch.setenv("SGLANG_HICACHE_JIT_TRUSTED_OWNERS", "nobody")  # the operator vouches for that user
    assert ensure_built(ARCHS, build=False).action == "fetched"


def test_a_safe_file_url_layer_is_still_copied(tmp_path, monkeypatch):
    layer, cache = tmp_path / "layer", tmp_path / "cache"
    fake_entry(BuildCache(layer))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(cache))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_PREBUILT_DIRS", f"file://{layer}")
    assert ensure_built(ARCHS, build=False).action == "fetched"


# ---- 2. the lock directory -----------------------------------------------------------------------------

def _lock_paths(cache: BuildCache):
    spec = BuildSpec.for_archs(ARCHS)
    key = spec.key("cuda-13.0-nvccL")
    return spec, key, f"{spec.arch_tag}-{spec.kernel}-{key}"


@needs_root
def test_planted_owner_link_in_another_users_lock_dir_is_never_written_through(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    locks = tmp_path / "locks"
    locks.mkdir(mode=0o755)
    cache = BuildCache(tmp_path / "cache")
    spec, key, name = _lock_paths(cache)
    (locks / f"{name}.owner").symlink_to(victim)
    os.lchown(locks / f"{name}.owner", NOBODY, NOBODY)
    os.chown(locks, NOBODY, NOBODY)  # another user made the shared lock directory first
    monkeypatch.setenv("SGLANG_HICACHE_JIT_LOCK_DIR", str(locks))
    with pytest.raises(UnsafeCacheError, match="lock directory") as info:
        with loader._build_lock(cache, spec, key):
            pass
    assert "SGLANG_HICACHE_JIT_LOCK_DIR" in info.value.fix
    assert victim.read_text() == "precious\n"


def test_holder_file_replaces_a_planted_link_instead_of_following_it(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    locks = tmp_path / "locks"
    locks.mkdir(mode=0o700)
    cache = BuildCache(tmp_path / "cache")
    spec, key, name = _lock_paths(cache)
    (locks / f"{name}.owner").symlink_to(victim)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_LOCK_DIR", str(locks))
    with loader._build_lock(cache, spec, key):
        owner = locks / f"{name}.owner"
        assert not owner.is_symlink() and json.loads(owner.read_text())["pid"] == os.getpid()
    assert victim.read_text() == "precious\n"


@needs_root
def test_a_second_user_sharing_a_lock_dir_gets_an_error_line(public_tmp):
    """Root made /tmp-like shared locks first; user nobody prunes its own cache with them."""
    locks = public_tmp / "locks"
    locks.mkdir()
    os.chmod(locks, 0o1777)
    cache = public_tmp / "cache"
    fake_entry(BuildCache(cache))
    chown_tree(cache, NOBODY)
    out = as_user(NOBODY, "prune", "--max-size", "0", env=cli_env(cache, SGLANG_HICACHE_JIT_LOCK_DIR=locks))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "error: [unsafe_cache] The lock directory" in out.stderr and "hicache-locks-$USER" in out.stderr
    assert len(entry_dirs(cache)) == 1  # nothing removed without its lock


# ---- 3. the manifest's fields --------------------------------------------------------------------------

def _rewrite_manifest(entry_path, **fields):
    manifest = json.loads((entry_path / "manifest.json").read_text())
    manifest.update(fields)
    (entry_path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("log_name", ["../../../secret", "/etc/hostname", "sub/build.log", ".hidden", 7])
def test_a_log_outside_the_entry_makes_the_entry_corrupt_and_is_never_exported(tmp_path, monkeypatch, log_name):
    secret = tmp_path / "secret"
    secret.write_text("API_KEY=hunter2\n")
    cache = BuildCache(tmp_path / "a" / "b" / "cache")
    entry = fake_entry(cache)
    _rewrite_manifest(entry.path, log=log_name if log_name != "../../../secret" else os.path.relpath(secret, entry.path))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(cache.root))

    def no_compiler(*a, **k):
        raise NotBuiltError("no compiler in this test", "-")

    monkeypatch.setattr(loader, "check_build_tools", no_compiler)
    out = tmp_path / "b.tar.gz"
    with pytest.raises(HicacheJitError):
        export_bundle([ARCHS], str(out))
    assert not out.exists()


def _bundle_with_manifest(tmp_path, monkeypatch, **fields):
    """A bundle of one fake entry whose manifest has ``fields`` changed, every checksum made consistent."""
    source = tmp_path / "source"
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(source))
    fake_entry(BuildCache(source))
    bundle = tmp_path / "b.tar.gz"
    export_bundle([ARCHS], str(bundle))
    with tarfile.open(bundle, "r:gz") as tar:
        members = [(m, tar.extractfile(m).read() if m.isreg() else b"") for m in tar.getmembers()]
    index_pos = next(i for i, (m, _) in enumerate(members) if m.name == "bundle.json")
    index = json.loads(members[index_pos][1])
    for i, (m, data) in enumerate(members):
        if m.name.endswith("/manifest.json"):
            manifest = dict(json.loads(data), **fields)
            data = json.dumps(manifest).encode()
            members[i] = (m, data)
            index["entries"][0]["files"]["manifest.json"] = hashlib.sha256(data).hexdigest()
    members[index_pos] = (members[index_pos][0], json.dumps(index).encode())
    out = tmp_path / "tampered.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    target = tmp_path / "target"
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(target))
    return out, target


@pytest.mark.parametrize("fields", [{"log": "/etc/shadow"}, {"log": "../../x"}, {"components": "x"},
                                    {"components": {"archs": "9.0"}}, {"size": "4096"}, {"sha256": 5}])
def test_import_refuses_a_manifest_with_bad_fields(tmp_path, monkeypatch, fields):
    bundle, target = _bundle_with_manifest(tmp_path, monkeypatch, **fields)
    with pytest.raises(BundleError) as info:
        import_bundle(str(bundle))
    assert info.value.code == "bundle_corrupt", info.value
    assert snapshot(target) == {}


def test_fetch_skips_a_remote_manifest_with_a_log_outside_the_entry(tmp_path, monkeypatch):
    pytest.importorskip("fsspec")
    layer, cache = tmp_path / "layer", tmp_path / "cache"
    entry = fake_entry(BuildCache(layer))
    _rewrite_manifest(entry.path, log="../../../../../etc/hostname")
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(cache))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_PREBUILT_DIRS", f"file://{layer}")
    with pytest.raises(NotBuiltError):
        ensure_built(ARCHS, build=False)
    assert entry_dirs(cache) == []


# ---- 4. the export's temporary file ----------------------------------------------------------------

def test_export_never_writes_through_a_planted_temp_link(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
    fake_entry(BuildCache(tmp_path / "cache"))
    out = tmp_path / "out" / "b.tar.gz"
    out.parent.mkdir()
    # The old name was predictable: .<name>.<pid>.tmp beside the output.
    (out.parent / f".{out.name}.{os.getpid()}.tmp").symlink_to(victim)
    export_bundle([ARCHS], str(out))
    assert victim.read_text() == "precious\n"
    assert out.is_file() and not out.is_symlink() and tarfile.is_tarfile(out)


# ---- prebuilt layers owned by someone else ---------------------------------------------------------

@needs_root
def test_layer_owned_by_another_unprivileged_user_is_refused_and_doctor_says_so(tmp_path, monkeypatch):
    from sglang_hicache_jit.buildcache.doctor import run_checks

    layer = tmp_path / "layer"
    fake_entry(BuildCache(layer))
    chown_tree(layer, NOBODY)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_PREBUILT_DIRS", str(layer))
    with pytest.raises(UnsafeCacheError, match="neither root nor this user"):
        ensure_built(ARCHS, build=False)
    check = next(c for c in run_checks("9.0") if c.name == f"prebuilt {layer}")
    assert check.status == "problem" and "unsafe_cache" in check.detail and "TRUSTED_OWNERS" in check.fix
    monkeypatch.setenv("SGLANG_HICACHE_JIT_TRUSTED_OWNERS", str(NOBODY))
    assert ensure_built(ARCHS, build=False).action == "prebuilt"
    assert next(c for c in run_checks("9.0") if c.name == f"prebuilt {layer}").status == "ok"


def test_group_writable_layer_is_refused(tmp_path, monkeypatch):
    layer = tmp_path / "layer"
    entry = fake_entry(BuildCache(layer))
    os.chmod(entry.path.parent, 0o775)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_PREBUILT_DIRS", str(layer))
    with pytest.raises(UnsafeCacheError, match="writable by its group"):
        ensure_built(ARCHS, build=False)


# ---- issue 18, H1 and D1: nvcc's intermediate files ---------------------------------------------------
# nvcc wrote its intermediates to $TMPDIR (the shared /tmp) under predictable names
# (tmpxft_<pid>_00000000-6_hicache_transfer.cudafe1.cpp, ...-8_hicache_resident.cubin). Another user
# could plant a file there (0666) and edit it between cudafe's write and the host compiler's read (code
# in the victim's library), or a symlink that the victim's ptxas wrote through (data loss).

@pytest.mark.build
def test_h1_every_compiler_step_keeps_its_temporary_files_in_the_private_staging_dir(tmp_path, monkeypatch):
    from sglang_hicache_jit.buildcache import build
    from sglang_hicache_jit.errors import BuildFailedError
    from sglang_hicache_jit.buildcache.toolchain import check_build_tools

    spec = BuildSpec.for_archs(ARCHS)
    tools = check_build_tools(spec.archs)
    staging = tmp_path / "staging"
    staging.mkdir(mode=0o700)
    seen = {}

    def capture(args, log, env, cwd, what):  # the command lines and environment the compile child gets
        seen.update(env=env, request=json.loads(Path(args[2]).read_text()))
        return 1

    monkeypatch.setattr(build, "_run_compiler", capture)
    for name in ("TMPDIR", "TMP", "TEMP"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(BuildFailedError):
        build.compile_entry(spec, spec.key(tools.toolkit.identity), tools, staging)
    env, request = seen["env"], seen["request"]
    private = Path(env["TMPDIR"])
    assert private.parent == staging and stat.S_IMODE(private.stat().st_mode) == 0o700
    assert env["TMP"] == env["TEMP"] == env["TMPDIR"]  # the host compiler and its helpers read these
    nvcc_steps = [step for step in request["steps"] if step["input"].endswith(".cu")]
    assert len(nvcc_steps) == 2
    for step in nvcc_steps:  # nvcc --dryrun lists every intermediate of cudafe, cicc, ptxas and fatbinary
        out = subprocess.run(step["command"] + ["--dryrun"], env=env, cwd=request["build_dir"], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        intermediates = {p for p in re.findall(r"(/[^\s\"',=]*tmpxft_[^\s\"',]*)", out.stderr)}
        assert intermediates, out.stderr[-2000:]
        outside = sorted(p for p in intermediates if not p.startswith(str(private) + "/"))
        assert outside == [], f"written outside the private staging directory: {outside}"


def test_h1_the_toolchain_checks_run_nvcc_with_a_private_tmpdir(monkeypatch):
    """`nvcc --version` and `--list-gpu-arch` (before every build, and in doctor) write
    tmpxft_<pid>_00000000 into $TMPDIR and delete every file of that prefix there."""
    from sglang_hicache_jit.buildcache import toolchain

    seen = []

    def run(cmd, **kwargs):
        tmp = Path(kwargs["env"]["TMPDIR"])
        seen.append((tmp, stat.S_IMODE(tmp.stat().st_mode), kwargs["env"]["TMP"], kwargs["env"]["TEMP"]))
        return subprocess.CompletedProcess(cmd, 0, "release 13.0, V13.0.88\n", "")

    monkeypatch.setattr(toolchain.subprocess, "run", run)
    monkeypatch.setenv("TMPDIR", "/tmp")
    monkeypatch.setattr("tempfile.tempdir", None)  # read $TMPDIR again: a run under another TMPDIR cached it
    toolchain._run(["nvcc", "--version"])
    toolchain._run(["nvcc", "--version"])
    (first, mode, tmp, temp), (second, *_) = seen
    assert first != second and str(first).startswith("/tmp/sglang-hicache-jit-") and mode == 0o700
    assert tmp == temp == str(first) and not first.exists()  # a fresh private directory per run, removed after


_PLANT = """
import os, sys
first, count, target = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
planted = []
for pid in range(first, first + count):
    for source in ("hicache_transfer", "hicache_resident"):
        stem = f"/tmp/tmpxft_{pid:08x}_00000000"
        try:
            fd = os.open(f"{stem}-6_{source}.cudafe1.cpp", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            os.fchmod(fd, 0o666)
            os.close(fd)
            planted.append(f"{stem}-6_{source}.cudafe1.cpp")
            os.symlink(target, f"{stem}-8_{source}.cubin")
            planted.append(f"{stem}-8_{source}.cubin")
        except FileExistsError:  # somebody's real intermediate: not ours to touch
            pass
print("\\n".join(planted))
"""


@pytest.mark.slow
@pytest.mark.build
def test_h1_d1_files_planted_in_tmp_by_another_user_are_never_read_or_written(tmp_path, make_user):
    """The victim builds in a fresh PID namespace, so its nvcc processes get small, known pids (the
    attacker's guess, made exact) and no other process on the machine shares the planted names."""
    import shutil

    if shutil.which("unshare") is None or subprocess.run(["unshare", "--pid", "--fork", "true"],
                                                         capture_output=True).returncode != 0:
        pytest.skip("needs unshare --pid (root with CAP_SYS_ADMIN) to give the build known pids")
    attacker = make_user("attacker")
    victim_file = tmp_path / "private" / "notes"  # one of the victim's own 0600 files
    victim_file.parent.mkdir(mode=0o700)
    victim_file.write_bytes(b"the victim's data\n")
    os.chmod(victim_file, 0o600)
    planted = []
    try:
        out = as_user(attacker, "-c", _PLANT, "2", "400", str(victim_file), env=dict(os.environ))
        planted = out.stdout.split()
        assert out.returncode == 0 and len(planted) > 1000, out.stderr[-2000:]
        env = env_for(tmp_path / "cache")
        for name in ("TMPDIR", "TMP", "TEMP"):
            env.pop(name, None)
        built = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-m", "sglang_hicache_jit", "prewarm",
                                "--arch", "9.0"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert built.returncode == 0, built.stdout + built.stderr
        assert victim_file.read_bytes() == b"the victim's data\n", "ptxas wrote through a planted symlink"
        gone = [path for path in planted if not os.path.lexists(path)]
        assert gone == [], f"the build removed files another user owns: {gone[:4]}"
        written = [path for path in planted if path.endswith(".cpp") and os.lstat(path).st_size]
        assert written == [], f"the build wrote into files another user planted: {written[:4]}"
    finally:
        for path in planted:
            try:
                os.unlink(path)
            except OSError:
                pass


# ---- issue 18, D4: one trust rule for every reader and writer of the cache ----------------------------
# Another user's `clean` removed the entries of a world-writable cache that `import` and the loader
# refused as unsafe_cache.

def _cache_with_entries(root: Path) -> BuildCache:
    cache = BuildCache(root)
    fake_entry(cache, "9.0")
    fake_entry(cache, "8.0")
    cache.record_failure("sm90", "hicache_transfer", "0" * 16, "planted", "log")
    return cache


@pytest.mark.parametrize("where", ["root", "layout"])
def test_d4_clean_and_prune_refuse_a_world_writable_cache_like_the_loader(tmp_path, monkeypatch, capsys, where):
    from adversarial_helpers import assert_one_error_line, run_main

    root = tmp_path / "cache"
    cache = _cache_with_entries(root)
    os.chmod(root if where == "root" else cache.layout_root, 0o777)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(root))
    before = snapshot(root)
    for args in (("clean",), ("clean", "--failed"), ("prune",), ("prune", "--max-size", "0")):
        code, out, err = run_main(capsys, *args)
        assert_one_error_line(code, err, "[unsafe_cache]", "writable by every user", "fix:")
    assert snapshot(root) == before, "a refused cache lost files"
    with pytest.raises(UnsafeCacheError):  # the loader: the same rule, the same code
        ensure_built(ARCHS, build=False)
    with pytest.raises(UnsafeCacheError):  # a failure record planted there decides nothing either
        loader._fail_fast(cache, BuildSpec.for_archs(ARCHS), "0" * 16)


@needs_root
def test_d4_clean_and_prune_refuse_a_cache_owned_by_another_user(tmp_path, monkeypatch, capsys):
    from adversarial_helpers import assert_one_error_line, run_main

    root = tmp_path / "cache"
    _cache_with_entries(root)
    chown_tree(root, NOBODY)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(root))
    before = snapshot(root)
    for args in (("clean",), ("prune",)):
        code, out, err = run_main(capsys, *args)
        assert_one_error_line(code, err, "[unsafe_cache]", f"owned by uid {NOBODY}", "fix:")
    assert snapshot(root) == before


def test_d4_a_private_cache_is_still_cleaned(tmp_path, monkeypatch, capsys):
    from adversarial_helpers import run_main

    root = tmp_path / "cache"
    _cache_with_entries(root)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(root))
    code, out, err = run_main(capsys, "clean")
    assert code == 0 and "removed 2 cache entries, 1 failed-build record" in out, out + err
    assert entry_dirs(root) == []


_CLEAN_AND_PRUNE = """
import sglang_hicache_jit.cli as c
for args in (["clean"], ["prune"], ["import", sys.argv[4]]):
    print(args[0], c.main(args), flush=True)
"""


@pytest.mark.slow
def test_d4_another_users_clean_leaves_a_world_writable_cache_alone(public_tmp, make_user):
    owner, other = make_user("owner"), make_user("other")
    root = public_tmp / "shared-cache"
    cache = _cache_with_entries(root)
    bundle = public_tmp / "b.tar.gz"
    export_bundle([ARCHS], str(bundle))  # something to import, from the same entries
    os.chmod(bundle, 0o644)
    chown_tree(root, owner)
    for dirpath, dirs, _ in os.walk(root):  # the owner made the whole cache world-writable
        os.chmod(dirpath, 0o777)
    before = snapshot(root)
    out = as_user(other, "-c", _CLEAN_AND_PRUNE, str(bundle), env=cli_env(root), timeout=120)
    assert [line.split() for line in out.stdout.splitlines()] == [["clean", "1"], ["prune", "1"], ["import", "1"]], \
        out.stdout + out.stderr
    assert out.stderr.count("error: [unsafe_cache]") == 3 and "Traceback" not in out.stderr, out.stderr
    assert snapshot(root) == before, "another user's command changed the cache"
    assert len(entry_dirs(root)) == 2


# ---- the tests' own files in the shared temp dir (issue 33) -----------------------------------------------

def test_hypothesis_writes_inside_pytests_private_temp_dir_not_through_a_planted_shared_name(
        tmp_path_factory, tmp_path, monkeypatch):
    """hypothesis' home was `$TMPDIR/sglang-hicache-jit-hypothesis-<uid>`: a fixed name in the shared temp
    dir, which another user could create first, as a symbolic link into the victim's files or as a 0777
    directory whose example database they read and poison. It is now inside pytest's base temp dir
    (private to this user, new for each run), and nothing in the shared temp dir is consulted."""
    pytest.importorskip("hypothesis")
    from hypothesis import given, settings, strategies as st
    from hypothesis.configuration import storage_directory
    from hypothesis.database import DirectoryBasedExampleDatabase

    shared = tmp_path / "shared-tmp"  # stands for /tmp: the attacker plants both old names first
    shared.mkdir(mode=0o1777)
    victim = tmp_path / "victim"
    victim.mkdir()
    (shared / f"sglang-hicache-jit-hypothesis-{os.getuid()}").symlink_to(victim)
    (shared / ".hypothesis").mkdir(mode=0o777)
    monkeypatch.setenv("TMPDIR", str(shared))
    monkeypatch.setattr("tempfile.tempdir", str(shared))

    base = tmp_path_factory.getbasetemp().resolve()
    examples = storage_directory("examples")
    home = Path(getattr(examples, "path", examples)).resolve()  # a StorageDirectory in newer hypothesis
    assert base in home.parents, f"hypothesis' home {home} is outside pytest's base temp dir {base}"
    st_base = os.stat(base)
    assert st_base.st_uid == os.geteuid() and stat.S_IMODE(st_base.st_mode) & 0o077 == 0, oct(st_base.st_mode)

    @settings(database=DirectoryBasedExampleDatabase(home), max_examples=20)
    @given(st.integers(min_value=0, max_value=100))
    def fails(n):
        assert n < 50  # a failing example is saved to the database

    with pytest.raises(AssertionError):
        fails()
    assert any(p.is_file() for p in home.rglob("*")), "no example was saved where hypothesis' home says"
    assert list(victim.iterdir()) == [] and list((shared / ".hypothesis").iterdir()) == []
    assert sorted(p.name for p in shared.iterdir()) == [".hypothesis", f"sglang-hicache-jit-hypothesis-{os.getuid()}"]
