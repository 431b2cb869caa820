"""The server carry and its install on the GPU machine (issue 35): every wheel checked against a recorded
sha256, no archive member outside the site, each carry in a fresh site, carry.json's env read as data, and
tools/gpu_server.sh stopping at the first refusal. No GPU, no network: wheels and carries are made here, and
gpu_server.sh runs against a python3 stand-in that passes only the install step to the real interpreter."""

import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from sglang_server import carry, install  # noqa: E402


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tar(members: list) -> bytes:
    """A tar.gz of (TarInfo-ish spec) members: (name, data) files, or (name, type, linkname) specials."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for member in members:
            info = tarfile.TarInfo(member[0])
            if len(member) == 2:
                info.size = len(member[1])
                tar.addfile(info, io.BytesIO(member[1]))
            else:
                info.type, info.linkname = member[1], member[2]
                tar.addfile(info)
    return buffer.getvalue()


def _carry(directory: Path, files: dict, *, env=None, release="0.5.23", listed=None) -> Path:
    """A carry: ``files`` {name: bytes}, and carry.json listing their sha256 (or ``listed``)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    facts = {"release": release, "label": "unofficial: test", "env": env or {},
             "sha256": listed if listed is not None else {n: _sha(d) for n, d in files.items()}}
    (directory / "carry.json").write_text(json.dumps(facts))
    return directory


GOOD_TREE = _tar([("sglang/__init__.py", b"__version__ = '0.5.23'\n"), ("sglang/srt/x.py", b"X = 1\n")])


def _install(tmp_path, carry_dir, site=None):
    site = site or tmp_path / "site"
    return install.install(carry_dir, site, tmp_path / "carry.env", tmp_path / "carry.facts"), site


def test_a_good_carry_installs_into_a_fresh_site_and_says_what_it_is(tmp_path):
    carry_dir = _carry(tmp_path / "carry", {"sglang-0.5.23.tar.gz": GOOD_TREE},
                       env={"SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
                            "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"})
    facts, site = _install(tmp_path, carry_dir)
    assert (site / "sglang" / "srt" / "x.py").read_text() == "X = 1\n"
    assert (tmp_path / "carry.facts").read_text() == "0.5.23\nunofficial: test\n"
    assert (tmp_path / "carry.env").read_bytes() == (b"SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1\0"
                                                    b"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python\0")


def test_a_carry_is_never_installed_over_another(tmp_path):
    """0.5.19 installed over 0.5.23's site mixed the releases' files (every server import failed)."""
    first = _carry(tmp_path / "first", {"sglang-0.5.23.tar.gz": GOOD_TREE})
    _, site = _install(tmp_path, first)
    second = _carry(tmp_path / "second", {"sglang-0.5.19.tar.gz": _tar([("sglang/__init__.py", b"")])},
                    release="0.5.19")
    with pytest.raises(install.Refused, match="not a fresh directory"):
        _install(tmp_path, second, site)
    assert (site / "sglang" / "srt" / "x.py").exists()  # untouched


@pytest.mark.parametrize("change, why", [
    (lambda d: (d / "sglang-0.5.23.tar.gz").write_bytes(GOOD_TREE + b"x"), "sha256 differs"),
    (lambda d: (d / "evil-1.0-py3-none-any.whl").write_bytes(b"PK"), "files not in carry.json: ['evil"),
    (lambda d: (d / "sglang-0.5.23.tar.gz").unlink(), "listed but missing: ['sglang-0.5.23.tar.gz']"),
    (lambda d: (d / "carry.json").write_text(json.dumps({"release": "0.5.23", "label": "x", "env": {}})),
     "lists no sha256"),
    (lambda d: (d / "carry.json").write_text("{"), "cannot be read as JSON"),
])
def test_a_changed_carry_is_refused_before_anything_is_installed(tmp_path, change, why):
    carry_dir = _carry(tmp_path / "carry", {"sglang-0.5.23.tar.gz": GOOD_TREE})
    change(carry_dir)
    with pytest.raises(install.Refused, match=why.replace("[", r"\[").replace("(", r"\(")):
        _install(tmp_path, carry_dir)
    assert not (tmp_path / "site").exists()


