"""The cache's verification and publication, with fake libraries (no compiler)."""

import json

import pytest

from sglang_hicache_jit.buildcache.cache import BuildCache, CorruptEntry, verify_entry, write_manifest
from sglang_hicache_jit.buildcache.prune import clean
from sglang_hicache_jit.buildcache.spec import derive_key

# Keys must follow from the ABI key and the toolkit (verify_entry checks it).
AA = derive_key("abi1", "cuda-13.0-nvccA")
BB = derive_key("abi1", "cuda-13.0-nvccB")
_TOOLKITS = {AA: "cuda-13.0-nvccA", BB: "cuda-13.0-nvccB"}


def _staged(cache: BuildCache, key: str, payload: bytes = b"\x7fELF fake library") -> "Path":
    staging = cache.new_staging_dir(f"k-{key}") / "entry"
    staging.mkdir()
    (staging / f"k_{key}.so").write_bytes(payload)
    (staging / "build.log").write_text("ok\n")
    write_manifest(staging, {"name": f"k_{key}", "kernel": "k", "key": key, "abi_key": "abi1",
                             "toolkit": _TOOLKITS[key], "library": f"k_{key}.so", "log": "build.log",
                             "components": {"archs": ["9.0"]}})
    return staging


def test_publish_then_lookup(tmp_path):
    cache = BuildCache(tmp_path)
    entry = cache.publish(_staged(cache, AA), "sm90", "k", AA)
    assert entry.path == cache.entry_path("sm90", "k", AA)
    assert cache.lookup("sm90", "k", AA).manifest["sha256"] == entry.manifest["sha256"]
    assert cache.lookup("sm90", "k", BB) is None
    assert cache.find_abi("sm90", "k", "abi1").key == AA
    assert cache.find_abi("sm90", "k", "other") is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "no_manifest", "wrong_key"])
def test_damaged_entries_are_refused(tmp_path, damage):
    cache = BuildCache(tmp_path)
    entry = cache.publish(_staged(cache, AA), "sm90", "k", AA)
    if damage == "truncate":
        entry.library.write_bytes(entry.library.read_bytes()[:5])
    elif damage == "flip":
        data = bytearray(entry.library.read_bytes())
        data[3] ^= 0xFF
        entry.library.write_bytes(bytes(data))
    elif damage == "manifest":
        (entry.path / "manifest.json").write_text("{not json")
    elif damage == "no_manifest":
        (entry.path / "manifest.json").unlink()
    elif damage == "wrong_key":
        manifest = json.loads((entry.path / "manifest.json").read_text())
        manifest["key"] = BB
        (entry.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptEntry):
        cache.lookup("sm90", "k", AA)


def test_publish_replaces_a_corrupt_entry(tmp_path):
    cache = BuildCache(tmp_path)
    first = cache.publish(_staged(cache, AA, b"one"), "sm90", "k", AA)
    first.library.write_bytes(b"garbage that does not match")
    second = cache.publish(_staged(cache, AA, b"two"), "sm90", "k", AA)
    assert second.library.read_bytes() == b"two"
    assert verify_entry(second.path, key=AA)


def test_failure_records_round_trip_and_clean(tmp_path):
    cache = BuildCache(tmp_path)
    log = cache.record_failure("sm90", "k", AA, "nvcc said no", "error: line 3\n")
    record = cache.read_failure("sm90", "k", AA)
    assert record["reason"] == "nvcc said no" and record["log_path"] == str(log)
    assert log.read_text() == "error: line 3\n"
    # The record and its log, counted as one record.
    removed = [path for path, _, _ in clean(cache, failed_only=True).removed]
    assert removed == [cache.failure_path("sm90", "k", AA)] and not log.exists()
    assert cache.read_failure("sm90", "k", AA) is None


def test_cache_directories_are_private(tmp_path):
    cache = BuildCache(tmp_path / "root")
    staging = cache.new_staging_dir("x")
    assert staging.stat().st_mode & 0o077 == 0
    assert staging.parent.stat().st_mode & 0o077 == 0


