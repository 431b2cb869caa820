"""Adversarial: data loss and corruption (prune, clean, bad records, read-only caches)."""

import json
import os
import socket
import stat
import subprocess
import sys
import tarfile
import tempfile

import pytest

from adversarial_helpers import (assert_one_error_line, needs_root, remount_read_only, run_main,  # noqa: F401
                                 small_fs)
from fleet_helpers import entry_dirs, fake_entry, snapshot
from sglang_hicache_jit.buildcache.arch import parse_arch_list
from sglang_hicache_jit.buildcache.cache import BuildCache
from sglang_hicache_jit import errors
from sglang_hicache_jit.errors import BuildFailedError, NotBuiltError
from sglang_hicache_jit.buildcache.loader import ensure_built

ARCHS = parse_arch_list("9.0")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("SGLANG_HICACHE_JIT_PREBUILT_DIRS", "SGLANG_HICACHE_JIT_LOCK_DIR", "SGLANG_HICACHE_JIT_ARCH",
                 "SGLANG_HICACHE_JIT_CACHE_MAX_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return BuildCache(tmp_path / "cache")


def _user_files(root):
    for rel in ("v2/thesis.txt", "v10/photos/cat.jpg", "v3/.locks/not-a-lock"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)


def test_prune_and_clean_never_delete_folders_they_did_not_make(cache, capsys):
    fake_entry(cache)
    _user_files(cache.root)
    before = {p: (cache.root / p).read_text() for p in ("v2/thesis.txt", "v10/photos/cat.jpg", "v3/.locks/not-a-lock")}
    code, out, err = run_main(capsys, "prune")
    assert code == 0, err
    code, out, err = run_main(capsys, "clean")
    assert code == 0, err
    assert {p: (cache.root / p).read_text() for p in before} == before
    assert entry_dirs(cache.root) == []  # its own entries did go


def test_an_unrelated_v1_directory_is_neither_written_nor_cleaned(cache, capsys):
    (cache.layout_root / "notes").mkdir(parents=True)
    (cache.layout_root / "notes" / "todo.txt").write_text("mine")
    before = snapshot(cache.root)
    code, out, err = run_main(capsys, "clean")
    assert code == 0 and snapshot(cache.root) == before
    with pytest.raises(errors.BadSettingError, match="not made by sglang-hicache-jit"):
        cache.ensure_root()
    assert snapshot(cache.root) == before


def test_a_v1_directory_whose_marker_another_process_is_writing_is_ours(cache):
    # 16 processes creating one cache at once (tests/test_fleet_stress.py): one sees the directory another
    # just made, with only that one's marker still in its temporary file, and must not refuse it.
    cache.layout_root.mkdir(parents=True)
    fd, _ = tempfile.mkstemp(dir=cache.layout_root, prefix="..sglang-hicache-jit.", suffix=".tmp")  # as safeio names it
    os.close(fd)
    cache.ensure_root()
    assert (cache.layout_root / ".sglang-hicache-jit").is_file()
    # ...but only that name, as a regular file: a temp file of another name, or a link under the marker's
    # temp name, is someone else's
    for planted in (".thesis.k3j9x2q.tmp", "..sglang-hicache-jit.k3j9x2q.tmp"):
        for entry in cache.layout_root.iterdir():
            entry.unlink()
        if planted.startswith(".."):
            os.symlink("/etc/passwd", cache.layout_root / planted)
        else:
            (cache.layout_root / planted).write_text("draft")
        with pytest.raises(errors.BadSettingError, match="not made by sglang-hicache-jit"):
            cache.ensure_root()


@pytest.mark.parametrize("days", ["-1", "0", "nan", "inf", "-inf"])
def test_older_than_must_be_positive_and_finite(cache, capsys, days):
    fake_entry(cache)
    code, out, err = run_main(capsys, "prune", f"--older-than={days}")
    assert_one_error_line(code, err, "--older-than")
    assert len(entry_dirs(cache.root)) == 1, "an entry was removed"


@pytest.mark.parametrize("components", ["x", {"archs": "9.0"}, {"archs": [9.0]}, None, {"archs": ["9.0"],
                                                                                        "cuda_flags": "-O3"}])
def test_a_manifest_of_the_wrong_shape_is_a_corrupt_entry_everywhere(cache, capsys, monkeypatch, components):
    entry = fake_entry(cache)
    manifest = json.loads((entry.path / "manifest.json").read_text())
    manifest["components"] = components
    (entry.path / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = run_main(capsys, "info")
    assert code == 0 and "INVALID" in out, out + err
    code, out, err = run_main(capsys, "info", "--json")
    (layer,) = [layer for layer in json.loads(out)["layers"] if layer["kind"] == "cache"]
    assert code == 0 and layer["entries"][0]["valid"] is False
    code, out, err = run_main(capsys, "doctor", "--arch", "9.0")
    assert "Traceback" not in err and "cache entries" in out and "1 corrupt" in out, out
    code, out, err = run_main(capsys, "prune")
    assert code == 0 and "corrupt" in out and entry_dirs(cache.root) == [], out + err


@pytest.mark.parametrize("record", [{"reason": 5}, {"reason": None}, {"reason": ""}, {"reason": ["x"]},
                                    {"reason": "x", "time": "yesterday"}, {"reason": "x", "log": "../../etc/passwd"},
                                    [1, 2], "just a string"])
def test_a_malformed_failure_record_does_not_break_loading(cache, record):
    from sglang_hicache_jit.buildcache.spec import BuildSpec
    from sglang_hicache_jit.buildcache.toolchain import find_toolkit

    toolkit = find_toolkit()
    if toolkit is None:
        pytest.skip("needs a CUDA toolkit (the record is keyed by it)")
    spec = BuildSpec.for_archs(ARCHS)
    key = spec.key(toolkit.identity)
    cache.record_failure(spec.arch_tag, spec.kernel, key, "nvcc said no", "log")
    path = cache.failure_path(spec.arch_tag, spec.kernel, key)
    empty_reason = record == {"reason": ""}
    if isinstance(record, dict):
        record = dict(json.loads(path.read_text()), **record)
    path.write_text(json.dumps(record))
    if empty_reason:  # well-formed, just empty: still a remembered failure (was an IndexError)
        with pytest.raises(BuildFailedError, match="no reason recorded"):
            ensure_built(ARCHS, build=False)
        return
    with pytest.raises(NotBuiltError):  # the malformed record is ignored, not an AttributeError
        ensure_built(ARCHS, build=False)


def test_clean_skips_an_entry_being_built_and_a_live_builders_staging(cache, capsys):
    """clean racing a build: the builder holds the entry's lock and owns a staging directory."""
    entry = fake_entry(cache)
    kernel, key = entry.path.name.rsplit("-", 1)
    lock = cache.lock_path("sm90", kernel, key)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import filelock, sys\n"
                               f"l = filelock.FileLock({str(lock)!r}); l.acquire(); print('held', flush=True)\n"
                               "sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        staging = cache.layout_root / ".staging" / f"{entry.path.name}.{socket.gethostname()}.{holder.pid}.abcd"
        (staging / "entry").mkdir(parents=True)
        import_staging = cache.layout_root / ".staging" / f"import.{socket.gethostname()}.{holder.pid}.beef"
        import_staging.mkdir()
        code, out, err = run_main(capsys, "clean")
        assert code == 0, err
        assert entry.path.is_dir() and staging.is_dir() and import_staging.is_dir()
        assert f"kept    {entry.path}" in out
    finally:
        holder.communicate("", timeout=30)
    code, out, err = run_main(capsys, "clean")
    assert code == 0 and not entry.path.exists() and not staging.exists() and not import_staging.exists()


def test_publish_survives_its_arch_directory_being_removed(cache):
    """clean removes empty arch directories; an importer or builder publishing into one must not fail."""
    import shutil

    entry = fake_entry(cache, toolkit="cuda-13.0-nvccX")
    staged = cache.new_staging_dir(entry.path.name) / "entry"
    shutil.copytree(entry.path, staged)
    shutil.rmtree(entry.path.parent)  # the arch directory vanished (a clean in between)
    real_private_dir = __import__("sglang_hicache_jit.buildcache.cache", fromlist=["_private_dir"])._private_dir
    calls = []

    def racing_private_dir(path, mode=0o700):  # the directory goes again right after it is made, once
        result = real_private_dir(path, mode)
        if path == entry.path.parent and not calls:
            calls.append(path)
            path.rmdir()
        return result

    import sglang_hicache_jit.buildcache.cache as cache_module

    old = cache_module._private_dir
    cache_module._private_dir = racing_private_dir
    try:
        published = cache.publish(staged, "sm90", *entry.path.name.rsplit("-", 1))
    finally:
        cache_module._private_dir = old
    assert calls and published.path == entry.path and entry.path.is_dir()


# ---- read-only and full disks (root: needs a tmpfs) --------------------------------------------------

@needs_root
def test_read_only_cache_prewarm_prune_clean_say_so(tmp_path, monkeypatch, capsys):
    mount = tmp_path / "ro"
    with small_fs(mount, "4m"):
        cache = BuildCache(mount / "cache")
        fake_entry(cache, toolkit="cuda-13.0-nvccOLD", torch="0.0")  # stale: prune wants to remove it
        cache.record_failure("sm90", "hicache_transfer", "f" * 16, "nvcc said no", "log")
        remount_read_only(mount)
        before = snapshot(cache.root)
        monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(cache.root))
        for args in (["prewarm", "--arch", "8.0"], ["prune"], ["clean"], ["clean", "--failed"]):
            code, out, err = run_main(capsys, *args)
            assert_one_error_line(code, err, "cache_unwritable")
            assert "removed 1" not in out and "removed 2" not in out, (args, out)
        assert snapshot(cache.root) == before


def test_a_library_replaced_by_a_link_to_an_identical_copy_is_corrupt_everywhere(cache, capsys):
    """The loader never loads it (O_NOFOLLOW); info, doctor, prune and a lookup must agree."""
    import shutil

    entry = fake_entry(cache)
    copy = cache.root.parent / "copy.so"
    shutil.copy(entry.library, copy)
    entry.library.unlink()
    entry.library.symlink_to(copy)
    with pytest.raises(NotBuiltError):  # not "cached": the lookup sees what the loader would refuse
        ensure_built(ARCHS, build=False)
    code, out, err = run_main(capsys, "info")
    assert "INVALID" in out
    code, out, err = run_main(capsys, "doctor", "--arch", "9.0")
    assert "1 corrupt" in out and "no problems" not in out
    code, out, err = run_main(capsys, "prune")
    assert code == 0 and entry_dirs(cache.root) == [] and copy.exists()


# ---- issue 18, D2: the output path of export and bench ------------------------------------------------
# `export -o <FIFO or device>` replaced the node with a regular file (as root, -o /dev/null replaced the
# real /dev/null). One guard (safeio.check_output / write_output) for every file a command writes.

def _node(tmp_path, kind):
    path = tmp_path / f"node-{kind}"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "chardev":  # a copy of /dev/null's node
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("creating a device node is not permitted here (needs root with CAP_MKNOD)")
    elif kind == "symlink":
        (tmp_path / "target").write_text("kept\n")
        path.symlink_to(tmp_path / "target")
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_text("kept\n")
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    st = os.lstat(path)
    return path, (st.st_mode, st.st_rdev, st.st_ino)


KINDS = ["fifo", "chardev", "symlink", "directory", "socket"]


@pytest.mark.parametrize("kind", KINDS)
def test_d2_export_refuses_an_output_that_is_not_a_regular_file(cache, tmp_path, capsys, monkeypatch, kind):
    from sglang_hicache_jit.buildcache import loader

    fake_entry(cache)
    path, before = _node(tmp_path, kind)
    built = []
    real = loader.ensure_built
    monkeypatch.setattr(loader, "ensure_built", lambda *a, **k: built.append(1) or real(*a, **k))
    code, out, err = run_main(capsys, "export", "--arch", "9.0", "-o", str(path))
    assert_one_error_line(code, err, "--output", str(path), "must be a new path or a regular file", "fix:")
    assert code == 2 and built == [], "the output must be refused before anything is built"
    st = os.lstat(path)
    assert (st.st_mode, st.st_rdev, st.st_ino) == before, f"the {kind} was replaced"
    if kind == "symlink":
        assert (tmp_path / "target").read_text() == "kept\n"
    if kind == "directory":
        assert (path / "inside").read_text() == "kept\n"


def test_d2_export_to_a_new_path_or_over_a_regular_file_still_works(cache, tmp_path, capsys):
    fake_entry(cache)
    for path in (tmp_path / "new.tar.gz", tmp_path / "new.tar.gz"):  # new, then an existing regular file
        code, out, err = run_main(capsys, "export", "--arch", "9.0", "-o", str(path))
        assert code == 0, err
        assert tarfile.is_tarfile(path) and not path.is_symlink()


def test_d2_a_node_that_appears_during_the_write_is_not_replaced(tmp_path, monkeypatch):
    from sglang_hicache_jit import safeio

    path = tmp_path / "out.json"
    real = safeio.write_atomic

    def plant_then_write(target, data, mode=0o600, *, check=None):  # a FIFO appears after the first check
        os.mkfifo(target)
        return real(target, data, mode, check=check)

    monkeypatch.setattr(safeio, "write_atomic", plant_then_write)
    with pytest.raises(errors.BadSettingError, match="is a FIFO"):
        safeio.write_output(path, b"{}", "--json")
    assert stat.S_ISFIFO(os.lstat(path).st_mode) and os.listdir(tmp_path) == [path.name]  # no temporary left


@pytest.mark.parametrize("option", ["--json", "--plot"])
@pytest.mark.parametrize("kind", ["fifo", "symlink", "chardev"])
def test_d2_bench_refuses_an_output_that_is_not_a_regular_file(cache, tmp_path, capsys, option, kind):
    path, before = _node(tmp_path, kind)
    code, out, err = run_main(capsys, "bench", option, str(path))
    assert_one_error_line(code, err, option, "must be a new path or a regular file")
    assert code == 2  # before the benchmark (and before its GPU check): nothing ran
    st = os.lstat(path)
    assert (st.st_mode, st.st_rdev, st.st_ino) == before


@pytest.mark.parametrize("pid", ["²", "9" * 200])
def test_a_staging_name_with_odd_digits_is_not_ours_and_breaks_nothing(cache, capsys, pid):
    """A staging directory whose pid part passes str.isdigit but not int() ('²'): prune and clean
    raised ValueError (the same class as issue 18's T3/T4); now it is not a name this package gives."""
    fake_entry(cache)
    odd = cache.layout_root / ".staging" / f"hicache_transfer-{'0' * 16}.host.{pid}.abcd"
    odd.mkdir(parents=True)
    for args in (("prune",), ("clean",)):
        code, out, err = run_main(capsys, *args)
        assert code == 0 and "Traceback" not in err, err
    assert odd.is_dir()  # not a name this package gives: kept
