"""SGLang releases for the tests: their records, their code, and a stand-in for the sgl-kernel they pin.

* ``record(version)`` / ``kernel_record(version)``: what ``tools/sglang_releases.py``
  recorded from the wheels (``tests/sglang_data/``).
* ``release_tree(version)``: the release's own code, from ``pip download --no-deps
  sglang==X``, checked against the recorded sha256 before anything of it is unpacked,
  and unpacked once into a private cache (``$SGLANG_HICACHE_JIT_TEST_RELEASES``, default
  ``~/.cache/sglang-hicache-jit-tests``). A cache that another user owns or can write, or
  a wheel that is not the recorded one, is refused.
* ``write_standin(dest, version)``: an ``sgl_kernel`` package whose ``kvcacheio``
  functions have the signatures of the sglang-kernel that release pins (generated from
  the record) and raise when called, as does every other name in it; that is the
  deployment this package exists for. Where flashinfer is not installed (it is 65 MB,
  and SGLang imports it on CUDA only for kernels the host pools never call), a
  ``flashinfer`` package of the version the release pins, every name raising, too.

Run as a script it writes a stand-in for the GPU scripts:
``python3 tests/release_kit.py standin 0.5.23 DIR``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "sglang_data"
TEMPLATE = HERE / "sglang_standin_package.py"


def version_key(v: str):
    import re

    return [int(p) if p.isdigit() else -1 for p in re.split(r"[.]|post", v)]


def recorded() -> list:
    """Every recorded sglang release, oldest first."""
    return sorted((p.name[len("sglang-"):-len(".json")] for p in DATA.glob("sglang-0*.json")), key=version_key)


def record(version: str) -> dict:
    return json.loads((DATA / f"sglang-{version}.json").read_text())


def kernel_record(version: str) -> dict | None:
    path = DATA / f"sglang-kernel-{version}.json"
    return json.loads(path.read_text()) if path.exists() else None


# What a newcomer installs to run the SGLang tests (README, docs/sglang.md).
SGLANG_EXTRA_HINT = 'pip install -e ".[test,sglang]"'


def missing_sglang_extra() -> list:
    """The distributions of this package's ``sglang`` extra that are not installed (the release tests import
    SGLang's pools, which need them). Read from the installed metadata, else from the checkout's pyproject."""
    import re
    from importlib.metadata import PackageNotFoundError, distribution, requires

    try:
        wanted = [r for r in requires("sglang-hicache-jit") or () if re.search(r"extra\s*==\s*.sglang.", r)]
    except PackageNotFoundError:
        try:
            import tomllib
        except ImportError:  # Python 3.10 from a bare checkout: nothing to read the list from
            return []
        wanted = tomllib.loads((HERE.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"][
            "sglang"]
    missing = []
    for requirement in wanted:
        name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
        try:
            distribution(name)
        except PackageNotFoundError:
            missing.append(name)
    return missing


# ---------------------------------------------------------------------------
# Release code.

class UntrustedCache(RuntimeError):
    pass


def cache_root() -> Path:
    root = Path(os.environ.get("SGLANG_HICACHE_JIT_TEST_RELEASES")
                or os.path.expanduser("~/.cache/sglang-hicache-jit-tests"))
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private(root)
    return root


def check_private(path: Path) -> None:
    """The directory must be ours, not a symlink, and writable by nobody else: code is loaded from it."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UntrustedCache(f"{path} is not a plain directory")
    if info.st_uid != os.getuid():
        raise UntrustedCache(f"{path} belongs to uid {info.st_uid}, not to this user")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedCache(f"{path} is writable by others (mode {stat.S_IMODE(info.st_mode):o})")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _wheel_for_this_python(version: str) -> tuple[str, str]:
    """(file name, sha256) of the recorded wheel this interpreter installs."""
    tags = (f"-cp{sys.version_info.major}{sys.version_info.minor}-", "-py3-none-any")
    wheels = record(version)["wheels"]
    for name, digest in wheels.items():
        if any(tag in name for tag in tags):
            return name, digest
    raise LookupError(f"sglang {version}: no recorded wheel for Python {sys.version_info.major}."
                      f"{sys.version_info.minor} (recorded: {sorted(wheels)}); run tools/sglang_releases.py {version}")


