"""Pruning: LRU under a size cap, age, stale versions, failure records, debris; locked entries survive."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from fleet_helpers import cli, entry_dirs, env_for, fake_entry
from sglang_hicache_jit import settings
from sglang_hicache_jit.buildcache.cache import BuildCache, touch_used
from sglang_hicache_jit.buildcache.prune import apply_size_cap, prune

KB = 1024


def _entries(cache: BuildCache, n: int, size: int = 64 * KB):
    """n fake entries of ``size`` bytes, the first one least recently used."""
    made = []
    for i in range(n):
        entry = fake_entry(cache, toolkit=f"cuda-13.0-nvcc{i}", payload=os.urandom(size))
        used = time.time() - (n - i) * 7200
        os.utime(entry.path / "manifest.json", (used, used))
        made.append(entry)
    return made


def test_parse_size():
    assert settings.parse_size("500M") == 500 << 20 and settings.parse_size("10G") == 10 << 30
    assert settings.parse_size("1.5GiB") == 3 << 29 and settings.parse_size("4096") == 4096
    with pytest.raises(ValueError, match="not a size"):
        settings.parse_size("ten gigs")


def test_size_cap_keeps_the_most_recently_used(tmp_path):
    cache = BuildCache(tmp_path)
    entries = _entries(cache, 5)
    touch_used(entries[0])  # loaded just now: the most recently used
    report = prune(cache, max_size=3 * 70 * KB, stale=False)
    left = set(entry_dirs(tmp_path))
    kept = {f"v1/sm90/{e.path.name}" for e in (entries[0], entries[3], entries[4])}
    assert left == kept, left
    assert report.total_after <= 3 * 70 * KB and report.freed >= 2 * 64 * KB
    assert all("least recently used" in why for _, why, _ in report.removed)


def test_older_than(tmp_path):
    cache = BuildCache(tmp_path)
    entries = _entries(cache, 3)  # used 6 h, 4 h and 2 h ago
    prune(cache, older_than_days=3 / 24 - 0.001, stale=False)
    assert entry_dirs(tmp_path) == [f"v1/sm90/{entries[2].path.name}"]


def test_an_entry_locked_by_a_live_process_survives(tmp_path):
    cache = BuildCache(tmp_path)
    entries = _entries(cache, 3)
    victim = entries[0]
    lock = cache.lock_path("sm90", *victim.path.name.rsplit("-", 1))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import filelock, sys, time\n"
                               f"l = filelock.FileLock({str(lock)!r}); l.acquire(); print('held', flush=True)\n"
                               "sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        report = prune(cache, max_size=0, stale=False)
        assert entry_dirs(tmp_path) == [f"v1/sm90/{victim.path.name}"]
        assert report.skipped_locked == [victim.path]
    finally:
        holder.communicate("", timeout=30)
    prune(cache, max_size=0, stale=False)
    assert entry_dirs(tmp_path) == []


def test_stale_entries_failures_and_debris(tmp_path, monkeypatch):
    cache = BuildCache(tmp_path)
    current = fake_entry(cache)
    other_torch = fake_entry(cache, abi_key="1" * 16, torch="1.0")
    corrupt = fake_entry(cache, toolkit="cuda-13.0-nvcc9")
    corrupt.library.write_bytes(b"x")
    cache.record_failure("sm90", "hicache_transfer", "f" * 16, "nvcc said no", "log")
    staging = cache.layout_root / ".staging"
    dead = staging / f"hicache_transfer-{'a' * 16}.{socket.gethostname()}.999999999.abcd"
    alive = staging / f"hicache_transfer-{'b' * 16}.{socket.gethostname()}.{os.getpid()}.abcd"
    foreign_old = staging / f"hicache_transfer-{'c' * 16}.otherhost.1.abcd"
    foreign_new = staging / f"hicache_transfer-{'d' * 16}.otherhost.1.abcd"
    for path in (dead, alive, foreign_old, foreign_new):
        (path / "entry").mkdir(parents=True)
    os.utime(foreign_old, (time.time() - 3 * 86400,) * 2)
    old_layout = tmp_path / "v0" / "sm90" / "x"
    old_layout.mkdir(parents=True)
    (tmp_path / "v0" / ".sglang-hicache-jit").write_text("")  # made by this package (an older version)
    report = prune(cache)
    assert entry_dirs(tmp_path) == [f"v1/sm90/{current.path.name}"]
    reasons = {p: why for p, why, _ in report.removed}
    assert "another package" in reasons[other_torch.path] and reasons[corrupt.path].startswith("corrupt")
    assert not cache.failures() and not (tmp_path / "v0").exists()
    assert sorted(p.name for p in staging.iterdir()) == sorted([alive.name, foreign_new.name])


def test_automatic_cap_after_a_publication(tmp_path, monkeypatch):
    cache = BuildCache(tmp_path)
    entries = _entries(cache, 4)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_MAX_SIZE", f"{2 * 70}K")
    apply_size_cap(cache, keep=(entries[0].path,))  # the one just published, although oldest
    assert set(entry_dirs(tmp_path)) == {f"v1/sm90/{e.path.name}" for e in (entries[0], entries[3])}
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_MAX_SIZE", "lots")
    assert apply_size_cap(cache) is None  # a bad setting is logged, never raised after a build


def test_touch_used_is_cheap_and_skips_prebuilt(tmp_path):
    entry = fake_entry(BuildCache(tmp_path))
    touch_used(entry)
    marker = entry.path / "last_used"
    first = marker.stat().st_mtime
    os.utime(marker, (first - 10, first - 10))
    touch_used(entry)  # refreshed at most hourly
    assert marker.stat().st_mtime == first - 10
    layer_entry = fake_entry(BuildCache(tmp_path / "layer"))
    touch_used(type(layer_entry)(layer_entry.path, layer_entry.manifest, prebuilt=True))
    assert not (layer_entry.path / "last_used").exists()


def test_prune_cli(tmp_path):
    cache = BuildCache(tmp_path / "c")
    _entries(cache, 3)
    out = cli("prune", "--max-size", "100K", "--json", env=env_for(cache.root))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert len(report["removed"]) == 2 and report["bytes_after"] <= 100 * KB
    out = cli("prune", "--max-size", "lots", env=env_for(cache.root))
    assert out.returncode == 2 and "not a size" in out.stderr
