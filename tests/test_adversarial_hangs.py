"""Adversarial: hangs. Every command runs in a subprocess with a timeout: a hang fails
the test instead of wedging the suite."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adversarial_helpers import cli_env
from fleet_helpers import ROOT, cli, fake_entry
from sglang_hicache_jit.buildcache.cache import BuildCache
from sglang_hicache_jit.buildcache.toolchain import find_toolkit

TIMEOUT = 30  # a command here takes about a second; a hang is a hang


def _run(*args, env):
    try:
        return cli(*args, env=env, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`sglang-hicache-jit {' '.join(args)}` hung for {TIMEOUT} s")


def _fifo_cache(root) -> BuildCache:
    """A cache whose entry (the exact key of this machine's toolkit) has a FIFO for a manifest."""
    toolkit = find_toolkit()
    cache = BuildCache(root)
    entry = fake_entry(cache, toolkit=toolkit.identity) if toolkit else fake_entry(cache)
    other = fake_entry(cache, toolkit="cuda-13.0-nvccOTHER")  # a same-ABI entry: found by find_abi's listing
    for path in (entry.path, other.path):
        (path / "manifest.json").unlink()
        os.mkfifo(path / "manifest.json")
    return cache


FIFO_COMMANDS = [("check", "--arch", "9.0", "--no-build"), ("info",), ("info", "--json"), ("prune",),
                 ("prewarm", "--arch", "9.0"), ("doctor", "--arch", "9.0"), ("export", "--arch", "9.0", "-o", "OUT")]

# One child runs every command of FIFO_COMMANDS through the CLI's main(), and load_kernels(build=False),
# each on a cache of its own, with its stdout and stderr in files of its own: one torch import instead of
# eight (8-12 s of the default set). A hang makes faulthandler write the stack to that command's stderr
# file and end the child, which the fixture then starts again for the commands after it.
FIFO_CHILD = r"""
import faulthandler, json, os, sys, traceback
from sglang_hicache_jit.cli import main
from sglang_hicache_jit.buildcache import loader
jobs = json.loads(sys.argv[1])
for job in jobs:
    os.environ["SGLANG_HICACHE_JIT_CACHE_DIR"] = job["cache"]
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(job["out"], "wb") as out, open(job["err"], "wb") as err:
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        faulthandler.dump_traceback_later(float(sys.argv[2]), exit=True)
        try:
            if job["args"] == ["load_kernels"]:
                try:
                    loader.load_kernels("9.0", build=False)
                except Exception as exc:
                    print(type(exc).__name__, getattr(exc, "code", ""))
                code = 0
            else:
                code = main(job["args"])
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc()
            code = "exception"
        faulthandler.cancel_dump_traceback_later()
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
    os.close(saved[0]); os.close(saved[1])
    with open(job["done"], "w") as done:
        done.write(json.dumps(code))
"""


@pytest.fixture(scope="module")
def fifo_runs(tmp_path_factory):
    """Each command of FIFO_COMMANDS (and load_kernels) run on a FIFO-manifest cache of its own: by args,
    (exit code or None when not run, stdout, stderr)."""
    base = tmp_path_factory.mktemp("fifo")
    jobs = []
    for i, args in enumerate(FIFO_COMMANDS + [("load_kernels",)]):
        args = [str(base / f"b{i}.tar.gz") if a == "OUT" else a for a in args]
        jobs.append({"args": args, "cache": str(_fifo_cache(base / f"cache{i}").root), "out": str(base / f"{i}.out"),
                     "err": str(base / f"{i}.err"), "done": str(base / f"{i}.done")})
    # CXX and CC /bin/false: where the entry is (rightly) found corrupt, prewarm's and export's builds fail
    # at once (nvcc -ccbin /bin/false too) instead of compiling for 5-10 s.
    env = cli_env(base / "unused", CXX="/bin/false", CC="/bin/false")
    pending, died = list(jobs), {}
    while pending:  # after a hang the child is started again for the commands after that one
        try:
            child = subprocess.run([sys.executable, "-c", FIFO_CHILD, json.dumps(pending), str(TIMEOUT)], env=env,
                                   cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT * len(pending) + 60)
        except subprocess.TimeoutExpired:
            pytest.fail("the FIFO commands' child hung past every command's own watchdog")
        unfinished = [job for job in pending if not Path(job["done"]).exists()]
        if unfinished:
            died[unfinished[0]["done"]] = child.stderr
        pending = unfinished[1:]
    runs = {}
    for job, args in zip(jobs, FIFO_COMMANDS + [("load_kernels",)]):
        read = lambda key: Path(job[key]).read_text(errors="replace") if Path(job[key]).exists() else ""
        code = json.loads(read("done")) if read("done") else None
        runs[args] = (code, read("out"), read("err") + died.get(job["done"], ""))
    return runs


@pytest.mark.parametrize("args", FIFO_COMMANDS, ids=[" ".join(a) for a in FIFO_COMMANDS])
def test_a_fifo_for_a_manifest_does_not_hang(fifo_runs, args):
    code, out, err = fifo_runs[args]
    assert code is not None, f"`sglang-hicache-jit {' '.join(args)}` hung for {TIMEOUT} s or died:\n{err[-3000:]}"
    assert "Traceback" not in err, err


def test_load_kernels_with_a_fifo_manifest_does_not_hang(fifo_runs):
    code, out, err = fifo_runs[("load_kernels",)]
    assert code is not None, f"load_kernels hung on a FIFO manifest for {TIMEOUT} s or died:\n{err[-3000:]}"
    assert "NotBuiltError not_built" in out, out + err


def test_a_fifo_given_as_a_bundle_does_not_hang(tmp_path):
    fifo = tmp_path / "bundle.tar.gz"
    os.mkfifo(fifo)
    out = _run("import", str(fifo), env=cli_env(tmp_path / "cache"))
    assert out.returncode == 1 and "bundle_unreadable" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_fifo_failure_record_or_owner_file_does_not_hang(tmp_path, monkeypatch):
    """The failure memo and the lock holder file are read by waiting processes too."""
    cache = BuildCache(tmp_path / "cache")
    cache.ensure_root()
    fifo_record = cache.failure_path("sm90", "hicache_transfer", "a" * 16)
    fifo_record.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo_record)
    owner = tmp_path / "x.owner"
    os.mkfifo(owner)
    code = ("from sglang_hicache_jit.buildcache import loader\nfrom sglang_hicache_jit.buildcache.cache import BuildCache\n"
            f"c = BuildCache({str(cache.root)!r})\n"
            "print(c.read_failure('sm90', 'hicache_transfer', 'a' * 16))\n"
            f"print(loader._read_owner(__import__('pathlib').Path({str(owner)!r})))\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], env=cli_env(cache.root), cwd=ROOT, capture_output=True,
                             text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail("reading a FIFO record hung")
    assert out.stdout.split() == ["None", "another", "process"], out.stdout + out.stderr


@pytest.mark.parametrize("value", ["nan", "1e999"])  # 1e999 is inf
def test_an_endless_lock_timeout_is_refused_not_waited_on(tmp_path, value):
    """A holder keeps the build lock; with LOCK_TIMEOUT=nan/inf the old code waited forever."""
    cache = BuildCache(tmp_path / "cache")
    env = cli_env(cache.root, SGLANG_HICACHE_JIT_LOCK_TIMEOUT=value)
    holder_code = ("import sys\nfrom sglang_hicache_jit.buildcache import loader\n"
                   "from sglang_hicache_jit.buildcache.arch import parse_arch_list\nfrom sglang_hicache_jit.buildcache.spec import BuildSpec\n"
                   "from sglang_hicache_jit.buildcache.toolchain import find_toolkit\n"
                   "spec = BuildSpec.for_archs(parse_arch_list('9.0'))\n"
                   "with loader._build_lock(loader.writable_cache(), spec, spec.key(find_toolkit().identity)):\n"
                   "    print('held', flush=True); sys.stdin.read()\n")
    if find_toolkit() is None:
        pytest.skip("needs a CUDA toolkit (prewarm stops earlier without one)")
    holder = subprocess.Popen([sys.executable, "-c", holder_code], env=cli_env(cache.root), cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        out = _run("prewarm", "--arch", "9.0", env=env)
        assert out.returncode == 2 and "SGLANG_HICACHE_JIT_LOCK_TIMEOUT" in out.stderr, out.stdout + out.stderr
        assert "Traceback" not in out.stderr
        doctor = _run("doctor", "--arch", "9.0", env=env)
        assert doctor.returncode == 1 and "no problems" not in doctor.stdout
        assert "SGLANG_HICACHE_JIT_LOCK_TIMEOUT" in doctor.stdout
    finally:
        holder.communicate("", timeout=30)
