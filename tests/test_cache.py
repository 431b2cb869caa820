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
