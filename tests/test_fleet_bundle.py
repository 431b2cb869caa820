"""Bundles: export and import, tampered archives, bundles at fsspec URLs."""

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from fleet_helpers import cli, entry_dirs, env_for, fake_entry, load_without_compiler, snapshot
from sglang_hicache_jit.buildcache.arch import parse_arch_list
from sglang_hicache_jit.buildcache.bundle import export_bundle, import_bundle
from sglang_hicache_jit.buildcache.cache import BuildCache, file_sha256
from sglang_hicache_jit.errors import BundleError


@pytest.fixture
def fake_bundle(tmp_path, monkeypatch):
    """A bundle of one fake 9.0 entry (no compiler needed) and an empty target cache."""
    source = tmp_path / "source"
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(source))
    entry = fake_entry(BuildCache(source))
    bundle = tmp_path / "b.tar.gz"
    report = export_bundle([parse_arch_list("9.0")], str(bundle))
    assert [e["key"] for e in report.entries] == [entry.key]
    target = tmp_path / "target"
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(target))
    return bundle, entry, target


def _members(bundle: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(bundle, "r:gz") as tar:
        return [(m, tar.extractfile(m).read() if m.isreg() else b"") for m in tar.getmembers()]


def _repack(bundle: Path, members) -> Path:
    out = bundle.with_name("tampered.tar.gz")
    with tarfile.open(out, "w:gz") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return out


def _import_fails(bundle: Path, target: Path, code: str, match: str | None = None) -> BundleError:
    before = snapshot(target)
    with pytest.raises(BundleError, match=match) as info:
        import_bundle(str(bundle))
    assert info.value.code == code, info.value
    assert snapshot(target) == before, "a refused bundle changed the cache"
    assert info.value.fix
    return info.value


def test_round_trip_is_verified_and_reproducible(fake_bundle, tmp_path):
    bundle, entry, target = fake_bundle
    report = import_bundle(str(bundle))
    assert [(e["key"], e["action"]) for e in report.entries] == [(entry.key, "imported")]
    imported = target / "v1" / "sm90" / entry.path.name
    assert file_sha256(imported / entry.manifest["library"]) == entry.manifest["sha256"]
    assert imported.stat().st_mode & 0o077 == 0 and (target / "v1").stat().st_mode & 0o077 == 0
    # Importing again keeps the entry; exporting the same entries again gives the same bytes.
    assert import_bundle(str(bundle)).entries[0]["action"] == "kept"
    again = tmp_path / "again.tar.gz"
    export_bundle([parse_arch_list("9.0")], str(again))
    assert again.read_bytes() == bundle.read_bytes()


def test_import_into_a_directory_makes_a_prebuilt_layer(fake_bundle, tmp_path):
    bundle, entry, target = fake_bundle
    layer = tmp_path / "layer"
    import_bundle(str(bundle), into=layer)
    assert entry_dirs(layer) == [f"v1/sm90/{entry.path.name}"] and not target.exists()


def test_flipped_byte_in_a_library(fake_bundle):
    bundle, entry, target = fake_bundle
    members = _members(bundle)
    for i, (info, data) in enumerate(members):
        if info.name.endswith(".so"):
            members[i] = (info, data[:100] + bytes([data[100] ^ 1]) + data[101:])
    _import_fails(_repack(bundle, members), target, "bundle_corrupt", "sha256")


def test_flipped_byte_in_the_compressed_file(fake_bundle):
    bundle, entry, target = fake_bundle
    data = bytearray(bundle.read_bytes())
    data[len(data) // 2] ^= 0x40
    bad = bundle.with_name("flipped.tar.gz")
    bad.write_bytes(bytes(data))
    before = snapshot(target)
    with pytest.raises(BundleError) as info:
        import_bundle(str(bad))
    assert info.value.code in ("bundle_unreadable", "bundle_corrupt")
    assert snapshot(target) == before


def test_manifest_and_checksums_edited_consistently_but_wrong_key(fake_bundle):
    """An attacker who rewrites every checksum still cannot rename an entry: keys follow from contents."""
    bundle, entry, target = fake_bundle
    wrong = "0123456789abcdef"
    old_dir = entry.path.name
    new_dir = old_dir.rsplit("-", 1)[0] + "-" + wrong
    members = []
    for info, data in _members(bundle):
        info.name = info.name.replace(old_dir, new_dir)
        if info.name.endswith("manifest.json"):
            manifest = json.loads(data)
            manifest["key"] = wrong
            data = json.dumps(manifest).encode()
        members.append((info, data))
    index_i = next(i for i, (m, _) in enumerate(members) if m.name == "bundle.json")
    index = json.loads(members[index_i][1])
    for record in index["entries"]:
        record["path"] = record["path"].replace(old_dir, new_dir)
        record["files"]["manifest.json"] = hashlib.sha256(
            next(d for m, d in members if m.name.endswith("manifest.json"))).hexdigest()
    members[index_i] = (members[index_i][0], json.dumps(index).encode())
    _import_fails(_repack(bundle, members), target, "bundle_corrupt", "does not follow")


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "hardlink", "device", "fifo", "outside"])
def test_unsafe_members_are_refused(fake_bundle, tmp_path, kind):
    bundle, entry, target = fake_bundle
    members = _members(bundle)
    prefix = f"v1/sm90/{entry.path.name}"
    info = tarfile.TarInfo()
    if kind == "dotdot":
        info.name, info.type = f"{prefix}/../../../evil", tarfile.REGTYPE
    elif kind == "absolute":
        info.name, info.type = str(tmp_path / "evil"), tarfile.REGTYPE
    elif kind == "symlink":
        info.name, info.type, info.linkname = f"{prefix}/evil", tarfile.SYMTYPE, "/etc/passwd"
    elif kind == "hardlink":
        info.name, info.type, info.linkname = f"{prefix}/evil", tarfile.LNKTYPE, "/etc/passwd"
    elif kind == "device":
        info.name, info.type, info.devmajor, info.devminor = f"{prefix}/evil", tarfile.CHRTYPE, 1, 3
    elif kind == "fifo":
        info.name, info.type = f"{prefix}/evil", tarfile.FIFOTYPE
    elif kind == "outside":
        info.name, info.type = "etc/evil", tarfile.REGTYPE
    members.insert(0, (info, b"evil"))
    error = _import_fails(_repack(bundle, members), target, "bundle_unsafe")
    assert "nothing was imported" in str(error)
    assert not (tmp_path / "evil").exists() and not list(tmp_path.rglob("evil"))


