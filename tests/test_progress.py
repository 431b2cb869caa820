"""Compile progress: ninja steps and a heartbeat at INFO, every byte in the build log (no compiler needed)."""

import io
import logging
import subprocess
import sys
import time

import pytest

from sglang_hicache_jit.buildcache.progress import describe_step, follow

# A stand-in for the build child: some chatter, a silence, then ninja-style steps.
CHILD = r"""
import sys, time
print("Emitting ninja build file", flush=True)
time.sleep(0.35)
print("[1/3] /usr/local/cuda/bin/nvcc -c /x/y/kernel.cu -o kernel.cuda.o", flush=True)
print("[2/3] c++ -c /x/y/binding.cpp -o binding.o", flush=True)
print("[3/3] c++ kernel.cuda.o binding.o -shared -o lib_abc.so", flush=True)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("line,expected", [
    (b"[1/3] /usr/local/cuda/bin/nvcc --flag -c /a/b.cu -o b.cuda.o\n", "[1/3] b.cuda.o"),
    (b"[3/3] c++ a.o b.o -shared -L/x -o /tmp/out/lib.so", "[3/3] lib.so"),
    (b"[2/10] something without an output", "[2/10] something without an output"),
    (b"Building extension module x...", None),
    (b"warning: [1/2] is not a step", None),
])
def test_describe_step(line, expected):
    assert describe_step(line) == expected


@pytest.mark.parametrize("exit_code", [0, 3])
def test_steps_and_heartbeat_are_logged_and_the_log_is_whole(caplog, exit_code):
    log_file = io.BytesIO()
    with caplog.at_level(logging.INFO, logger="sglang_hicache_jit"):
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(exit_code)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        code = follow(proc, log_file=log_file, what="k for sm90", heartbeat=0.1)
    assert code == exit_code
    messages = [r.getMessage() for r in caplog.records]
    assert "compiling k for sm90: [1/3] kernel.cuda.o" in messages
    assert "compiling k for sm90: [3/3] lib_abc.so" in messages
    beats = [m for m in messages if "so far, no step finished yet" in m]
    assert beats, messages  # the silence before the first step was filled
    text = log_file.getvalue().decode()
    assert text.startswith("Emitting ninja build file\n[1/3] /usr/local/cuda/bin/nvcc")
    assert text.rstrip().endswith("-o lib_abc.so")


def test_an_interrupted_wait_returns_at_once_and_leaves_the_child_to_the_caller(monkeypatch):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    real_wait = subprocess.Popen.wait

    def interrupted(self, timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess.Popen, "wait", interrupted)
    began = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            follow(proc, log_file=io.BytesIO(), what="k")
        assert time.monotonic() - began < 5  # no waiting on the child's output first
        assert proc.poll() is None  # still running: build.py stops its whole process group
    finally:
        monkeypatch.setattr(subprocess.Popen, "wait", real_wait)
        proc.kill()
        proc.wait()
