"""Read-only prebuilt layers (local and fsspec URLs) and the rule for entries from other toolkits."""

import json
import os
from pathlib import Path

import pytest

from fleet_helpers import (FAKE_TOOLKIT, cli, entry_dirs, env_for, fake_entry, load_without_compiler, manifest_of,
                           snapshot)
from sglang_hicache_jit import settings
from sglang_hicache_jit.buildcache.arch import parse_arch_list
from sglang_hicache_jit.buildcache.cache import BuildCache, acceptable
from sglang_hicache_jit.errors import NotBuiltError, UnsafeCacheError
from sglang_hicache_jit.buildcache.loader import ensure_built

ARCHS = parse_arch_list("9.0")


def _read_only(root: Path) -> None:
    for dirpath, dirs, files in os.walk(root):
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o444)
        os.chmod(dirpath, 0o555)


def _writable_again(root: Path) -> None:
    for dirpath, dirs, files in os.walk(root):
        os.chmod(dirpath, 0o755)


def test_path_lists_keep_url_colons():
    assert settings.split_path_list("/a:s3://b/x:http://h:8080/p:/c") == ["/a", "s3://b/x", "http://h:8080/p", "/c"]


def test_the_cross_toolkit_rule():
    manifest = {"abi_key": "abi", "toolkit": "cuda-13.0-nvcc100"}
    assert acceptable(manifest, "abi", "cuda-13.0-nvcc100")      # the same toolkit
    assert acceptable(manifest, "abi", "cuda-13.0-nvcc200")      # another patch release of 13.0
    assert not acceptable(manifest, "abi", "cuda-13.1-nvcc100")  # another minor: rebuilt here
    assert acceptable(manifest, "abi", None)                     # no toolkit here: any of this ABI
    assert not acceptable(manifest, "other-abi", None)           # the ABI is never negotiable


def test_prebuilt_layer_is_searched_first_and_never_written(tmp_path, monkeypatch):
    layer, cache = tmp_path / "layer", tmp_path / "cache"
    prebuilt = fake_entry(BuildCache(layer))
    fake_entry(BuildCache(cache), toolkit=FAKE_TOOLKIT + "0")  # also in the user cache: the layer wins
    _read_only(layer)
    before = snapshot(layer)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(cache))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_PREBUILT_DIRS", f"{tmp_path / 'missing'}:{layer}")
    result = ensure_built(ARCHS, build=False)
    assert result.action == "prebuilt" and result.entry.path == prebuilt.path and result.entry.prebuilt
    assert snapshot(layer) == before
    _writable_again(layer)


def test_corrupt_prebuilt_entry_is_skipped_not_repaired(tmp_path, monkeypatch):
    layer, cache = tmp_path / "layer", tmp_path / "cache"
    bad = fake_entry(BuildCache(layer))
    bad.library.write_bytes(b"truncated")
    good = fake_entry(BuildCache(cache))
    before = snapshot(layer)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(cache))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_PREBUILT_DIRS", str(layer))
    result = ensure_built(ARCHS, build=False)
    assert result.action == "cached" and result.entry.path == good.path
    assert snapshot(layer) == before


def test_world_writable_prebuilt_layer_is_refused(tmp_path, monkeypatch):
    layer = tmp_path / "layer"
    entry = fake_entry(BuildCache(layer))
    os.chmod(entry.path.parent, 0o777)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_PREBUILT_DIRS", str(layer))
    with pytest.raises(UnsafeCacheError, match="writable by every user") as info:
        ensure_built(ARCHS, build=False)
    assert info.value.code == "unsafe_cache" and "chmod go-w" in info.value.fix


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_remote_layer_is_verified_and_copied_into_the_cache(tmp_path, monkeypatch, scheme):
    import fsspec

    source = tmp_path / "source"
    entry = fake_entry(BuildCache(source))
    url = "memory://fleet-layer" if scheme == "memory" else f"file://{tmp_path}/remote-layer"
    fs, root = fsspec.core.url_to_fs(url)
    fs.put(str(source / "v1"), f"{root}/v1", recursive=True)
    cache = tmp_path / "cache"
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(cache))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_PREBUILT_DIRS", url)
    result = ensure_built(ARCHS, build=False)
    assert result.action == "fetched" and result.entry.path == cache / "v1" / "sm90" / entry.path.name
    assert manifest_of(result.entry.path)["sha256"] == entry.manifest["sha256"]
    assert ensure_built(ARCHS, build=False).action == "cached"  # later processes never touch the network
    fs.rm(f"{root}/v1", recursive=True)