@pytest.mark.parametrize("members, why", [
    ([("../outside.py", b"x")], "'..' component"),
    ([("sglang/../../outside.py", b"x")], "'..' component"),
    ([("/tmp/abs-h35.py", b"x")], "absolute"),
    ([("sglang/link", tarfile.SYMTYPE, "/etc/passwd")], "not a regular file or directory"),
    ([("sglang/hard", tarfile.LNKTYPE, "../../etc/passwd")], "not a regular file or directory"),
    ([("sglang/fifo", tarfile.FIFOTYPE, "")], "not a regular file or directory"),
    ([("sglang/dev", tarfile.CHRTYPE, "")], "not a regular file or directory"),
])
def test_a_tar_member_that_could_leave_the_site_refuses_the_whole_archive(tmp_path, members, why):
    tree = _tar([("sglang/__init__.py", b"")] + members)
    carry_dir = _carry(tmp_path / "carry", {"sglang-0.5.23.tar.gz": tree})
    with pytest.raises(install.Refused, match=why):
        _install(tmp_path, carry_dir)
    assert not (tmp_path / "outside.py").exists() and not Path("/tmp/abs-h35.py").exists()
    assert not any((tmp_path / "site").rglob("*")), "something was extracted before the refusal"


@pytest.mark.parametrize("env, why", [
    ({"PATH": "/tmp/evil"}, "not of the form"),
    ({"LD_PRELOAD": "/tmp/evil.so"}, "not of the form"),
    ({"SGLANG_X; touch /tmp/h35": "1"}, "not of the form"),
    ({"SGLANG_X=Y": "1"}, "not of the form"),
    ({"SGLANG_X": "1\nSGLANG_Y=2"}, "one line of text"),
    ({"SGLANG_X": 1}, "one line of text"),
    ({"SGLANG_X": "a\0b"}, "one line of text"),
])
def test_carry_env_names_and_values_are_checked(tmp_path, env, why):
    carry_dir = _carry(tmp_path / "carry", {"sglang-0.5.23.tar.gz": GOOD_TREE}, env=env)
    with pytest.raises(install.Refused, match=why):
        _install(tmp_path, carry_dir)


def test_a_wheel_goes_in_with_pip_into_the_site(tmp_path):
    wheel = io.BytesIO()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("h35pkg/__init__.py", "A = 35\n")
        z.writestr("h35pkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: h35pkg\nVersion: 1.0\n")
        z.writestr("h35pkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                 "Tag: py3-none-any\n")
        z.writestr("h35pkg-1.0.dist-info/RECORD", "")
    carry_dir = _carry(tmp_path / "carry", {"h35pkg-1.0-py3-none-any.whl": wheel.getvalue()})
    _, site = _install(tmp_path, carry_dir)
    assert (site / "h35pkg" / "__init__.py").read_text() == "A = 35\n"


# ---------------------------------------------------------------------------
# tools/gpu_server.sh with a python3 stand-in: only install.py runs for real.

SHIM = """#!/bin/bash
echo "python3 $*" >> "$SHIM_LOG"
case "$1" in
  tools/sglang_server/install.py) exec {python} "$@" ;;
  tools/sglang_server/server_imports.py) echo '{{"ok": true}}'; exit 0 ;;
  tools/sglang_server/main.py) env | grep '^SGLANG_' | sort > "$SHIM_ENV"; exit 0 ;;
esac
exit 0
"""


def _gpu_server(tmp_path, carry_dir):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "python3"
    shim.write_text(SHIM.format(python=sys.executable))
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", SRV_DIR=str(tmp_path / "srv"), SRV_CARRY=str(carry_dir),
               OUT=str(tmp_path / "out"), SHIM_LOG=str(tmp_path / "shim.log"), SHIM_ENV=str(tmp_path / "shim.env"),
               SRV_WALL_S="120")
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_server.sh"), "smoke:60"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    calls = (tmp_path / "shim.log").read_text().splitlines() if (tmp_path / "shim.log").exists() else []
    return proc, calls


