"""Stress: 16 processes looping prewarm / load / prune on one cache for 60 s.

The compiler is replaced by a fake that takes 50-300 ms and writes a library
whose last 32 bytes are the sha256 of the rest, and dlopen by a check of the
bytes read through the loader's verified descriptor. So the test exercises the
real lookup, lock, staging, publication, verification, retry and pruning code
at a rate real builds could not reach, and it needs neither nvcc nor a GPU.
A loaded library that is partial or mixed fails its embedded checksum.
Set SGLANG_HICACHE_JIT_STRESS_SECONDS to shorten it while developing.
"""

import json
import os
import subprocess
import sys

import pytest

from fleet_helpers import ROOT, env_for
from sglang_hicache_jit.buildcache.cache import BuildCache, verify_entry

pytestmark = [pytest.mark.slow]

PROCESSES = 16
SECONDS = float(os.environ.get("SGLANG_HICACHE_JIT_STRESS_SECONDS", "60"))

WORKER = r'''
import hashlib, json, os, random, sys, time, traceback, types

from sglang_hicache_jit.buildcache.toolchain import torch_info

# The loader imports torch to dlopen; 16 real imports would only burn the 2 CPUs. A stand-in with the
# real version facts (they are part of the cache key) does.
info = torch_info()
torch = types.ModuleType("torch")
torch.__version__ = info["version"]
torch.version = types.SimpleNamespace(cuda=info["cuda"], git_version=info["git"])
class _Ops:
    loaded_libraries = set()
    def __getattr__(self, name): return name
torch.ops = _Ops()
sys.modules["torch"] = torch

from sglang_hicache_jit.buildcache import loader
from sglang_hicache_jit.buildcache.arch import parse_arch_list
from sglang_hicache_jit.buildcache.cache import write_manifest
from sglang_hicache_jit.buildcache.prune import prune

def fake_compile(spec, key, tools, staging):
    time.sleep(random.uniform(0.05, 0.3))
    entry_dir = staging / "entry"
    entry_dir.mkdir(mode=0o700)
    body = os.urandom(random.randint(32, 96) * 1024)
    name = spec.extension_name(key)
    # Written in pieces, so that a reader of a half-written file would see a wrong checksum.
    with open(entry_dir / f"{name}.so", "wb") as f:
        for i in range(0, len(body), 8192):
            f.write(body[i:i + 8192]); f.flush()
        f.write(hashlib.sha256(body).digest())
    (entry_dir / "build.log").write_text("fake\n")
    write_manifest(entry_dir, {"name": name, "kernel": spec.kernel, "key": key, "abi_key": spec.abi_key,
                               "components": spec.abi_components, "toolkit": "cuda-13.0-nvccSTRESS",
                               "library": f"{name}.so", "log": "build.log"})
    return entry_dir, 0.1

stats = {"loads": 0, "builds": 0, "prunes": 0, "removed": 0, "retries": 0}

def checked_dlopen(fd, entry):
    with open(f"/proc/self/fd/{fd}", "rb") as f:
        data = f.read()
    body, digest = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise AssertionError(f"a partial or mixed library was loaded: {entry.library} ({len(data)} bytes)")

real_load_entry = loader.load_entry
def counting_load_entry(entry, archs):
    try:
        return real_load_entry(entry, archs)
    except loader.CorruptEntry:
        stats["retries"] += 1
        raise

loader.compile_entry = fake_compile
loader.check_build_tools = lambda archs: types.SimpleNamespace(nvcc_version="fake nvcc")
loader.find_toolkit = lambda: types.SimpleNamespace(identity="cuda-13.0-nvccSTRESS")
loader._dlopen = checked_dlopen
loader.load_entry = counting_load_entry

archs = [parse_arch_list(a) for a in ("9.0", "8.0", "10.0")]
deadline = time.monotonic() + float(sys.argv[1])
random.seed(os.getpid())
try:
    while time.monotonic() < deadline:
        op = random.random()
        target = random.choice(archs)
        if op < 0.35:
            result = loader.ensure_built(target)
            stats["builds"] += result.action == "built"
        elif op < 0.88:
            loader._loaded.clear(); loader._by_archs.clear()  # load for real every time, not from the memo
            library = loader.load_kernels(";".join(map(str, target)))
            os.close(library.fd)
            stats["loads"] += 1
        else:
            report = prune(loader.writable_cache(), max_size=random.choice([0, 100 * 1024, 300 * 1024]))
            stats["prunes"] += 1
            stats["removed"] += sum(1 for _, why, _ in report.removed if "least recently used" in why)
except BaseException:
    traceback.print_exc()
    sys.exit(1)
print(json.dumps(stats))
'''


def test_sixteen_processes_prewarm_load_and_prune(tmp_path):
    cache = tmp_path / "cache"
    env = env_for(cache, SGLANG_HICACHE_JIT_LOCK_TIMEOUT=120)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(SECONDS)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(PROCESSES)]
    results = [p.communicate(timeout=SECONDS + 120) for p in procs]
    failures = [err[-3000:] for p, (out, err) in zip(procs, results) if p.returncode != 0]
    assert not failures, failures[0]
    stats = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    total = {k: sum(s[k] for s in stats) for k in stats[0]}
    print(total)
    # The run did what it claims: many loads, rebuilds after prunes, prunes that removed entries.
    assert total["loads"] >= 50 and total["builds"] >= 3 and total["removed"] >= 3, total
    # What is left is complete: every entry verifies, and nothing half-built is published.
    for arch_dir in (cache / "v1").iterdir():
        if not arch_dir.name.startswith("."):
            for entry in arch_dir.iterdir():
                if entry.is_dir():
                    verify_entry(entry, key=entry.name.rsplit("-", 1)[1])
    from sglang_hicache_jit.buildcache.prune import prune

    prune(BuildCache(cache))
    assert not list((cache / "v1" / ".staging").iterdir()), "staging directories of finished builders remain"
