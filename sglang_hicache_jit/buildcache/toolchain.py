"""Finding the CUDA toolkit, ninja and the host compiler, and checking them.

Two tiers, because the warm path must not start a subprocess:
  * ``toolkit_identity()`` reads files only (a few stat calls and the head of
    cuda.h) and names the toolkit for the cache key;
  * ``check_build_tools()`` runs ``nvcc --version`` and friends, once per
    process, only before a build.

The CUDA home is searched in this order: $CUDA_HOME / $CUDA_PATH, the ``nvcc``
on PATH when it sits inside a toolkit, then /usr/local/cuda and
/usr/local/cuda-*. A $CUDA_HOME or $CUDA_PATH that is not a toolkit is
reported with a warning, then the search goes on. An ``nvcc`` on PATH that is a wrapper script (its directory
holds no toolkit) is not trusted to locate one: torch's own guess takes its
parent directory and fails that way.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .. import settings
from .arch import Arch
from ..errors import ArchUnsupportedError, ToolchainError
from .record import record

log = logging.getLogger("sglang_hicache_jit")


class Toolkit(record("Toolkit", ["home", "version", "found_by"])):  # a record: see arch.Arch
    """A CUDA toolkit: home (Path), version ("13.0", from cuda.h), found_by (where the search found it)."""

    __slots__ = ()

    @property
    def nvcc(self) -> Path:
        return self.home / "bin" / "nvcc"

    @property
    def identity(self) -> str:
        """Names this toolkit in cache keys: version plus nvcc's size, which
        tells patch releases apart without hashing a 30 MB binary."""
        try:
            size = self.nvcc.stat().st_size
        except OSError:
            size = 0
        return f"cuda-{self.version}-nvcc{size}"


def _is_toolkit(home: Path) -> bool:
    home = str(home)  # os.path on strings: a third of what Path's operators cost (warm path)
    return os.path.isfile(os.path.join(home, "bin", "nvcc")) and os.path.isfile(os.path.join(home, "include", "cuda.h"))


def _which(name: str) -> str | None:
    """shutil.which for an executable name on Linux, in half its time (it ran on every warm load): the
    first PATH entry holding an executable regular file of that name."""
    for directory in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(directory or ".", name)
        if os.access(path, os.X_OK) and os.path.isfile(path):
            return path
    return None


def _header_version(home: Path) -> str | None:
    try:
        with open(home / "include" / "cuda.h", "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return None
    # '#define CUDA_VERSION 13000', found without a regex (its compile cost 0.1 ms of every warm load).
    at = head.find(b"#define CUDA_VERSION")
    if at < 0:
        return None
    start = at + len(b"#define CUDA_VERSION")
    digits = head[start:start + 256].split(maxsplit=1)  # not the rest of the 64 KB: copying it cost 35 us
    # 13000 is CUDA 13.0; a number of thousands of digits is not a version (and int() would raise).
    number = settings.whole_number(digits[0].decode("ascii", "replace"), 1000, 999_999) if digits else None
    if number is None:
        return None
    return f"{number // 1000}.{(number % 1000) // 10}"


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", os.path.basename(path)))


def _candidates():
    """Where a toolkit may be, in order; a generator, so the later places (a PATH search, a directory
    listing) are looked at only when the earlier ones hold no toolkit."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(variable, "").strip()
        if value:
            yield Path(value), f"${variable}"
    nvcc = _which("nvcc")
    if nvcc:
        yield Path(os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))), "nvcc on PATH"
    yield Path("/usr/local/cuda"), "/usr/local/cuda"
    try:  # /usr/local/cuda-*, listed without glob, whose first use costs 0.1-0.2 ms of the warm load
        versioned = [f"/usr/local/{name}" for name in os.listdir("/usr/local") if name.startswith("cuda-")]
    except OSError:
        versioned = []
    for path in sorted(versioned, key=_version_key, reverse=True):
        yield Path(path), path


@functools.lru_cache(maxsize=None)
def _find_toolkit_cached(environment: tuple) -> Toolkit | None:
    found, rejected = None, []
    for home, how in _candidates():
        version = _header_version(home) if _is_toolkit(home) else None
        if version:
            found = Toolkit(home.resolve(), version, how)
            break
        if how in ("$CUDA_HOME", "$CUDA_PATH"):
            rejected.append(f"{how[1:]}={home}")
    if rejected:
        # Named explicitly, yet unusable: say so rather than quietly build with a toolkit nobody chose.
        # (Cached per environment, so this is said once per process, not at every load.)
        log.warning("%s is not a CUDA toolkit (it needs bin/nvcc and an include/cuda.h that defines "
                    "CUDA_VERSION); %s",
                    " and ".join(rejected),
                    f"using {found.home} (found by {found.found_by}) instead" if found else "no other toolkit found")
    return found