def test_gpu_server_exports_carry_env_as_data_never_evaluated(tmp_path):
    """carry.json's env went through eval: a value of '1; touch X' ran touch."""
    marker = tmp_path / "touched"
    carry_dir = _carry(tmp_path / "carry", {"sglang-0.5.23.tar.gz": GOOD_TREE},
                       env={"SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": f"1; touch {marker}",
                            "SGLANG_H35": f"$(touch {marker})`touch {marker}`"})
    proc, calls = _gpu_server(tmp_path, carry_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not marker.exists(), "a value of carry.json's env was run by the shell"
    exported = (tmp_path / "shim.env").read_text().splitlines()
    assert f"SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1; touch {marker}" in exported
    assert f"SGLANG_H35=$(touch {marker})`touch {marker}`" in exported
    assert any(c.startswith("python3 tools/sglang_server/main.py smoke --release 0.5.23") for c in calls), calls
    sites = list((tmp_path / "srv").glob("site.*"))
    assert len(sites) == 1 and (sites[0] / "sglang" / "srt" / "x.py").exists()


@pytest.mark.parametrize("bad", ["dotdot", "checksum", "env-name"])
def test_gpu_server_stops_at_a_refused_carry(tmp_path, bad):
    """It went on after tar refused a '..' member; now nothing after the install step runs."""
    files = {"sglang-0.5.23.tar.gz": _tar([("../../escaped-h35.py", b"x")]) if bad == "dotdot" else GOOD_TREE}
    carry_dir = _carry(tmp_path / "carry", files, env={"BASH_ENV": "/tmp/x"} if bad == "env-name" else {})
    if bad == "checksum":
        (carry_dir / "sglang-0.5.23.tar.gz").write_bytes(GOOD_TREE[:-1])
    proc, calls = _gpu_server(tmp_path, carry_dir)
    assert proc.returncode == 1 and "carry refused" in proc.stderr and "carry install failed" in proc.stdout
    assert [c.split()[1] for c in calls] == ["tools/sglang_server/install.py"], calls  # no pip, no engines


def test_gpu_server_installs_each_carry_into_a_fresh_site(tmp_path):
    first = _carry(tmp_path / "first", {"sglang-0.5.23.tar.gz": GOOD_TREE})
    proc, _ = _gpu_server(tmp_path, first)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    second = _carry(tmp_path / "second", {"sglang-0.5.19.tar.gz": _tar([("sglang/__init__.py", b"")])},
                    release="0.5.19")
    proc, calls = _gpu_server(tmp_path, second)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    site, = (tmp_path / "srv").glob("site.*")
    assert not (site / "sglang" / "srt" / "x.py").exists(), "the earlier carry's files are in the new site"


def test_gpu_server_runs_the_server_gpu_tests_in_its_pytest_mode(tmp_path):
    carry_dir = _carry(tmp_path / "carry", {"sglang-0.5.23.tar.gz": GOOD_TREE})
    bin_dir = tmp_path / "bin"
    proc, calls = _gpu_server(tmp_path, carry_dir)
    assert proc.returncode == 0
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SRV_DIR=str(tmp_path / "srv"),
               SRV_CARRY=str(carry_dir), OUT=str(tmp_path / "out"), SHIM_LOG=str(tmp_path / "shim2.log"),
               SHIM_ENV=str(tmp_path / "shim2.env"), SRV_WALL_S="120")
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_server.sh"), "pytest:90"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    calls = (tmp_path / "shim2.log").read_text().splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run, = [c for c in calls if " -m pytest " in c]
    assert "-m pytest" in run and "tests/test_sglang_server_gpu.py" in run and "-rs" in run


def test_the_server_gpu_test_fails_rather_than_skips_when_asked_to_run(monkeypatch):
    """SGLANG_SERVER_TESTS=1 without a GPU or SGLang: a skip would read as nothing wrong."""
    sys.path.insert(0, str(ROOT / "tests"))
    import test_sglang_server_gpu as gpu_test

    monkeypatch.setenv("SGLANG_SERVER_TESTS", "1")
    try:
        gpu_test._ready()  # a GPU machine with SGLang: ready, the test runs
    except pytest.fail.Exception as exc:
        assert "SGLANG_SERVER_TESTS=1 but" in str(exc)
    monkeypatch.delenv("SGLANG_SERVER_TESTS")
    with pytest.raises(pytest.skip.Exception):
        gpu_test._ready()


