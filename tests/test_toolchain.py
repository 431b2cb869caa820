import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_hicache_jit.buildcache import toolchain
from sglang_hicache_jit.buildcache.arch import Arch
from sglang_hicache_jit.errors import ArchUnsupportedError, ToolchainError


def _fake_toolkit(root: Path, version: int = 13000) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\nexit 0\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    (root / "include" / "cuda.h").write_text(f"/* header */\n#define CUDA_VERSION {version}\n")
    return root


def test_cuda_home_wins(tmp_path, monkeypatch):
    home = _fake_toolkit(tmp_path / "cuda-x", 12080)
    monkeypatch.setenv("CUDA_HOME", str(home))
    toolkit = toolchain.find_toolkit()
    assert toolkit.home == home.resolve() and toolkit.version == "12.8" and toolkit.found_by == "$CUDA_HOME"


def test_an_explicit_cuda_home_that_is_not_a_toolkit_is_reported(tmp_path, monkeypatch, caplog):
    not_a_toolkit = tmp_path / "empty"
    not_a_toolkit.mkdir()
    monkeypatch.setenv("CUDA_HOME", str(not_a_toolkit))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    with caplog.at_level("WARNING", logger="sglang_hicache_jit"):
        toolkit = toolchain.find_toolkit()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"CUDA_HOME={not_a_toolkit} is not a CUDA toolkit" in warning
    assert toolkit is None or toolkit.home != not_a_toolkit
    assert (f"using {toolkit.home}" if toolkit else "no other toolkit found") in warning


def test_a_wrapper_nvcc_on_path_is_not_taken_for_a_toolkit(tmp_path, monkeypatch):
    wrappers = tmp_path / "wrappers"
    wrappers.mkdir()
    wrapper = wrappers / "nvcc"
    wrapper.write_text("#!/bin/sh\nexec /somewhere/else/nvcc \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{wrappers}{os.pathsep}{os.environ['PATH']}")
    toolkit = toolchain.find_toolkit()
    # torch would guess tmp_path (the wrapper's parent's parent); we must not.
    assert toolkit is None or toolkit.home != tmp_path
    if toolkit is not None:
        assert (toolkit.home / "include" / "cuda.h").is_file()


def test_no_toolkit_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(toolchain, "_candidates", lambda: [])
    toolchain._find_toolkit_cached.cache_clear()
    with pytest.raises(ToolchainError, match="CUDA_HOME") as info:
        toolchain.require_toolkit()
    assert info.value.code == "no_nvcc"
    toolchain._find_toolkit_cached.cache_clear()


def test_toolkit_identity_separates_patch_releases(tmp_path):
    a = _fake_toolkit(tmp_path / "a")
    b = _fake_toolkit(tmp_path / "b")
    (b / "bin" / "nvcc").write_text("#!/bin/sh\n# a longer binary\nexit 0\n")
    ta = toolchain.Toolkit(a, "13.0", "test")
    tb = toolchain.Toolkit(b, "13.0", "test")
    assert ta.identity != tb.identity and ta.identity.startswith("cuda-13.0-")


def test_torch_info_does_not_import_torch():
    code = ("import sys; from sglang_hicache_jit.buildcache.toolchain import torch_info; info = torch_info(); "
            "assert 'torch' not in sys.modules, 'torch was imported'; print(info['version'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    import torch

    assert out.stdout.strip() == torch.__version__


@pytest.mark.build
def test_real_toolchain_checks_and_arch_support():
    tools = toolchain.check_build_tools((Arch(9, 0),))
    assert tools.nvcc_version.startswith("release ") and "90" in tools.nvcc_archs
    with pytest.raises(ArchUnsupportedError, match="cannot target") as info:
        toolchain.check_build_tools((Arch(3, 0),))
    assert info.value.code == "arch_unsupported"


@pytest.mark.build
def test_cuda_major_mismatch_is_refused(monkeypatch):
    toolchain._build_tools.cache_clear()
    monkeypatch.setattr(toolchain, "torch_info", lambda: {"version": "x", "cuda": "99.0", "git": ""})
    try:
        with pytest.raises(ToolchainError, match="CUDA 99") as info:
            toolchain.check_build_tools((Arch(9, 0),))
        assert info.value.code == "cuda_version_mismatch"
    finally:
        toolchain._build_tools.cache_clear()
