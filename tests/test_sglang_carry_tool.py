"""tools/sglang_carry.py, the carry of SGLang releases for the offline GPU machine: the sglang wheel checked
against the release record's sha256 (a wheel of another platform tag is never taken instead), no wheel member
that could leave the trimmed tree, no link in it, and every other wheel checked against its recorded sha256
with nothing unchecked left where tools/gpu_carry.sh installs it. No network: the wheels are made here and
pip download is stubbed."""

import hashlib
import io
import json
import stat
import subprocess
import sys
import tarfile
import types
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import sglang_carry as tool  # noqa: E402

carry = tool.server_carry()  # tools/sglang_server/carry.py, as the tool itself loads it

RECORDED = "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl"
OTHER_TAG = "sglang-0.5.23-cp312-cp312-manylinux_2_28_x86_64.whl"
LOADED = ["sglang/__init__.py", "sglang/srt/x.py"]  # relative to the release tree, as loaded_modules() lists them


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _wheel_bytes(members: dict) -> bytes:
    """A zip of {name: data}; a (data, unix mode) value sets the member's mode (a link, setuid)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, value in members.items():
            data, mode = value if isinstance(value, tuple) else (value, None)
            if mode is None:
                z.writestr(name, data)
            else:
                info = zipfile.ZipInfo(name)
                info.create_system, info.external_attr = 3, mode << 16
                z.writestr(info, data)
    return buffer.getvalue()


GOOD = {"sglang/__init__.py": b"", "sglang/srt/x.py": b"X = 1\n", "sglang/other/y.py": b"Y = 1\n",
        "sglang/jit_kernel/include/hicache.cuh": b"// kernel\n",
        "sglang-0.5.23.dist-info/METADATA": b"Name: sglang\nVersion: 0.5.23\n"}
GOOD_WHEEL = _wheel_bytes(GOOD)


@pytest.fixture
def release(tmp_path, monkeypatch):
    """The release record names RECORDED with ``digest`` (GOOD_WHEEL's unless set); download() is stubbed:
    ``served`` {file name: bytes} is what pip download writes into the cache; ``downloads`` lists the calls."""
    state = types.SimpleNamespace(cache=tmp_path / "cache", digest=_sha(GOOD_WHEEL), served={}, downloads=[])
    state.cache.mkdir()
    monkeypatch.setattr(tool.release_kit, "record", lambda version: {"wheels": {
        "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl": "1" * 64, RECORDED: state.digest}})

    def download(spec, dest, python):
        state.downloads.append(spec)
        for name, data in state.served.items():
            (dest / name).write_bytes(data)

    monkeypatch.setattr(tool, "download", download)
    state.trim = lambda: tool.trimmed_tree("0.5.23", "3.12", state.cache, LOADED)
    return state


def _members(tree: bytes) -> dict:
    with tarfile.open(fileobj=io.BytesIO(tree), mode="r:gz") as tar:
        return {m.name: m for m in tar.getmembers()}


# ---------------------------------------------------------------------------
# The sglang wheel: the recorded one, byte for byte.

def test_the_recorded_sglang_wheel_is_trimmed_to_what_was_loaded(release):
    """The control for the refusals below: the recorded wheel, in the cache, is taken without a download."""
    (release.cache / RECORDED).write_bytes(GOOD_WHEEL)
    members = _members(release.trim())
    assert sorted(members) == ["sglang-0.5.23.dist-info/METADATA", "sglang/__init__.py",
                               "sglang/jit_kernel/include/hicache.cuh", "sglang/srt/x.py"]
    assert release.downloads == []


@pytest.mark.parametrize("cached", [None, b"tampered", GOOD_WHEEL + b"\0"],
                         ids=["downloaded", "cached-garbage", "cached-appended"])
def test_a_sglang_wheel_whose_bytes_differ_from_the_record_is_refused(release, cached):
    """The wheel at the recorded name, from the cache or from the index, but not the recorded bytes."""
    evil = _wheel_bytes({**GOOD, "sglang/srt/x.py": b"import os; os.system('touch /tmp/h-carry')\n"})
    if cached is not None:
        (release.cache / RECORDED).write_bytes(cached)
    release.served = {RECORDED: evil}
    with pytest.raises(SystemExit, match="sha256 differs from the recorded one"):
        release.trim()
    assert release.downloads == ["sglang==0.5.23"]


def test_a_tampered_cached_sglang_wheel_is_fetched_again_and_the_fresh_one_checked(release):
    (release.cache / RECORDED).write_bytes(_wheel_bytes({**GOOD, "sglang/srt/x.py": b"EVIL = 1\n"}))
    release.served = {RECORDED: GOOD_WHEEL}
    members = _members(release.trim())
    assert "sglang/srt/x.py" in members and release.downloads == ["sglang==0.5.23"]
    assert (release.cache / RECORDED).read_bytes() == GOOD_WHEEL


@pytest.mark.parametrize("stale", [False, True], ids=["downloaded", "already-cached"])
def test_a_sglang_wheel_of_another_platform_tag_is_refused_not_carried_unchecked(release, stale):
    """pip chose a wheel of another platform tag than the record's: its sha256 is recorded nowhere, so it is
    refused with the recorded wheel named, even when its bytes are a good wheel's."""
    release.served = {OTHER_TAG: GOOD_WHEEL}
    if stale:
        (release.cache / OTHER_TAG).write_bytes(GOOD_WHEEL)
    with pytest.raises(SystemExit, match=f"did not write the recorded wheel {RECORDED}"):
        release.trim()
    assert not (release.cache / RECORDED).exists()


# ---------------------------------------------------------------------------
# The sglang wheel's members: none outside the tree, no link (tools/gpu_carry.sh untars it with GNU tar).

@pytest.mark.parametrize("name", [
    "../evil.py",
    "sglang-0.5.23.dist-info/../../evil.py",  # kept by the dist-info rule were it not refused
    "sglang/jit_kernel/include/../../../../evil.cuh",  # kept by the JIT-source rule
    "sglang/srt/../../../evil.py",
    "/etc/cron.d/evil",
    "/sglang/srt/x.py",
    "sglang\\..\\..\\evil.py",
])
def test_a_sglang_wheel_member_that_could_leave_the_tree_refuses_the_whole_wheel(release, name):
    """Recorded bytes (the sha256 matches): the member rule is checked of the wheel itself, not assumed."""
    wheel = _wheel_bytes({**GOOD, name: b"x"})
    release.digest = _sha(wheel)
    (release.cache / RECORDED).write_bytes(wheel)
    with pytest.raises(SystemExit, match=r"has (a '\.\.' component|an absolute or unusual name); "
                                         "refusing the whole archive"):
        release.trim()


def test_a_link_or_special_mode_in_the_sglang_wheel_comes_out_a_plain_file(release):
    """A zip member marked as a symlink (to /etc/passwd), setuid, or a device is carried as a plain 0644 file of
    its bytes: no link, hard or symbolic, and no mode bit reaches the tar that gpu_carry.sh extracts."""
    wheel = _wheel_bytes({**GOOD, "sglang/srt/link.py": (b"/etc/passwd", stat.S_IFLNK | 0o777),
                          "sglang/srt/suid.py": (b"X = 2\n", stat.S_IFREG | 0o6755),
                          "sglang/srt/dev.py": (b"", stat.S_IFCHR | 0o666)})
    release.digest = _sha(wheel)
    (release.cache / RECORDED).write_bytes(wheel)
    tree = release.trim()
    members = _members(tree)
    assert {"sglang/srt/link.py", "sglang/srt/suid.py", "sglang/srt/dev.py"} <= set(members)
    for member in members.values():
        assert member.isreg() and member.linkname == "" and member.mode == 0o644, (member.name, member.type)
    with tarfile.open(fileobj=io.BytesIO(tree), mode="r:gz") as tar:
        assert tar.extractfile("sglang/srt/link.py").read() == b"/etc/passwd"


# ---------------------------------------------------------------------------
# Every other wheel of the carry: its recorded sha256, or the carry stops and leaves none of them behind.

DILL = ("dill-0.4.1-py3-none-any.whl", _wheel_bytes({"dill/__init__.py": b"", "dill-0.4.1.dist-info/RECORD": b""}))
IDNA = ("idna-3.10-py3-none-any.whl", _wheel_bytes({"idna/__init__.py": b"", "idna-3.10.dist-info/RECORD": b""}))


@pytest.fixture
def build(tmp_path, monkeypatch):
    """main() for release 0.5.23 into ``out``, its imports loading dill and idna; ``serve`` {spec: (file name,
    bytes) or None for a failing pip download} stands in for the index; ``recorded`` for the recorded sha256."""
    state = types.SimpleNamespace(out=tmp_path / "out", recorded={n: _sha(d) for n, d in (DILL, IDNA)},
                                  serve={"dill==0.4.1": DILL, "idna==3.10": IDNA}, downloads=[])
    (tmp_path / "have.txt").write_text("# the image has none of them\n")
    monkeypatch.setattr(sys, "argv", ["sglang_carry.py", "0.5.23", "-o", str(state.out),
                                      "--have", str(tmp_path / "have.txt")])
    monkeypatch.setattr(tool.release_kit, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(tool, "loaded_modules", lambda version: (LOADED, ["sglang", "dill", "idna"]))
    monkeypatch.setattr(tool, "trimmed_tree", lambda version, python, cache, relative: b"tree")
    monkeypatch.setattr(tool, "metadata", types.SimpleNamespace(
        packages_distributions=lambda: {"dill": ["dill"], "idna": ["idna"], "sglang": ["sglang"]},
        requires=lambda name: [], version={"dill": "0.4.1", "idna": "3.10"}.__getitem__))
    monkeypatch.setattr(carry, "recorded_wheels", lambda release: state.recorded)

    def download(spec, dest, python):
        state.downloads.append(spec)
        if state.serve.get(spec) is None:
            raise subprocess.CalledProcessError(1, ["pip", "download", spec])
        name, data = state.serve[spec]
        (dest / name).write_bytes(data)

    monkeypatch.setattr(tool, "download", download)
    return state


def test_a_carry_of_recorded_wheels_is_written(build):
    """The control for the refusals below."""
    assert tool.main() == 0
    listed = json.loads((build.out / "carry.json").read_text())
    assert listed["wheels"] == [DILL[0], IDNA[0]] and listed["releases"] == {"0.5.23": len(LOADED)}
    assert (build.out / "sglang-0.5.23.tar.gz").read_bytes() == b"tree"


def _tampered(build):
    build.serve["dill==0.4.1"] = (DILL[0], DILL[1] + b"\0")


def _other_tag(build):  # pip took a wheel of another tag than the recorded one
    build.serve["dill==0.4.1"] = ("dill-0.4.1-py2.py3-none-any.whl", DILL[1])


def _newest(build):  # no wheel of the installed version for the target Python: its newest, not recorded
    build.serve.update({"dill==0.4.1": None, "dill": ("dill-0.5.0-py3-none-any.whl", DILL[1])})


def _unrecorded(build):
    del build.recorded[IDNA[0]]


@pytest.mark.parametrize("attack, why", [
    (_tampered, "sha256 differs from the recorded"),
    (_other_tag, "dill-0.4.1-py2.py3-none-any.whl: no sha256 recorded for this wheel"),
    (_newest, "dill-0.5.0-py3-none-any.whl: no sha256 recorded for this wheel"),
    (_unrecorded, "idna-3.10-py3-none-any.whl: no sha256 recorded for this wheel"),
], ids=["tampered", "other-tag", "newest-fallback", "unrecorded"])
def test_a_wheel_in_the_carry_without_its_recorded_sha256_stops_the_carry(build, attack, why):
    """The carry stops, and no wheel is left in it: tools/gpu_carry.sh installs every .devwhl/*.whl."""
    attack(build)
    with pytest.raises(SystemExit, match=why.replace(".", r"\.")):
        tool.main()
    assert sorted(p.name for p in build.out.glob("*.whl")) == [], "a refused carry left wheels to be installed"
    assert not (build.out / "carry.json").exists()


def test_a_carry_whose_download_fails_leaves_no_unchecked_wheel_behind(build):
    build.serve.update({"idna==3.10": None, "idna": None})
    with pytest.raises(subprocess.CalledProcessError):
        tool.main()
    assert build.downloads == ["dill==0.4.1", "idna==3.10", "idna"]
    assert list(build.out.glob("*.whl")) == [], "dill's wheel was left in the carry unchecked"
