"""Compiles one library with torch.utils.cpp_extension.load; run as a script.

build.py starts this in a child process with stdout and stderr going to the
build log, CUDA_HOME pointing at the chosen toolkit and a private build
directory, so that compiler output is captured whole and the parent process
keeps its own environment. It does not import sglang_hicache_jit, so it works
whatever sys.path the parent had. Exits non-zero when the build fails.
"""

import json
import os
import signal
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


def main(request_path: str) -> None:
    with open(request_path) as f:
        request = json.load(f)
    from torch.utils.cpp_extension import load

    # Loads the result too (torch.ops.load_library): a library with unresolved
    # symbols fails here, in the builder, not later in a server.
    load(
        name=request["name"],
        sources=request["sources"],
        extra_cflags=request["cxx_flags"],
        extra_cuda_cflags=request["cuda_flags"],
        extra_include_paths=request["include_paths"],
        build_directory=request["build_dir"],
        verbose=True,
        is_python_module=False,
    )
    print(f"built {request['name']}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2:
        _die_with_parent(int(sys.argv[2]))
    main(sys.argv[1])