def test_symlink_replacing_the_library_is_refused(fake_bundle):
    bundle, entry, target = fake_bundle
    members = []
    for info, data in _members(bundle):
        if info.name.endswith(".so"):
            info.type, info.linkname, data = tarfile.SYMTYPE, "/usr/lib/x86_64-linux-gnu/libc.so.6", b""
        members.append((info, data))
    _import_fails(_repack(bundle, members), target, "bundle_unsafe", "link")


def test_extra_or_missing_entry_files(fake_bundle):
    bundle, entry, target = fake_bundle
    prefix = f"v1/sm90/{entry.path.name}"
    extra = tarfile.TarInfo(f"{prefix}/preload.so")
    _import_fails(_repack(bundle, _members(bundle) + [(extra, b"x")]), target, "bundle_corrupt", "do not match")
    without_log = [(m, d) for m, d in _members(bundle) if not m.name.endswith("build.log")]
    _import_fails(_repack(bundle, without_log), target, "bundle_corrupt")


def test_bundle_for_another_torch_is_refused(tmp_path, monkeypatch):
    source = tmp_path / "source"
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(source))
    entry = fake_entry(BuildCache(source), abi_key="0" * 16, torch="1.0.0+cu999")
    bundle = tmp_path / "b.tar.gz"
    # Pack it by hand: export would (rightly) not find an entry of another ABI.
    members = []
    files = {}
    for path in sorted(entry.path.iterdir()):
        files[path.name] = path.read_bytes()
    prefix = f"v1/sm90/{entry.path.name}"
    index = {"format": 1, "entries": [{"path": prefix, "files": {n: hashlib.sha256(d).hexdigest()
                                                                 for n, d in files.items()}}]}
    members.append((tarfile.TarInfo("bundle.json"), json.dumps(index).encode()))
    members += [(tarfile.TarInfo(f"{prefix}/{n}"), d) for n, d in files.items()]
    bad = _repack(bundle, members)
    target = tmp_path / "target"
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(target))
    error = _import_fails(bad, target, "bundle_mismatch", "torch '1.0.0\\+cu999' in the bundle")
    assert "same torch" in error.fix


def test_not_a_bundle(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "c"))
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(gzip.compress(b"not a tar at all" * 100))
    for path in (junk, tmp_path / "missing.tar.gz"):
        with pytest.raises(BundleError) as info:
            import_bundle(str(path))
        assert info.value.code == "bundle_unreadable"
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_bundle_at_an_fsspec_url(fake_bundle, tmp_path, monkeypatch, scheme):
    bundle, entry, target = fake_bundle
    url = "memory://fleet/bundles/b.tar.gz" if scheme == "memory" else f"file://{tmp_path}/remote/b.tar.gz"
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "source"))
    export_bundle([parse_arch_list("9.0")], url)
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(target))
    report = import_bundle(url)
    assert report.path == url and [e["key"] for e in report.entries] == [entry.key]
    assert entry_dirs(target) == [f"v1/sm90/{entry.path.name}"]
    with pytest.raises(BundleError) as info:
        import_bundle(url.replace("b.tar.gz", "nope.tar.gz"))
    assert info.value.code == "bundle_unreadable"


@pytest.mark.build
def test_export_then_import_loads_in_a_fresh_process_without_compiling(session_cache, tmp_path):
    bundle = tmp_path / "sm90.tar.gz"
    out = cli("export", "--arch", "9.0", "-o", str(bundle), "--json", env=env_for(session_cache))
    assert out.returncode == 0, out.stderr
    empty = tmp_path / "fresh-cache"
    env = env_for(empty)
    out = cli("import", str(bundle), "--json", env=env)
    assert out.returncode == 0, out.stderr
    (record,) = json.loads(out.stdout)["entries"]
    assert record["action"] == "imported"
    loaded = load_without_compiler(env)
    assert loaded["path"].startswith(str(empty)) and not loaded["prebuilt"]
    assert not list(empty.glob("v1/.staging/*")), "something was built"