def test_tampered_remote_entry_is_not_copied(tmp_path, monkeypatch):
    import fsspec

    source = tmp_path / "source"
    entry = fake_entry(BuildCache(source))
    entry.library.write_bytes(b"X" + entry.library.read_bytes()[1:])  # same size, other bytes
    fs, root = fsspec.core.url_to_fs("memory://tampered-layer")
    fs.put(str(source / "v1"), f"{root}/v1", recursive=True)
    cache = tmp_path / "cache"
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(cache))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_PREBUILT_DIRS", "memory://tampered-layer")
    with pytest.raises(NotBuiltError):
        ensure_built(ARCHS, build=False)
    assert entry_dirs(cache) == [] and not list(cache.glob("v1/.staging/*"))
    fs.rm(f"{root}/v1", recursive=True)


def test_unreachable_remote_layer_does_not_stop_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    good = fake_entry(BuildCache(cache))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(cache))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_PREBUILT_DIRS", "nosuchscheme://x/y")
    assert ensure_built(ARCHS, build=False).entry.path == good.path


@pytest.mark.build
@pytest.mark.slow  # a second real build (8.0)
def test_read_only_layer_loads_without_compiling_and_a_missing_arch_builds_into_the_cache(session_cache, tmp_path):
    bundle = tmp_path / "b.tar.gz"
    assert cli("export", "--arch", "9.0", "-o", str(bundle), env=env_for(session_cache)).returncode == 0
    layer = tmp_path / "layer"
    out = cli("import", str(bundle), "--into", str(layer), env=env_for(tmp_path / "unused"))
    assert out.returncode == 0, out.stderr
    _read_only(layer)
    before = snapshot(layer)
    cache = tmp_path / "cache"
    env = env_for(cache, SGLANG_HICACHE_JIT_PREBUILT_DIRS=layer)
    loaded = load_without_compiler(env)
    assert loaded["prebuilt"] and loaded["path"].startswith(str(layer))
    out = cli("prewarm", "--arch", "9.0;8.0", "--json", env=env)
    assert out.returncode == 0, out.stderr
    actions = {r["arch"]: (r["action"], r["path"]) for r in json.loads(out.stdout)["results"]}
    assert actions["9.0"][0] == "prebuilt" and actions["9.0"][1].startswith(str(layer))
    assert actions["8.0"][0] == "built" and actions["8.0"][1].startswith(str(cache))
    assert snapshot(layer) == before and entry_dirs(cache) == [f"v1/sm80/{Path(actions['8.0'][1]).name}"]
    _writable_again(layer)


@pytest.mark.build
def test_remote_layer_in_a_fresh_process(session_cache, tmp_path):
    """A file:// layer (stands for s3:// or gs://): copied into the cache, loaded without compiling."""
    bundle = tmp_path / "b.tar.gz"
    assert cli("export", "--arch", "9.0", "-o", str(bundle), env=env_for(session_cache)).returncode == 0
    layer = tmp_path / "remote"
    assert cli("import", str(bundle), "--into", str(layer), env=env_for(tmp_path / "unused")).returncode == 0
    cache = tmp_path / "cache"
    loaded = load_without_compiler(env_for(cache, SGLANG_HICACHE_JIT_PREBUILT_DIRS=f"file://{layer}"))
    assert loaded["path"].startswith(str(cache)) and not loaded["prebuilt"]
