"""Compiles one BuildSpec into a complete, unpublished entry directory.

The compile runs ``_compile.py`` in a child process (torch.utils.cpp_extension
.load with verbose output into the build log), inside a private staging
directory. The sources are copied there first, so the bytes compiled are the
bytes the key was computed from.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from .cache import BUILD_LOG, write_manifest
from .errors import BuildFailedError
from .spec import BuildSpec
from .toolchain import BuildTools
from . import settings

_COMPILE_SCRIPT = Path(__file__).with_name("_compile.py")


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def compile_entry(spec: BuildSpec, key: str, tools: BuildTools, staging: Path) -> tuple[Path, float]:
    """Builds into ``staging/entry`` (library, build.log, manifest.json).

    Returns the entry directory and the compile seconds; raises
    BuildFailedError with the log's text when the compiler fails.
    """
    name = spec.extension_name(key)
    src_dir = staging / "src"
    build_dir = staging / "build"
    entry_dir = staging / "entry"
    for directory in (src_dir, build_dir, entry_dir):
        directory.mkdir(mode=0o700)
    for filename, data in spec.files:
        (src_dir / filename).write_bytes(data)

    request = {
        "name": name,
        "sources": [str(src_dir / s) for s in spec.sources],
        "cxx_flags": spec.cxx_flags(),
        "cuda_flags": spec.cuda_flags(),
        "include_paths": [str(src_dir)],
        "build_dir": str(build_dir),
    }
    request_path = staging / "request.json"
    request_path.write_text(json.dumps(request, indent=2))

    env = dict(os.environ)
    env["CUDA_HOME"] = str(tools.toolkit.home)
    env["PATH"] = os.pathsep.join([str(Path(tools.ninja).parent), str(tools.toolkit.home / "bin"), env.get("PATH", "")])
    jobs = settings.build_jobs()
    if jobs is not None:
        env["MAX_JOBS"] = str(jobs)

    log_path = entry_dir / BUILD_LOG
    started = time.monotonic()
    with open(log_path, "wb") as log:
        log.write(f"# {name} for {', '.join(map(str, spec.archs))} with {tools.nvcc_version}\n".encode())
        log.flush()
        result = subprocess.run(
            [sys.executable, str(_COMPILE_SCRIPT), str(request_path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=staging,
        )
    seconds = time.monotonic() - started
    library = build_dir / f"{name}.so"
    if result.returncode != 0 or not library.is_file():
        text = log_path.read_text(errors="replace")
        raise BuildFailedError(
            f"Compiling {name} for {spec.arch_tag} failed (exit {result.returncode}):\n{_tail(text)}",
            log_path=str(log_path),
        )
    os.replace(library, entry_dir / library.name)
    write_manifest(entry_dir, {
        "name": name,
        "kernel": spec.kernel,
        "key": key,
        "abi_key": spec.abi_key,
        "components": spec.abi_components,
        "toolkit": tools.toolkit.identity,
        "library": library.name,
        "log": BUILD_LOG,
        "build_seconds": round(seconds, 3),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "nvcc": tools.nvcc_version,
        "cxx": tools.cxx_version,
    })
    return entry_dir, seconds