def find_toolkit() -> Toolkit | None:
    """The CUDA toolkit to build with, or None. File reads only."""
    environment = tuple(os.environ.get(v, "") for v in ("CUDA_HOME", "CUDA_PATH", "PATH"))
    return _find_toolkit_cached(environment)


def require_toolkit() -> Toolkit:
    toolkit = find_toolkit()
    if toolkit is None:
        explicit = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        where = (f" (CUDA_HOME={explicit} has no bin/nvcc and include/cuda.h with a CUDA_VERSION)"
                 if explicit else "")
        raise ToolchainError(
            f"No CUDA toolkit found{where}: searched $CUDA_HOME, $CUDA_PATH, nvcc on PATH, "
            "/usr/local/cuda and /usr/local/cuda-*.",
            "install the CUDA toolkit (nvcc) matching torch's CUDA major version, or set CUDA_HOME "
            "to its directory.",
            code="no_nvcc",
        )
    return toolkit


def torch_info() -> dict:
    """torch's version, CUDA version and git revision, without importing torch
    when it is not imported yet (prewarm waiters and key checks stay light)."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "version"):
        return {
            "version": str(torch.__version__),
            "cuda": torch.version.cuda,
            "git": getattr(torch.version, "git_version", ""),
        }
    namespace: dict = {}
    version_file = torch_root() / "version.py"
    exec(compile(version_file.read_text(), str(version_file), "exec"), namespace)  # a plain constants file
    return {
        "version": str(namespace.get("__version__")),
        "cuda": namespace.get("cuda"),
        "git": namespace.get("git_version", ""),
    }


def torch_root() -> Path:
    """torch's package directory (its include/ and lib/ are what a build compiles and links against),
    found without importing torch."""
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        return Path(torch.__file__).parent
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise ToolchainError(
            "PyTorch is not installed.", "pip install torch (a CUDA build).", code="no_torch"
        )
    return Path(spec.origin).parent


def find_ninja() -> str | None:
    ninja = shutil.which("ninja")
    if ninja:
        return ninja
    try:  # the PyPI 'ninja' package, when its scripts directory is not on PATH
        import ninja as ninja_package

        candidate = Path(ninja_package.BIN_DIR) / "ninja"
        return str(candidate) if candidate.is_file() else None
    except (ImportError, AttributeError):
        return None


def tool_env(tmp: Path) -> dict:
    """The environment for a toolchain program, with ``tmp`` (a directory private to this user) as its
    temporary directory. nvcc puts ``tmpxft_<pid>_00000000*`` files in $TMPDIR, even for ``--version``,
    and deletes every file of its prefix there when it exits; the other tools (cudafe, cicc, ptxas,
    fatbinary, the host compiler) read TMPDIR too, some TMP or TEMP. In the shared /tmp another user
    could plant a file the compile reads back, or a symlink it writes through (issue 18, H1 and D1)."""
    env = dict(os.environ)
    for name in ("TMPDIR", "TMP", "TEMP"):
        env[name] = str(tmp)
    return env


def _run(cmd: list[str]) -> str:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sglang-hicache-jit-") as tmp:  # random name, mode 0700
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=tool_env(Path(tmp)))
    if result.returncode != 0:
        raise OSError(f"{' '.join(cmd)} exited with {result.returncode}: {result.stderr.strip()[:500]}")
    return result.stdout


# toolkit (Toolkit), nvcc_version (its full 'release 13.0, V13.0.88' line), nvcc_archs (frozenset of the
# compute capabilities nvcc can target, e.g. {"90", "100"}), ninja, cxx and cxx_version (str).
BuildTools = record("BuildTools", ["toolkit", "nvcc_version", "nvcc_archs", "ninja", "cxx", "cxx_version"])


@functools.lru_cache(maxsize=None)
def nvcc_facts(home: str) -> tuple[str, str, frozenset]:
    """Runs nvcc once per process: (its 'release X.Y, VX.Y.Z' line, its major version,
    the compute capabilities it can target, e.g. {"90", "100"})."""
    nvcc = Path(home) / "bin" / "nvcc"
    try:
        version_text = _run([str(nvcc), "--version"])
        arch_text = _run([str(nvcc), "--list-gpu-arch"])
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolchainError(
            f"{nvcc} does not run: {exc}", "repair the CUDA toolkit install or point CUDA_HOME at a working one.",
            code="no_nvcc",
        ) from None
    release = re.search(r"release (\d+)\.(\d+).*", version_text)
    nvcc_version = release.group(0).strip() if release else version_text.strip().splitlines()[-1]
    major = release.group(1) if release else ""
    return nvcc_version, major, frozenset(re.findall(r"compute_(\d+)", arch_text))


def check_cuda_agreement(nvcc: Path, nvcc_major: str) -> None:
    """ToolchainError unless torch is a CUDA build of the same major version as nvcc."""
    torch_cuda = torch_info()["cuda"]
    if torch_cuda is None:
        raise ToolchainError(
            "This PyTorch is a CPU-only build (torch.version.cuda is None); the kernels need a CUDA build.",
            "install a CUDA build of torch (e.g. pip install torch from the CUDA index).",
            code="cuda_version_mismatch",
        )
    if nvcc_major != torch_cuda.split(".")[0]:
        raise ToolchainError(
            f"nvcc at {nvcc} is CUDA {nvcc_major}.x but torch was built with CUDA {torch_cuda}.",
            f"install CUDA {torch_cuda.split('.')[0]}.x and set CUDA_HOME to it, or install a torch "
            f"built for CUDA {nvcc_major}.",
            code="cuda_version_mismatch",
        )


def require_ninja() -> str:
    ninja = find_ninja()
    if ninja is None:
        raise ToolchainError(
            "ninja is not installed; the build needs it to compile.",
            "pip install ninja",
            code="no_ninja",
        )
    return ninja


def host_cc() -> str | None:
    """$CC when set: nvcc's host compiler (``-ccbin``, as torch's extension builder passes it).
    ToolchainError (``no_cxx``) unless it names an executable: a CC that is not a compiler, or not
    even text (non-UTF-8 bytes), otherwise failed inside the compile and was remembered as a
    compile error."""
    cc = os.environ.get("CC")
    if not cc:
        return None
    if shutil.which(cc) is None:
        raise ToolchainError(
            f"CC={cc!r} (nvcc's host compiler, passed as -ccbin) is not an executable on PATH.",
            "set CC to a host compiler nvcc supports (e.g. CC=gcc), or unset it.",
            code="no_cxx",
        )
    return cc


def require_cxx() -> tuple[str, str]:
    """The host C++ compiler ($CXX, else c++) and its version line."""
    cxx = os.environ.get("CXX", "c++")
    cxx_path = shutil.which(cxx)
    if cxx_path is None:
        raise ToolchainError(
            f"The host C++ compiler {cxx!r} is not on PATH.",
            "install g++ (e.g. apt-get install g++) or set CXX to a compiler.",
            code="no_cxx",
        )
    try:
        cxx_version = _run([cxx_path, "--version"]).splitlines()[0]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        cxx_version = "unknown"
    return cxx_path, cxx_version


@functools.lru_cache(maxsize=None)
def _build_tools(home: str, version: str, found_by: str) -> BuildTools:
    toolkit = Toolkit(Path(home), version, found_by)
    nvcc_version, nvcc_major, archs = nvcc_facts(home)
    check_cuda_agreement(toolkit.nvcc, nvcc_major or version.split(".")[0])
    ninja = require_ninja()
    cxx_path, cxx_version = require_cxx()
    return BuildTools(toolkit, nvcc_version, archs, ninja, cxx_path, cxx_version)


def unsupported_archs(archs: tuple[Arch, ...], nvcc_archs: frozenset) -> list[Arch]:
    return [a for a in archs if a.number.rstrip("af") not in nvcc_archs]


def describe_nvcc_archs(nvcc_archs: frozenset) -> str:
    return ", ".join(f"{int(n) // 10}.{int(n) % 10}" for n in sorted(nvcc_archs, key=int))


def check_build_tools(archs: tuple[Arch, ...]) -> BuildTools:
    """Everything a build needs, or a ToolchainError / ArchUnsupportedError saying what is missing."""
    toolkit = require_toolkit()
    tools = _build_tools(str(toolkit.home), toolkit.version, toolkit.found_by)
    host_cc()  # read at each build (not cached with the tools): the environment may have changed
    missing = [str(a) for a in unsupported_archs(archs, tools.nvcc_archs)]
    if missing:
        raise ArchUnsupportedError(
            f"nvcc {tools.nvcc_version} at {toolkit.nvcc} cannot target {', '.join(missing)} "
            f"(it supports {describe_nvcc_archs(tools.nvcc_archs)}).",
            "name an arch this nvcc supports, or install a CUDA toolkit that supports it.",
        )
    return tools
