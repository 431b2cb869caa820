"""The release kit loads SGLang's code into test processes: it must load only the recorded wheels, from a
cache nobody else controls, and its generated stand-ins must carry the recorded signatures."""

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import release_kit

ROOT = Path(__file__).resolve().parent.parent
VERSION = "0.5.19"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "releases"
    monkeypatch.setenv("SGLANG_HICACHE_JIT_TEST_RELEASES", str(root))
    return root


def _fake_pip(monkeypatch, payload: bytes):
    """pip download that writes ``payload`` under the recorded wheel's name (no network)."""
    name, _ = release_kit._wheel_for_this_python(VERSION)
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / name).write_bytes(payload)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(release_kit.subprocess, "run", run)
    return calls


def _wheel_bytes(tmp_path) -> bytes:
    path = tmp_path / "evil.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("sglang/__init__.py", "raise SystemExit('attacker code ran')\n")
    return path.read_bytes()


def test_a_wheel_that_is_not_the_recorded_one_is_refused_and_nothing_is_unpacked(cache, tmp_path, monkeypatch):
    calls = _fake_pip(monkeypatch, _wheel_bytes(tmp_path))
    with pytest.raises(release_kit.UntrustedCache, match="sha256 differs"):
        release_kit.release_tree(VERSION)
    assert calls and not [p for p in cache.iterdir() if p.name.startswith("sglang-")]


def test_a_planted_wheel_in_the_cache_is_not_trusted_by_its_name(cache, tmp_path, monkeypatch):
    name, _ = release_kit._wheel_for_this_python(VERSION)
    (cache / "wheels").mkdir(parents=True, mode=0o700)
    os.chmod(cache, 0o700)
    (cache / "wheels" / name).write_bytes(_wheel_bytes(tmp_path))
    _fake_pip(monkeypatch, _wheel_bytes(tmp_path))  # the download is no better
    with pytest.raises(release_kit.UntrustedCache):
        release_kit.release_tree(VERSION)


@pytest.mark.parametrize("attack", ["world-writable", "symlink", "foreign-owner"])
def test_a_cache_someone_else_controls_is_refused(cache, tmp_path, attack):
    if attack == "world-writable":
        cache.mkdir(mode=0o700)
        os.chmod(cache, 0o777)
    elif attack == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        cache.symlink_to(tmp_path / "elsewhere")
    else:
        if os.geteuid() != 0:
            pytest.skip("making a directory another user's needs root")
        cache.mkdir(mode=0o700)
        os.chown(cache, 65534, 65534)
    with pytest.raises(release_kit.UntrustedCache):
        release_kit.release_tree(VERSION)


def test_an_unpacked_tree_planted_by_another_user_is_refused(cache, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("making a directory another user's needs root")
    _, digest = release_kit._wheel_for_this_python(VERSION)
    tree = cache / f"sglang-{VERSION}-{digest[:16]}"
    tree.mkdir(parents=True)
    os.chmod(cache, 0o700)
    (tree / ".complete").write_text(digest)
    os.chown(tree, 65534, 65534)
    with pytest.raises(release_kit.UntrustedCache, match="belongs to uid 65534"):
        release_kit.release_tree(VERSION)


@pytest.mark.parametrize("version", ["0.5.16", "0.5.19", "0.5.23"])
def test_the_standin_carries_the_recorded_kvcacheio_signatures(tmp_path, version):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import sglang_releases
    finally:
        sys.path.remove(str(ROOT / "tools"))
    release_kit.write_standin(tmp_path, version)
    tree = ast.parse((tmp_path / "sgl_kernel" / "kvcacheio.py").read_text())
    generated = {f.name: [list(p) for p in sglang_releases.params(f)] for f in tree.body
                 if isinstance(f, ast.FunctionDef)}
    pin = release_kit.record(version)["sglang_kernel"]
    assert generated == release_kit.kernel_record(pin)["kvcacheio"]
    init = (tmp_path / "sgl_kernel" / "__init__.py").read_text()
    assert f'__version__ = "{pin}"' in init


def test_every_standin_name_imports_and_raises_when_called(tmp_path):
    release_kit.write_standin(tmp_path, "0.5.23")
    probe = ("import sgl_kernel.kvcacheio as k, sgl_kernel.elementwise as e\n"
             "from sgl_kernel.anything.deeper import op\n"
             "for fn, args in ((k.transfer_kv_per_layer_mla, (1, 2, 3, 4, 5)), (e.rmsnorm, ()), (op, ())):\n"
             "    try:\n        fn(*args)\n    except RuntimeError as exc:\n        assert 'stand-in' in str(exc)\n"
             "    else:\n        raise SystemExit('a stand-in op ran')\n"
             "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert out.stdout.strip() == "ok", out.stderr
