"""``sglang-hicache-jit doctor``: checks everything a build or a load needs, and says how to fix it.

Each check is a ``Check(name, status, detail, fix)`` with status ``ok``,
``problem`` or ``skip`` (not applicable here). The tool checks reuse
toolchain.py piece by piece, so one missing tool does not hide the others.
A machine without nvcc is fine when every requested arch is already
available prebuilt: it loads and never compiles.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from . import remote, toolchain, trust
from .. import settings
from ..errors import HicacheJitError

# A build needs a few MB of objects and ~0.5 MB per entry; below this, builds start failing oddly.
MIN_FREE_BYTES = 256 << 20
# Filesystems on which flock between nodes is unreliable or slow: put locks elsewhere.
NETWORK_FILESYSTEMS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs",
                       "fuse.glusterfs", "beegfs", "fuse.sshfs", "9p", "afs", "fuse.s3fs", "fuse.gcsfuse"}


@dataclass
class Check:
    name: str
    status: str  # ok | problem | skip
    detail: str
    fix: str = ""


def _ok(name, detail) -> Check:
    return Check(name, "ok", detail)


def _problem(name, detail, fix) -> Check:
    return Check(name, "problem", detail, fix)


def _from_error(name: str, exc: HicacheJitError) -> Check:
    return _problem(name, f"[{exc.code}] {exc.reason}", exc.fix)


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding ``path`` (from /proc/mounts; None where unknown)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    path = Path(os.path.realpath(path))
    best, best_type = "", None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, best_type = point, fields[2]
    return best_type


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _settings_checks() -> list[Check]:
    problems = []
    for reader in (settings.lock_timeout, settings.build_jobs, settings.method, settings.cache_max_size,
                   settings.cache_root, settings.lock_dir, settings.trusted_owners, settings.prebuilt_dirs,
                   settings.resident_blocks, settings.resident_idle_us, settings.sglang_plugin_enabled):
        try:
            reader()
        except ValueError as exc:  # BadSettingError is one
            problems.append(exc.reason if isinstance(exc, HicacheJitError) else str(exc))
    retired = "".join(f"; {line}" for line in settings.retired_in_use())
    if problems:
        return [_problem("settings", "; ".join(problems) + retired, "correct the environment variables named above.")]
    return [_ok("settings", "every SGLANG_HICACHE_JIT_* variable parses" + retired)]


def _torch_check() -> tuple[Check, dict | None]:
    try:
        info = toolchain.torch_info()
    except HicacheJitError as exc:
        return _from_error("torch", exc), None
    if info["cuda"] is None:
        return _problem("torch", f"torch {info['version']} is a CPU-only build",
                        "install a CUDA build of torch."), info
    return _ok("torch", f"torch {info['version']} (CUDA {info['cuda']})"), info


def _targets(arch: str | None) -> tuple[list[tuple], Check | None]:
    """Arch tuples to check, the way prewarm would build them."""
    from .arch import parse_arch_list, resolve_archs

    try:
        if arch:
            return [(a,) for a in parse_arch_list(arch)], None
        archs, source = resolve_archs(None)
        return [archs], None
    except ValueError as exc:
        return [], _problem("target archs", str(exc), "name archs like '9.0' or '8.0;9.0'.")
    except HicacheJitError as exc:
        return [], Check("target archs", "skip", exc.reason, exc.fix)


def where_available(archs: tuple, toolkit) -> str | None:
    """Where a usable entry for ``archs`` is (without building or fetching), or None."""
    from .loader import prebuilt_layers, writable_cache
    from .spec import BuildSpec

    spec = BuildSpec.for_archs(archs)
    identity = toolkit.identity if toolkit else None
    key = spec.key(identity) if identity else None
    layers = []
    for read in (prebuilt_layers, lambda: [writable_cache()]):
        try:
            layers += read()
        except HicacheJitError:  # a bad cache or layer setting: the settings check reports it
            pass
    for layer in layers:
        try:
            if layer.find(spec.arch_tag, spec.kernel, spec.abi_key, key, identity) is not None:
                return "prebuilt layer " + str(layer.root) if layer.prebuilt else "cache"
        except Exception:  # a corrupt or unsafe entry: the cache checks below report the cause
            continue
    return None


def _toolchain_checks(targets: list[tuple], torch_info: dict | None) -> list[Check]:
    checks = []
    toolkit = toolchain.find_toolkit()
    available = {archs: where_available(archs, toolkit) for archs in targets}
    all_prebuilt = bool(targets) and all(available.values())
    facts = None
    if toolkit is None:
        try:
            toolchain.require_toolkit()
        except HicacheJitError as exc:
            if all_prebuilt:
                checks.append(_ok("nvcc", "not installed; not needed: every requested arch is already built"))
            else:
                checks.append(_from_error("nvcc", exc))
    else:
        try:
            facts = toolchain.nvcc_facts(str(toolkit.home))
            checks.append(_ok("nvcc", f"{toolkit.nvcc}: {facts[0]} (found by {toolkit.found_by})"))
        except HicacheJitError as exc:
            checks.append(_from_error("nvcc", exc))
    if facts is not None and torch_info is not None:
        try:
            toolchain.check_cuda_agreement(toolkit.nvcc, facts[1] or toolkit.version.split(".")[0])
            checks.append(_ok("CUDA versions", f"nvcc CUDA {facts[1]}.x, torch CUDA {torch_info['cuda']}"))
        except HicacheJitError as exc:
            checks.append(_from_error("CUDA versions", exc))
    else:
        checks.append(Check("CUDA versions", "skip", "needs nvcc and torch"))
    needed = not all_prebuilt
    requirements = [("ninja", toolchain.require_ninja), ("host compiler", toolchain.require_cxx)]
    if os.environ.get("CC"):  # nvcc's host compiler, when one is named
        requirements.append(("CC", toolchain.host_cc))
    for name, require in requirements:
        try:
            found = require()
            checks.append(_ok(name, found if isinstance(found, str) else f"{found[0]}: {found[1]}"))
        except HicacheJitError as exc:
            checks.append(_from_error(name, exc) if needed else
                          _ok(name, f"not found; not needed: every requested arch is already built ({exc.reason})"))
    for archs in targets:
        label = ";".join(map(str, archs))
        where = available[archs]
        if facts is not None:
            missing = toolchain.unsupported_archs(archs, facts[2])
            if missing and not where:
                checks.append(_problem(
                    f"arch {label}",
                    f"nvcc {facts[0]} cannot target {', '.join(map(str, missing))} (it supports "
                    f"{toolchain.describe_nvcc_archs(facts[2])}), and no prebuilt entry exists",
                    "install a CUDA toolkit that supports it, or import a bundle built elsewhere."))
                continue
        if where:
            checks.append(_ok(f"arch {label}", f"built ({where})"))
        elif facts is not None:
            checks.append(_ok(f"arch {label}", "nvcc supports it; not built yet (the first use or `prewarm` "
                                               "compiles it, ~5 s)"))
        else:
            checks.append(_problem(f"arch {label}", "not built, and nothing here can build it",
                                   f"import a bundle (`sglang-hicache-jit import FILE`) or install nvcc; then "
                                   f"`sglang-hicache-jit prewarm --arch '{label}'`."))
    return checks


def _cache_checks() -> list[Check]:
    from .cache import BuildCache

    checks = []
    try:
        root = settings.cache_root()
    except HicacheJitError as exc:
        return [_from_error("cache directory", exc)]
    cache = BuildCache(root)
    name = "cache directory"
    try:
        if root.exists():
            trust.check_chain(root, cache.layout_root if cache.layout_root.exists() else root, prebuilt=False)
            if not os.access(root, os.W_OK | os.X_OK):
                checks.append(_problem(name, f"{root} is not writable by this user",
                                       f"fix its permissions, or set {settings.CACHE_DIR} to a writable directory."))
            else:
                checks.append(_ok(name, f"{root} (private to this user)"))
        else:
            parent = _existing_ancestor(root)
            if os.access(parent, os.W_OK | os.X_OK):
                checks.append(_ok(name, f"{root} (created with mode 0700 on first build)"))
            else:
                checks.append(_problem(name, f"{root} does not exist and {parent} is not writable",
                                       f"set {settings.CACHE_DIR} to a writable directory."))
    except HicacheJitError as exc:
        checks.append(_from_error(name, exc))

    free = shutil.disk_usage(_existing_ancestor(root)).free
    if free < MIN_FREE_BYTES:
        checks.append(_problem("free space", f"{free >> 20} MiB free under {root}",
                               f"free some space (`sglang-hicache-jit prune`), or move {settings.CACHE_DIR}."))
    else:
        checks.append(_ok("free space", f"{free >> 20} MiB free under {root}"))

    fstype = filesystem_type(_existing_ancestor(root))
    try:
        lock_dir = settings.lock_dir()
    except HicacheJitError as exc:
        checks.append(_from_error("locks", exc))
        lock_dir = False
    if lock_dir:
        lock_type = filesystem_type(_existing_ancestor(lock_dir))
        unsafe = None
        if lock_dir.exists():
            try:
                trust.check_path(lock_dir, prebuilt=False)
            except HicacheJitError as exc:
                unsafe = exc
        if unsafe is not None:
            checks.append(_problem("locks", f"[{unsafe.code}] the lock directory {unsafe.reason}",
                                   f"give each user a lock directory of their own, e.g. "
                                   f"{settings.LOCK_DIR}=/tmp/hicache-locks-$USER."))
        elif lock_type in NETWORK_FILESYSTEMS:
            checks.append(_problem("locks", f"{settings.LOCK_DIR}={lock_dir} is on {lock_type}",
                                   f"point {settings.LOCK_DIR} at a node-local directory (e.g. /tmp or /run/user)."))
        elif not os.access(_existing_ancestor(lock_dir), os.W_OK | os.X_OK):
            checks.append(_problem("locks", f"{lock_dir} is not writable", f"fix {settings.LOCK_DIR}."))
        else:
            checks.append(_ok("locks", f"{lock_dir} ({lock_type or 'unknown filesystem'})"))
    elif lock_dir is False:
        pass
    elif fstype in NETWORK_FILESYSTEMS:
        checks.append(_problem(
            "locks", f"the cache is on {fstype} and the build locks are in it",
            f"set {settings.LOCK_DIR} to a node-local directory (see docs/operators.md, shared filesystems)."))
    else:
        checks.append(_ok("locks", f"in the cache ({fstype or 'unknown filesystem'})"))

    try:
        bad = [f"{p.name}: {why}" for p, e, why in cache.entries() if e is None]
        failures = cache.failures() if cache.layout_root.is_dir() else []
    except OSError as exc:
        checks.append(_problem("cache entries", f"{root} cannot be read: {exc}",
                               f"fix its permissions, or set {settings.CACHE_DIR} to a directory of your own."))
        return checks
    if bad:
        checks.append(_problem("cache entries", f"{len(bad)} corrupt ({'; '.join(bad)}); they are never loaded",
                               "`sglang-hicache-jit prune` removes them (the next use builds them again)."))
    if failures:
        checks.append(_problem("failed builds", f"{len(failures)} remembered: {', '.join(map(str, failures))}",
                               "read the .failed.log next to each record, fix the cause, then "
                               "`sglang-hicache-jit clean --failed`."))
    else:
        checks.append(_ok("failed builds", "none remembered"))
    return checks


def _layer_checks() -> list[Check]:
    from .cache import BuildCache

    checks = []
    try:
        locations = settings.prebuilt_dirs()
    except HicacheJitError:  # the settings check reports it
        return checks
    for location in locations:
        name = f"prebuilt {location}"
        if remote.is_url(location):
            try:
                fs, path = remote.filesystem(location)
                found = fs.exists(path)
                if found and remote.is_local(fs):  # file://: the local layer rules apply (remote.py)
                    trust.check_path(Path(path), prebuilt=True)
                checks.append(_ok(name, "reachable") if found else
                              _problem(name, "does not exist", f"fix {settings.PREBUILT_DIRS}."))
            except HicacheJitError as exc:
                checks.append(_from_error(name, exc))
            except Exception as exc:  # fsspec backends raise their own types
                checks.append(_problem(name, f"unreachable: {type(exc).__name__}: {exc}",
                                       "check the URL, the credentials and the network."))
            continue
        layer = BuildCache(Path(location), prebuilt=True)
        if not layer.root.is_dir():
            checks.append(_problem(name, "is not a directory", f"fix {settings.PREBUILT_DIRS}."))
            continue
        try:
            entries = layer.entries()
            trust.check_path(layer.root, prebuilt=True)
            for path, entry, _ in entries:
                layer.check_trust(path)  # the root down to the entry, and its manifest
                if entry is not None:
                    trust.check_path(entry.library, prebuilt=True)
        except HicacheJitError as exc:
            checks.append(_from_error(name, exc))
            continue
        except OSError as exc:  # e.g. a layer made private to root, read by another user: skipped by the loader
            checks.append(_problem(name, f"cannot be read by this user (uid {os.geteuid()}): "
                                         f"{exc.strerror or exc}: {exc.filename or layer.root}",
                                   f"make the layer readable by everyone and writable by no one: "
                                   f"chmod -R a+rX,go-w {layer.root} (`import --into` does this)."))
            continue
        bad = [f"{p.name}: {why}" for p, e, why in entries if e is None]
        if bad:
            checks.append(_problem(name, f"{len(bad)} corrupt entries ({'; '.join(bad)})",
                                   "rebuild the layer from a fresh bundle."))
        else:
            checks.append(_ok(name, f"{len(entries)} verified entries"))
    return checks


def run_checks(arch: str | None = None) -> list[Check]:
    checks = _settings_checks()
    torch_check, torch_info = _torch_check()
    checks.append(torch_check)
    targets, target_problem = _targets(arch)
    if target_problem is not None:
        checks.append(target_problem)
    checks += _toolchain_checks(targets, torch_info)
    checks += _cache_checks()
    checks += _layer_checks()
    return checks


def archs_checked(checks: list[Check]) -> list[str]:
    """The arch lists the checks covered (none without a GPU and without --arch)."""
    return [c.name[len("arch "):] for c in checks if c.name.startswith("arch ")]


def as_json(checks: list[Check]) -> dict:
    return {"schema": 1, "ok": not any(c.status == "problem" for c in checks), "archs_checked": archs_checked(checks),
            "checks": [asdict(c) for c in checks]}


def format_checks(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        mark = {"ok": "ok     ", "problem": "PROBLEM", "skip": "skip   "}[c.status]
        lines.append(f"{mark} {c.name:<18} {c.detail}")
        if c.fix and c.status != "ok":
            lines.append(f"{'':7} {'':<18} fix: {c.fix}")
    problems = sum(c.status == "problem" for c in checks)
    lines.append(f"{problems} problem{'s' if problems != 1 else ''} found" if problems else "no problems found")
    if not archs_checked(checks):
        # Without a GPU and without --arch nothing says which build to look for: a clean report would mislead.
        lines[-1] += ("; but no arch was checked (no GPU here and none named): "
                      "run `sglang-hicache-jit doctor --arch 9.0` (your GPUs' archs) to check builds")
    return "\n".join(lines)
