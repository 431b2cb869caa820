"""Compiles one BuildSpec into a complete, unpublished entry directory.

The compile runs ``_compile.py`` in a child process, which has ninja run the
command lines made here (nvcc for the .cu, c++ for the binding, in parallel,
then the link) with verbose output into the build log and its steps to the
logger (progress.py), inside a private staging directory. The sources are
copied there first, so the bytes compiled are the bytes the key was computed
from. Every tool also keeps its temporary files there (TMPDIR, see build_env):
nothing of a build is written to, or read back from, the shared /tmp.

The command lines are written here instead of by torch.utils.cpp_extension:
importing torch in the child cost 1.5-3 s of a 3 s build on a 2-core machine.
They are what cpp_extension would run for these sources, less what they do not
use (Python and torch/extension.h include paths, the half-precision guards,
libtorch_python).

The child runs in its own process group and stops the whole build (ninja
and, through ninja, every nvcc and cicc) when this process dies, even by
SIGKILL: _compile.py asks the kernel for a signal on its parent's death. As a
second guard, the next builder of the entry kills any process still working
inside a dead builder's staging directory and removes the directory
(prune.reap_stale_staging).

A failure is classified: a compiler that exited with an error is final until
the sources, flags or toolkit change (``compile_error``); a compile killed by
a signal (``killed``), a full disk (``no_space``) or a staging directory that
vanished (``vanished``) are transient, and the next call builds again.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .cache import BUILD_LOG, write_manifest
from ..errors import BuildFailedError
from .progress import follow
from .spec import BuildSpec
from .toolchain import BuildTools, host_cc, tool_env, torch_root
from .. import settings

_COMPILE_SCRIPT = Path(__file__).with_name("_compile.py")


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


_NO_SPACE = ("No space left on device", "Disk quota exceeded")


def _classify(returncode: int, text: str) -> tuple[str, bool]:
    """(cause, transient) of a failed compile."""
    if returncode < 0:
        return "killed", True
    if any(marker in text for marker in _NO_SPACE):
        return "no_space", True
    return "compile_error", False


def _run_compiler(args: list[str], log, env: dict, cwd: Path, what: str) -> int:
    """Runs the compile child in its own process group, its output copied to ``log`` and its progress
    logged (progress.follow); if this call is interrupted (Ctrl-C, an exception), the whole group is
    killed, not just the child."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        return follow(proc, log_file=log, what=what)
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the child's handler stops ninja and its jobs
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
        raise


def build_steps(spec: BuildSpec, name: str, tools: BuildTools, src_dir: Path) -> tuple[list[dict], list[str]]:
    """The compile steps (one per source: input, output, command line) and the link command line,
    all run inside the build directory."""
    torch_dir = torch_root()
    steps = []
    for source in spec.sources:
        path = str(src_dir / source)
        if source.endswith(".cu"):
            output = f"{Path(source).stem}.cuda.o"
            cc = host_cc()
            ccbin = ["-ccbin", cc] if cc else []  # as torch does
            command = [str(tools.toolkit.nvcc), *ccbin, *spec.cuda_flags(), f"-I{src_dir}", "-c", path, "-o", output]
        else:
            output = f"{Path(source).stem}.o"
            command = [tools.cxx, f"-DTORCH_EXTENSION_NAME={name}", f"-I{src_dir}", "-isystem",
                       str(torch_dir / "include"), *spec.cxx_flags(), "-c", path, "-o", output]
        steps.append({"input": path, "output": output, "command": command})
    cuda_lib = tools.toolkit.home / "lib64"
    if not cuda_lib.exists() and (tools.toolkit.home / "lib").exists():  # some installs (conda) have only lib/
        cuda_lib = tools.toolkit.home / "lib"
    link = [tools.cxx, *(step["output"] for step in steps), f"-L{torch_dir / 'lib'}", f"-L{cuda_lib}",
            *spec.link_flags(), "-o", f"{name}.so"]
    return steps, link


def build_env(tools: BuildTools, staging: Path) -> dict:
    """The compile's environment: the chosen toolkit and ninja first on PATH, and ``staging/tmp`` as
    the temporary directory of every tool (toolchain.tool_env). nvcc names its intermediates
    ``tmpxft_<pid>_...`` (cudafe1.cpp, ptx, cubin, fatbin) in $TMPDIR, /tmp by default, where
    another user could plant a file to inject code into the library, or a symlink that ptxas writes
    through. ``staging`` is 0700 in a cache private to this user: nobody else can reach it."""
    tmp = staging / "tmp"
    tmp.mkdir(mode=0o700)
    env = tool_env(tmp)
    env["CUDA_HOME"] = str(tools.toolkit.home)
    env["PATH"] = os.pathsep.join([str(Path(tools.ninja).parent), str(tools.toolkit.home / "bin"), env.get("PATH", "")])
    jobs = settings.build_jobs()
    if jobs is not None:
        env["MAX_JOBS"] = str(jobs)
    return env


def compile_entry(spec: BuildSpec, key: str, tools: BuildTools, staging: Path) -> tuple[Path, float]:
    """Builds into ``staging/entry`` (library, build.log, manifest.json).

    Returns the entry directory and the compile seconds; raises
    BuildFailedError with the log's text when the compiler fails.
    """
    try:
        return _compile_entry(spec, key, tools, staging)
    except OSError as exc:  # our own writes into staging: a full disk, or the directory removed under us
        transient_cause = {errno.ENOSPC: "no_space", errno.EDQUOT: "no_space", errno.ENOENT: "vanished"}
        cause = transient_cause.get(exc.errno)
        if cause is None:
            raise
        raise BuildFailedError(f"Building {spec.extension_name(key)} for {spec.arch_tag} failed: {exc}",
                               transient=True, cause=cause) from None


def _compile_entry(spec: BuildSpec, key: str, tools: BuildTools, staging: Path) -> tuple[Path, float]:
    name = spec.extension_name(key)
    src_dir = staging / "src"
    build_dir = staging / "build"
    entry_dir = staging / "entry"
    for directory in (src_dir, build_dir, entry_dir):
        directory.mkdir(mode=0o700)
    for filename, data in spec.files:
        (src_dir / filename).write_bytes(data)

    steps, link = build_steps(spec, name, tools, src_dir)
    request = {"name": name, "steps": steps, "link": link, "library": f"{name}.so", "build_dir": str(build_dir)}
    request_path = staging / "request.json"
    request_path.write_text(json.dumps(request, indent=2))

    env = build_env(tools, staging)
    log_path = entry_dir / BUILD_LOG
    started = time.monotonic()
    with open(log_path, "wb") as log:
        log.write(f"# {name} for {', '.join(map(str, spec.archs))} with {tools.nvcc_version}\n".encode())
        log.flush()
        returncode = _run_compiler([sys.executable, str(_COMPILE_SCRIPT), str(request_path), str(os.getpid())],
                                   log, env, staging, f"{spec.kernel} for {spec.arch_tag}")
    seconds = time.monotonic() - started
    library = build_dir / f"{name}.so"
    if returncode != 0 or not library.is_file():
        text = log_path.read_text(errors="replace")
        cause, transient = _classify(returncode, text)
        how = f"was killed by signal {-returncode}" if returncode < 0 else f"failed (exit {returncode})"
        raise BuildFailedError(f"Compiling {name} for {spec.arch_tag} {how}:\n{_tail(text)}",
                               log_path=str(log_path), cause=cause, transient=transient)
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