def test_name_and_digest_checks_agree_with_their_patterns():
    """FILE_NAME and the sha256 check are written without regexes (compiling them cost the warm load
    ~0.3 ms); they must accept exactly what the patterns accept in full (no trailing newline either)."""
    import random
    import re

    from sglang_hicache_jit.buildcache.cache import FILE_NAME, _is_sha256

    name, digest = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*"), re.compile(r"[0-9a-f]{64}")
    rng = random.Random(5)
    alphabet = "aZ09_.-/ \n\x00é"
    samples = ["", "build.log", "-x", ".x", "x\n", "a" * 64, "0" * 64 + "\n", "A" * 64, "f" * 63]
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(3000)]
    samples += ["".join(rng.choice("0123456789abcdefg") for _ in range(rng.choice((63, 64, 65)))) for _ in range(500)]
    for text in samples:
        assert FILE_NAME.match(text) == bool(name.fullmatch(text)), repr(text)
        assert _is_sha256(text) == bool(digest.fullmatch(text)), repr(text)


def test_same_size_corruption_found_at_load_is_rebuilt_then_loaded(tmp_path, monkeypatch, caplog):
    """load_kernels' warm look checks only the library's size and hashes it on the descriptor it loads;
    a same-size change found there must end in a rebuild and a load of the new library, never in a
    failure or a load of the damaged bytes. The compiler and dlopen are stand-ins (test_build.py's slow
    test_same_size_corruption_is_rebuilt_by_load_kernels does the same with real builds)."""
    import hashlib
    import logging
    import os
    import types

    from sglang_hicache_jit.buildcache import loader

    toolkit = "cuda-13.0-nvccFAKE"
    builds, loaded = [], []

    def fake_compile(spec, key, tools, staging):
        entry_dir = staging / "entry"
        entry_dir.mkdir(mode=0o700)
        name = spec.extension_name(key)
        (entry_dir / f"{name}.so").write_bytes(os.urandom(8192))
        (entry_dir / "build.log").write_text("fake build\n")
        write_manifest(entry_dir, {"name": name, "kernel": spec.kernel, "key": key, "abi_key": spec.abi_key,
                                   "components": spec.abi_components, "toolkit": toolkit,
                                   "library": f"{name}.so", "log": "build.log"})
        builds.append(key)
        return entry_dir, 0.0

    def fake_dlopen(fd, entry):  # what would be loaded: the bytes behind the verified descriptor
        with open(f"/proc/self/fd/{fd}", "rb") as f:
            loaded.append(f.read())

    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("SGLANG_HICACHE_JIT_PREBUILT_DIRS", "SGLANG_HICACHE_JIT_LOCK_DIR", "SGLANG_HICACHE_JIT_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(loader, "compile_entry", fake_compile)
    monkeypatch.setattr(loader, "find_toolkit", lambda: types.SimpleNamespace(identity=toolkit))
    monkeypatch.setattr(loader, "check_build_tools", lambda archs: types.SimpleNamespace(nvcc_version="fake"))
    monkeypatch.setattr(loader, "_dlopen", fake_dlopen)
    monkeypatch.setattr(loader, "_loaded", {})
    monkeypatch.setattr(loader, "_by_archs", {})

    first = loader.load_kernels("9.0")
    os.close(first.fd)
    library = first.path
    good = library.read_bytes()
    assert builds and loaded == [good]
    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 0xFF
    library.write_bytes(bytes(damaged))
    monkeypatch.setattr(loader, "_loaded", {})  # a fresh process: nothing loaded, nothing remembered
    monkeypatch.setattr(loader, "_by_archs", {})

    with caplog.at_level(logging.INFO, logger="sglang_hicache_jit"):
        again = loader.load_kernels("9.0")
    os.close(again.fd)
    assert again.path == library and len(builds) == 2, builds
    assert "built again" in caplog.text, caplog.text
    rebuilt = library.read_bytes()
    assert rebuilt != bytes(damaged) and loaded[-1] == rebuilt
    assert hashlib.sha256(rebuilt).hexdigest() == again.entry.manifest["sha256"]
    assert bytes(damaged) not in loaded