def test_gpu_server_has_no_eval_and_stops_on_errors():
    text = (ROOT / "tools" / "gpu_server.sh").read_text()
    code = [line.split("#")[0] for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert "set -euo pipefail" in code and not any("eval" in line.split() for line in code)


# ---------------------------------------------------------------------------
# The carry builder: every wheel against a recorded sha256; no member outside the site; the tree core.

def _wheel(path: Path, members: dict) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


@pytest.mark.parametrize("name", ["../evil.py", "/etc/cron.d/x", "sglang/../../x", "a\\..\\b"])
def test_the_carry_refuses_a_wheel_with_a_member_outside_its_tree(tmp_path, name):
    wheel = _wheel(tmp_path / "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl",
                   {"sglang/__init__.py": "", name: "x", "sglang-0.5.23.dist-info/RECORD": ""})
    with pytest.raises(SystemExit, match="refusing the whole archive"):
        carry.trim_zip(wheel, lambda n: True)
    with pytest.raises(SystemExit, match="refusing the whole archive"):
        carry.trim_wheel(wheel)


def test_the_carry_checks_every_wheel_against_a_recorded_sha256(tmp_path, monkeypatch):
    good = _wheel(tmp_path / "dill-0.4.1-py3-none-any.whl", {"dill/__init__.py": "", "dill-0.4.1.dist-info/RECORD": ""})
    recorded = {good.name: _sha(good.read_bytes())}
    assert carry.checked(good, recorded) == good
    other_tag = _wheel(tmp_path / "dill-0.4.1-py2.py3-none-any.whl", {"dill/__init__.py": ""})
    with pytest.raises(SystemExit, match="no sha256 recorded for this wheel"):  # was carried unchecked
        carry.checked(other_tag, recorded)
    with pytest.raises(SystemExit, match="sha256 differs"):
        carry.checked(good, {good.name: "0" * 64})


def test_build_refuses_an_unrecorded_wheel_of_any_kind(tmp_path, monkeypatch):
    """build() checked the sglang wheel only, and only when its name was in the release record."""
    cache = tmp_path / "cache"
    cache.mkdir()
    sglang = _wheel(cache / "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl", {
        "sglang/__init__.py": "", "sglang-0.5.23.dist-info/METADATA":
            "Metadata-Version: 2.4\nName: sglang\nRequires-Dist: sglang-kernel==0.4.10\nRequires-Dist: torch==2.14.1\n",
        "sglang/srt/mem_cache/rust_tree_core/mem_cache.cpython-312-x86_64-linux-gnu.so": "elf",
        "sglang-0.5.23.dist-info/RECORD": ""})
    kernel = _wheel(cache / "sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl", {
        "sgl_kernel/__init__.py": "", "sglang_kernel-0.4.5.dist-info/RECORD": ""})
    small = _wheel(cache / "dill-0.4.1-py3-none-any.whl", {"dill/__init__.py": "", "dill-0.4.1.dist-info/RECORD": ""})
    by_name = {"sglang": sglang, "sglang-kernel": kernel, "dill": small}
    monkeypatch.setattr(carry, "download", lambda spec, dest, python=carry.PYTHON: by_name[spec.split("==")[0]])
    monkeypatch.setattr(carry, "wheel_plan", lambda pins, image, flashinfer=None: {"dill": "0.4.1"})
    recorded = {w.name: _sha(w.read_bytes()) for w in (sglang, kernel, small)}
    facts = carry.build("0.5.23", tmp_path / "out", cache, image=set(), recorded_wheels=recorded, limit=2**30)
    listed = json.loads((tmp_path / "out" / "carry.json").read_text())
    assert listed["sha256"] == {p.name: _sha(p.read_bytes()) for p in (tmp_path / "out").iterdir()
                                if p.name != "carry.json"}
    # Issue 35: 0.5.23's Rust tree core is built for torch 2.14 and aborts the scheduler on the image's 2.11
    assert facts["env"] == {"SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
                            "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
    assert "Python radix tree core" in facts["label"]
    for name in recorded:
        with pytest.raises(SystemExit, match="no sha256 recorded"):
            carry.build("0.5.23", tmp_path / "out", cache, image=set(), limit=2**30,
                        recorded_wheels={k: v for k, v in recorded.items() if k != name})


def test_the_tree_core_setting_is_left_out_where_the_release_matches_the_image(tmp_path):
    rust = _wheel(tmp_path / "a.whl", {"sglang/srt/mem_cache/rust_tree_core/mem_cache.cpython-312.so": "x"})
    plain = _wheel(tmp_path / "b.whl", {"sglang/__init__.py": ""})
    assert carry.tree_core_env(rust, {"torch": "2.14.1"}) == {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
    assert carry.tree_core_env(rust, {"torch": carry.IMAGE_TORCH}) == {}
    assert carry.tree_core_env(plain, {"torch": "2.14.1"}) == {}


def test_the_recorded_wheels_cover_the_carries_the_docs_name():
    recorded = json.loads(carry.WHEELS_JSON.read_text())
    assert all(len(d) == 64 and int(d, 16) >= 0 for d in recorded.values())
    for name in ("sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl", "flashinfer_python-0.6.15.post1-py3-none-any.whl",
                 "flashinfer_python-0.6.18-py3-none-any.whl", "transformers-5.12.1-py3-none-any.whl"):
        assert name in recorded, name
    assert carry.recorded_wheels("0.5.23")["sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl"]
