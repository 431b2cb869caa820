"""Compiles one library with torch.utils.cpp_extension.load; run as a script.

build.py starts this in a child process with stdout and stderr going to the
build log, CUDA_HOME pointing at the chosen toolkit and a private build
directory, so that compiler output is captured whole and the parent process
keeps its own environment. It does not import sglang_hicache_jit, so it works
whatever sys.path the parent had. Exits non-zero when the build fails.
"""

import json
import sys


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
    main(sys.argv[1])