def release_tree(version: str) -> Path:
    """The directory holding the release's ``sglang`` package and its dist-info."""
    root = cache_root()
    name, digest = _wheel_for_this_python(version)
    tree = root / f"sglang-{version}-{digest[:16]}"
    if (tree / ".complete").exists():
        check_private(tree)
        return tree
    wheels = root / "wheels"
    wheels.mkdir(exist_ok=True, mode=0o700)
    check_private(wheels)
    wheel = wheels / name
    if not wheel.exists() or sha256(wheel) != digest:
        with tempfile.TemporaryDirectory(dir=wheels) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "-d", tmp, f"sglang=={version}"], check=True, capture_output=True)
            fetched = Path(tmp) / name
            if not fetched.exists():
                raise LookupError(f"pip download sglang=={version} gave {os.listdir(tmp)}, not {name}")
            os.replace(fetched, wheel)
    if sha256(wheel) != digest:
        raise UntrustedCache(f"{wheel}: sha256 differs from the recorded {digest}; refusing to load it")
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".unpack-{version}-"))
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(staging)
        (staging / ".complete").write_text(digest + "\n")
        os.replace(staging, tree)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (tree / ".complete").exists():  # not another process's identical tree that won the race
            raise
    return tree


# ---------------------------------------------------------------------------
# The sgl_kernel stand-in.

def _signature(params: list) -> str:
    parts, star = [], False
    for i, (name, kind, default) in enumerate(params):
        if kind == "KEYWORD_ONLY" and not star:
            parts.append("*")
            star = True
        if kind == "VAR_POSITIONAL":
            parts.append(f"*{name}")
            star = True
        elif kind == "VAR_KEYWORD":
            parts.append(f"**{name}")
        else:
            parts.append(name if default is None else f"{name}={default}")
        if kind == "POSITIONAL_ONLY" and (i + 1 == len(params) or params[i + 1][1] != "POSITIONAL_ONLY"):
            parts.append("/")
    return ", ".join(parts)


def _standin_package(dest: Path, name: str, version: str) -> Path:
    package = dest / name
    package.mkdir(parents=True, exist_ok=True)
    template = TEMPLATE.read_text().replace('__version__ = "0.0.0"', f'__version__ = "{version}"')
    (package / "__init__.py").write_text(template)
    return package


def write_standin(dest: Path, version: str) -> Path:
    """Writes ``dest/sgl_kernel`` for the sglang-kernel that sglang ``version`` pins; returns ``dest``."""
    pin = record(version)["sglang_kernel"]
    kernel = kernel_record(pin)
    if kernel is None:
        raise LookupError(f"sglang-kernel {pin} is not recorded; run tools/sglang_releases.py {version} --kernels")
    package = _standin_package(Path(dest), "sgl_kernel", pin)
    flashinfer = record(version).get("flashinfer")
    if flashinfer and importlib.util.find_spec("flashinfer") is None:
        _standin_package(Path(dest), "flashinfer", flashinfer)
    lines = [f'"""sgl_kernel.kvcacheio of sglang-kernel {pin}: its signatures (generated from '
             f'tests/sglang_data/sglang-kernel-{pin}.json), every call raises."""', "",
             "from sgl_kernel import UnavailableOp", ""]
    for name, params in kernel["kvcacheio"].items():
        lines += ["", f"def {name}({_signature(params)}):", f'    raise UnavailableOp("sgl_kernel.kvcacheio.{name}")()',
                  ""]
    (package / "kvcacheio.py").write_text("\n".join(lines))
    return Path(dest)


def tolerate_newer_transformers() -> None:
    """Older releases register model configs that newer transformers ship too; let the later one win
    (the test environment has one transformers for every release, not each release's pin)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return
    register = AutoConfig.register

    def register_again(model_type, config, exist_ok=False):
        return register(model_type, config, exist_ok=True)

    AutoConfig.register = staticmethod(register_again)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "standin":
        sys.exit("usage: python3 tests/release_kit.py standin <sglang version> <directory>")
    print(write_standin(Path(sys.argv[3]), sys.argv[2]))
