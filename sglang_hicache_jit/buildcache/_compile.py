"""Compiles one library with ninja; run as a script.

build.py starts this in a child process with stdout and stderr going to the
build log, the chosen toolkit and ninja first on PATH and a private build
directory, so that compiler output is captured whole and the parent process
keeps its own environment. The request holds the complete command lines
(build.py makes them); this writes them into a build.ninja, so the compiles
run in parallel (MAX_JOBS caps ninja's jobs), then links. It imports neither
torch nor sglang_hicache_jit: importing torch alone took 1.5-3 s on a 2-core
machine, as long as the compile. Exits non-zero when the build fails.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import time


def _stop_build(*_) -> None:
    """SIGTERM to our process group: ninja stops and passes the signal on to each
    job's own process group (nvcc, cicc); then SIGKILL for whatever is left."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    time.sleep(1.0)
    os.killpg(0, signal.SIGKILL)


def _die_with_parent(parent: int) -> None:
    """build.py started us as the leader of a new process group (ninja joins it,
    and runs each compiler job in a group of its own). When the builder dies,
    even by SIGKILL, the kernel sends us SIGTERM (PR_SET_PDEATHSIG) and we stop
    the whole build, so no compiler is left running for nobody."""
    signal.signal(signal.SIGTERM, _stop_build)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the next builder reaps what is left (prune.py)
        pass
    if os.getppid() != parent:  # the builder died before the request above
        _stop_build()


def _path(text: str) -> str:
    """A path in a ninja build line: '$', ' ' and ':' are escaped with '$'."""
    return text.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _command(argv: list) -> str:
    """A command line as a ninja variable: shell-quoted, '$' escaped."""
    return shlex.join(argv).replace("$", "$$")


def write_ninja(request: dict) -> str:
    lines = ["ninja_required_version = 1.3", "rule run", "  command = $cmd", ""]
    for step in request["steps"]:
        lines += [f"build {_path(step['output'])}: run {_path(step['input'])}",
                  f"  cmd = {_command(step['command'])}", ""]
    objects = " ".join(_path(step["output"]) for step in request["steps"])
    lines += [f"build {_path(request['library'])}: run {objects}", f"  cmd = {_command(request['link'])}", "",
              f"default {_path(request['library'])}", ""]
    path = os.path.join(request["build_dir"], "build.ninja")
    # Paths and $CC come from the environment as bytes, decoded with surrogateescape (a non-UTF-8 byte
    # is a lone surrogate); encoding the same way writes back exactly those bytes.
    with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write("\n".join(lines))
    return path


def step_times(build_dir: str) -> list:
    """(output, seconds) of each step of this build, from ninja's own log."""
    times = []
    try:
        with open(os.path.join(build_dir, ".ninja_log")) as f:
            for line in f:
                fields = line.rstrip("\n").split("\t")
                if len(fields) >= 4 and fields[0].isdigit() and fields[1].isdigit():
                    times.append((fields[3], (int(fields[1]) - int(fields[0])) / 1e3))
    except OSError:
        pass
    return times


def main(request_path: str) -> int:
    with open(request_path) as f:
        request = json.load(f)
    write_ninja(request)
    command = ["ninja", "-v", "-C", request["build_dir"]]
    jobs = os.environ.get("MAX_JOBS", "").strip()
    if jobs:
        command += ["-j", jobs]
    started = time.monotonic()
    result = subprocess.run(command, stdin=subprocess.DEVNULL)
    seconds = time.monotonic() - started
    # Per-step times for the log (tools/bench.py loader reads them for its breakdown).
    for output, step_seconds in step_times(request["build_dir"]):
        print(f"step {output} {step_seconds:.3f} s")
    print(f"ninja {seconds:.3f} s", flush=True)
    if result.returncode < 0:  # ninja was killed: die by the same signal, so build.py counts the build killed
        signal.signal(-result.returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -result.returncode)
    if result.returncode != 0:
        return result.returncode
    print(f"built {request['name']}", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2:
        _die_with_parent(int(sys.argv[2]))
    sys.exit(main(sys.argv[1]))
