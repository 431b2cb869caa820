"""Shared by the tests/test_fleet_*.py files: fake entries, tree snapshots, CLI runs."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from sglang_hicache_jit.buildcache.arch import parse_arch_list
from sglang_hicache_jit.buildcache.cache import BuildCache, Entry, write_manifest
from sglang_hicache_jit.buildcache.spec import BuildSpec, derive_key
from sglang_hicache_jit.buildcache.toolchain import find_toolkit

ROOT = Path(__file__).resolve().parent.parent
# Same CUDA major.minor as the local toolkit (if any), so the loader accepts fake entries (cache.acceptable).
_LOCAL = find_toolkit()
FAKE_TOOLKIT = f"cuda-{_LOCAL.version if _LOCAL else '13.0'}-nvcc1"


def fake_entry(cache: BuildCache, archs: str = "9.0", *, toolkit: str = FAKE_TOOLKIT, payload: bytes | None = None,
               abi_key: str | None = None, **components) -> Entry:
    """Publishes an entry whose manifest is real for this machine (ABI key, components) but whose
    library is random bytes: enough for lookups, verification, bundles and pruning, not for dlopen."""
    spec = BuildSpec.for_archs(parse_arch_list(archs))
    abi = abi_key or spec.abi_key
    key = derive_key(abi, toolkit)
    name = f"{spec.kernel}_{key}"
    cache.ensure_root()
    staging = cache.new_staging_dir(f"{spec.kernel}-{key}") / "entry"
    staging.mkdir()
    (staging / f"{name}.so").write_bytes(payload if payload is not None else os.urandom(4096))
    (staging / "build.log").write_text("fake build\n")
    write_manifest(staging, {"name": name, "kernel": spec.kernel, "key": key, "abi_key": abi,
                             "components": dict(spec.abi_components, **components), "toolkit": toolkit,
                             "library": f"{name}.so", "log": "build.log"})
    entry = cache.publish(staging, spec.arch_tag, spec.kernel, key)
    staging.parent.rmdir()
    return entry


def snapshot(root: Path) -> dict:
    """Every path under ``root`` with its type, mode and content hash: equal snapshots, unchanged tree."""
    found = {}
    if not root.exists():
        return found
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath) / name
            st = path.lstat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() and not path.is_symlink() else ""
            found[str(path.relative_to(root))] = (st.st_mode, digest)
    return found


def entry_dirs(root: Path) -> list[str]:
    """Published entries (not staging or locks) under a cache root."""
    return sorted(str(p.relative_to(root)) for p in root.glob("v1/sm*/*") if p.is_dir())


def env_for(cache: Path, **extra) -> dict:
    env = dict(os.environ, SGLANG_HICACHE_JIT_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    for name in ("SGLANG_HICACHE_JIT_ARCH", "SGLANG_HICACHE_JIT_PREBUILT_DIRS", "SGLANG_HICACHE_JIT_CACHE_MAX_SIZE",
                 "SGLANG_HICACHE_JIT_LOCK_DIR"):
        env.pop(name, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def cli(*args, env, timeout=300):
    return subprocess.run([sys.executable, "-m", "sglang_hicache_jit", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


# A fresh process that loads 9.0 and fails if anything starts a subprocess (nvcc, ninja, a compiler).
NO_COMPILER_LOAD = (
    "import json, subprocess, sys, time, torch\n"
    "def refuse(*a, **k): raise AssertionError('a subprocess was started: ' + repr(a[:2]))\n"
    "subprocess.Popen.__init__ = refuse\n"
    "from sglang_hicache_jit.buildcache import loader\n"
    "from sglang_hicache_jit.buildcache.arch import parse_arch_list\n"
    "t = time.perf_counter(); lib = loader.load_kernels('9.0'); dt = time.perf_counter() - t\n"
    "assert hasattr(lib.ops, 'transfer'), lib\n"
    "print(json.dumps({'path': str(lib.path), 'seconds': dt, 'prebuilt': lib.entry.prebuilt}))\n"
)


# What only a build needs: a warm load must import none of it. Importing filelock alone took 65-80 ms on a
# 2-core machine, platformdirs ~2.7 ms and torch.utils.cpp_extension far more.
BUILD_ONLY = ("filelock", "platformdirs", "torch.utils.cpp_extension", "sglang_hicache_jit.buildcache.build",
              "sglang_hicache_jit.buildcache.prune", "sglang_hicache_jit.buildcache.remote",
              "sglang_hicache_jit.buildcache.bundle")

# A fresh process, after `import torch`: `import sglang_hicache_jit` through load_kernels('9.0'), refusing any
# subprocess. argv[1]: 'fake' replaces the dlopen (a fake library is random bytes), 'real' loads for real
# and checks the library's op namespace and the C entry points ops.py calls through ctypes.
WARM_LOAD = f"""
import json, subprocess, sys, torch
def refuse(*a, **k): raise AssertionError("a subprocess was started on the warm path")
subprocess.Popen.__init__ = refuse
before = set(sys.modules)
import sglang_hicache_jit
if sys.argv[1] == "fake":
    from sglang_hicache_jit.buildcache import loader
    loader._dlopen = lambda fd, entry: None
lib = sglang_hicache_jit.load_kernels("9.0")
if sys.argv[1] == "real":
    assert hasattr(lib.ops, "transfer"), lib
    for name in ("hicache_transfer_launch", "hicache_resident_create", "hicache_resident_submit",
                 "hicache_resident_stats", "hicache_resident_destroy"):
        assert hasattr(lib.handle, name), name
print(json.dumps({{"path": str(lib.path), "imported": [m for m in {BUILD_ONLY!r} if m in set(sys.modules) - before]}}))
"""


def warm_load(env: dict, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", WARM_LOAD, mode], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def load_without_compiler(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", NO_COMPILER_LOAD], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def manifest_of(entry_path: Path) -> dict:
    return json.loads((Path(entry_path) / "manifest.json").read_text())
