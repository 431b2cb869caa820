"""What one build is made of, and the key that names it in the cache.

The key is a sha256 over everything that changes the binary: the bytes of
every source and header, the compiler flags, the target archs, the CUDA
toolkit, torch's version (its C++ ABI), the Python ABI and this package's
version. It is split in two so that a machine without nvcc can still load an
entry built elsewhere for the same torch and Python:

* ``abi_key``: all of the above except the toolkit;
* ``key``: ``abi_key`` plus the toolkit identity. Without a toolkit the loader
  looks for any verified entry with the right ``abi_key`` (see loader.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
import sysconfig
from pathlib import Path

from .. import __version__, settings
from .arch import Arch, archs_tag
from .toolchain import torch_info

KERNEL = "hicache_transfer"
SOURCES = ("hicache_transfer.cu", "hicache_resident.cu", "binding.cpp")
HEADERS = ("hicache_transfer.h", "hicache_copy.cuh")
# build.py runs nvcc, c++ and the link itself (not torch.utils.cpp_extension), so these are the whole
# flags and all of them are in the key. The .cu is torch-free and built as C++17: C++20's standard
# headers cost nvcc's host passes about 0.5 s here and change no machine code (same SASS). The
# binding includes torch's headers and is built as torch builds extensions (C++20).
CUDA_FLAGS = ("-O3", "-std=c++17", "-Xcompiler=-fPIC")
# -lineinfo (source lines for profilers) leaves the machine code as it is but triples the device code's size:
# 0.82 MB instead of 0.27 MB of library, hashed and mapped on every warm load. Only on request.
LINEINFO_FLAGS = ("-lineinfo",)
CXX_FLAGS = ("-O2", "-std=c++20", "-fPIC", "-DUSE_CUDA")
# -z defs: a symbol that no library provides fails the link here, in the builder, not a dlopen in a server.
LINK_FLAGS = ("-shared", "-Wl,-z,defs")
LIBRARIES = ("c10", "c10_cuda", "torch_cpu", "torch_cuda", "torch", "cudart")  # torch's lib/, the toolkit's lib64/
LAYOUT_VERSION = "v1"  # bump when the cache layout or manifest format changes


def kernels_dir() -> Path:
    """The CUDA sources: inside the package in a wheel, beside it in a checkout."""
    return Path(_sources()[0])


@functools.lru_cache(maxsize=None)
def _sources() -> tuple[str, tuple[tuple[str, bytes], ...]]:
    """kernels_dir() and the bytes of its files (the key hashes them), found by reading each candidate's
    files rather than checking each one first: 0.1 ms less of every warm load."""
    package = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # this file is in sglang_hicache_jit/buildcache/
    for candidate in (os.path.join(package, "kernels"), os.path.join(os.path.dirname(package), "kernels")):
        files = []
        try:
            for name in SOURCES + HEADERS:
                with open(os.path.join(candidate, name), "rb") as f:
                    files.append((name, f.read()))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            continue
        return candidate, tuple(files)
    raise FileNotFoundError(
        f"the CUDA sources ({', '.join(SOURCES + HEADERS)}) are neither in {os.path.join(package, 'kernels')} "
        f"nor in {os.path.join(os.path.dirname(package), 'kernels')}; the installation is incomplete (reinstall the "
        "package)"
    )


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def derive_key(abi_key: str, toolkit_identity: str) -> str:
    """The cache key of a build of ``abi_key`` by a toolkit (also used to check manifests)."""
    return _sha256(f"{abi_key}:{toolkit_identity}".encode())[:16]


class BuildSpec:
    """One library to build: a kernel set for a tuple of archs. Not to be changed once made (the key is
    computed once); a plain class because a dataclass costs ~0.5 ms to define, on every warm load."""

    def __init__(self, archs: tuple[Arch, ...], kernel: str = KERNEL, files: tuple[tuple[str, bytes], ...] = ()):
        self.archs = archs
        self.kernel = kernel
        self.files = files

    def __repr__(self) -> str:
        return f"BuildSpec(archs={self.archs!r}, kernel={self.kernel!r})"

    @classmethod
    def for_archs(cls, archs: tuple[Arch, ...]) -> "BuildSpec":
        return cls(archs=tuple(sorted(archs)), files=_sources()[1])

    @property
    def arch_tag(self) -> str:
        return archs_tag(self.archs)

    @property
    def sources(self) -> tuple[str, ...]:
        return SOURCES

    def cuda_flags(self) -> list[str]:
        flags = list(CUDA_FLAGS) + (list(LINEINFO_FLAGS) if settings.lineinfo() else [])
        for arch in self.archs:
            flags += arch.nvcc_flags()
        return flags

    def cxx_flags(self) -> list[str]:
        return list(CXX_FLAGS)

    def link_flags(self) -> list[str]:
        return list(LINK_FLAGS) + [f"-l{name}" for name in LIBRARIES]

    @functools.cached_property
    def abi_components(self) -> dict:
        torch = torch_info()
        return {
            "layout": LAYOUT_VERSION,
            "package": __version__,
            "kernel": self.kernel,
            "sources": {name: _sha256(data) for name, data in self.files},
            "cuda_flags": self.cuda_flags(),
            "cxx_flags": self.cxx_flags(),
            "link_flags": self.link_flags(),
            "archs": [str(a) for a in self.archs],
            "torch": torch["version"],
            "torch_git": torch["git"],
            "torch_cuda": torch["cuda"],
            "python": sys.implementation.cache_tag,
            "soabi": sysconfig.get_config_var("SOABI") or "",
            "machine": platform.machine(),
        }

    @functools.cached_property
    def abi_key(self) -> str:
        return _sha256(json.dumps(self.abi_components, sort_keys=True).encode())[:16]

    def key(self, toolkit_identity: str) -> str:
        return derive_key(self.abi_key, toolkit_identity)

    def extension_name(self, key: str) -> str:
        """The library's file stem and torch op namespace: unique per build."""
        return f"{self.kernel}_{key}"
