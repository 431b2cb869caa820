"""Finds, builds and loads the kernel library: the orchestration only.

    archs (arch.py) -> spec and key (spec.py) -> cache lookup (cache.py)
      -> on a miss: check tools (toolchain.py) -> lock -> look again
         -> compile in staging (build.py) -> verify -> publish -> load

A warm hit reads the manifest, checks the library's sha256 and loads it with
``torch.ops.load_library``: no lock, no ninja, no compiler subprocess.

Across processes one build runs at a time per entry: the builder holds a
``filelock`` (an OS lock, released by the kernel if the builder is killed, so
a SIGKILLed builder never wedges the others), and whoever gets the lock next
looks at the cache again before building.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import filelock

from . import settings
from .arch import Arch, resolve_archs
from .build import compile_entry
from .cache import BuildCache, CorruptEntry, Entry
from .errors import BuildFailedError, DisabledError, LockTimeoutError, NotBuiltError
from .spec import BuildSpec
from .toolchain import check_build_tools, find_toolkit, require_toolkit

log = logging.getLogger("sglang_hicache_jit")

_WAIT_LOG_SECONDS = 5.0


@dataclass(frozen=True)
class BuildResult:
    """What ``ensure_built`` did: action is 'built', 'cached' or 'waited'."""

    kernel: str
    archs: tuple[Arch, ...]
    action: str
    seconds: float
    entry: Entry

    @property
    def path(self) -> Path:
        return self.entry.path


@dataclass
class KernelLibrary:
    """A loaded build: its op namespace (``ops.transfer``) and what it was built for."""

    name: str
    archs: tuple[Arch, ...]
    entry: Entry
    ops: object = field(repr=False)

    @property
    def path(self) -> Path:
        return self.entry.library

    def supports(self, capability: tuple[int, int]) -> bool:
        return any(a.runs_on(capability) for a in self.archs)


_loaded: dict[str, KernelLibrary] = {}            # by extension name (= op namespace)
_by_archs: dict[tuple, KernelLibrary] = {}        # memo for load_kernels
_process_lock = threading.RLock()                 # one build or load at a time in this process


def _cache() -> BuildCache:
    return BuildCache(settings.cache_root())


@contextmanager
def _build_lock(cache: BuildCache, spec: BuildSpec, key: str):
    """Holds the entry's cross-process lock; yields True when another process held it first."""
    path = cache.lock_path(spec.arch_tag, spec.kernel, key)
    owner_path = path.with_suffix(".owner")
    lock = filelock.FileLock(str(path))
    timeout = settings.lock_timeout()
    started = last_log = time.monotonic()
    waited = False
    while True:
        try:
            lock.acquire(timeout=min(1.0, timeout))
            break
        except filelock.Timeout:
            waited = True
            now = time.monotonic()
            holder = _read_owner(owner_path)
            if now - started >= timeout:
                raise LockTimeoutError(
                    f"Waited {now - started:.0f} s for the build of {spec.kernel} ({spec.arch_tag}) held by {holder}.",
                    f"check that process; raise {settings.LOCK_TIMEOUT} if builds are that slow here; "
                    f"the lock file is {path}.",
                ) from None
            if now - last_log >= _WAIT_LOG_SECONDS:
                log.info("waiting for %s to finish building %s for %s (%.0f s so far)",
                         holder, spec.kernel, spec.arch_tag, now - started)
                last_log = now
    try:
        owner_path.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}))
        yield waited
    finally:
        lock.release()


def _read_owner(path: Path) -> str:
    try:
        owner = json.loads(path.read_text())
        return f"pid {owner['pid']} on {owner['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _fail_fast(cache: BuildCache, spec: BuildSpec, key: str, newer_than: float | None = None) -> None:
    failure = cache.read_failure(spec.arch_tag, spec.kernel, key)
    if failure is None or (newer_than is not None and failure.get("time", 0) < newer_than):
        return
    raise BuildFailedError(
        f"The build of {spec.kernel} for {spec.arch_tag} failed earlier: {failure.get('reason', '').splitlines()[0]}",
        f"read {failure['log_path']}, fix the cause, then run `sglang-hicache-jit clean --failed` "
        "(or `sglang-hicache-jit prewarm`, which retries).",
        log_path=failure["log_path"],
    )


def ensure_built(archs: tuple[Arch, ...], *, build: bool = True, retry_failed: bool = False) -> BuildResult:
    """Makes sure a verified entry exists for ``archs``; builds it when needed and allowed."""
    started = time.time()
    spec = BuildSpec.for_archs(archs)
    cache = _cache()
    toolkit = find_toolkit()
    if toolkit is None:
        # No compiler here: any verified entry for this torch/Python ABI will do.
        entry = cache.find_abi(spec.arch_tag, spec.kernel, spec.abi_key)
        if entry is not None:
            return BuildResult(spec.kernel, spec.archs, "cached", 0.0, entry)
        require_toolkit()  # raises the no_nvcc error
    key = spec.key(toolkit.identity)
    try:
        entry = cache.lookup(spec.arch_tag, spec.kernel, key)
        if entry is not None:
            return BuildResult(spec.kernel, spec.archs, "cached", 0.0, entry)
    except CorruptEntry as exc:
        log.warning("discarding a corrupt cache entry and rebuilding: %s", exc)
    if not retry_failed:
        _fail_fast(cache, spec, key)
    if not build:
        raise NotBuiltError(
            f"{spec.kernel} for {spec.arch_tag} is not in the cache at {cache.root}.",
            f"run `sglang-hicache-jit prewarm --arch '{';'.join(map(str, spec.archs))}'`.",
        )
    tools = check_build_tools(spec.archs)
    with _process_lock, _build_lock(cache, spec, key) as waited:
        try:
            entry = cache.lookup(spec.arch_tag, spec.kernel, key)
            if entry is not None:
                return BuildResult(spec.kernel, spec.archs, "waited" if waited else "cached", time.time() - started, entry)
        except CorruptEntry:
            cache.discard_corrupt(spec.arch_tag, spec.kernel, key)
        # A failure recorded while we waited is final for this call; an older one is retried only on request.
        _fail_fast(cache, spec, key, newer_than=started if retry_failed else None)
        return _build(cache, spec, key, tools)


def _build(cache: BuildCache, spec: BuildSpec, key: str, tools) -> BuildResult:
    entry_name = f"{spec.kernel}-{key}"
    staging = cache.new_staging_dir(entry_name)
    log.info("compiling %s for %s with %s (log: %s)", spec.kernel, spec.arch_tag, tools.nvcc_version,
             staging / "entry" / "build.log")
    try:
        entry_dir, seconds = compile_entry(spec, key, tools, staging)
    except BuildFailedError as exc:
        log_text = Path(exc.log_path).read_text(errors="replace") if exc.log_path else exc.reason
        log_path = cache.record_failure(spec.arch_tag, spec.kernel, key, exc.reason, log_text)
        _remove_tree(staging)
        raise BuildFailedError(exc.reason, f"read {log_path}; after fixing the cause run "
                               "`sglang-hicache-jit clean --failed` or `sglang-hicache-jit prewarm`.",
                               log_path=str(log_path)) from None
    cache.clear_failure(spec.arch_tag, spec.kernel, key)
    entry = cache.publish(entry_dir, spec.arch_tag, spec.kernel, key)
    _remove_tree(staging)
    log.info("compiled %s for %s in %.1f s", spec.kernel, spec.arch_tag, seconds)
    return BuildResult(spec.kernel, spec.archs, "built", seconds, entry)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def load_entry(entry: Entry, archs: tuple[Arch, ...]) -> KernelLibrary:
    """Loads a verified entry into this process (once per build)."""
    name = entry.manifest["name"]
    with _process_lock:
        library = _loaded.get(name)
        if library is None:
            import torch

            torch.ops.load_library(str(entry.library))
            library = KernelLibrary(name, archs, entry, getattr(torch.ops, name))
            _loaded[name] = library
    return library


def load_kernels(arch: str | None = None, *, device: int | None = None, build: bool = True) -> KernelLibrary:
    """The kernel library for ``arch`` (default: SGLANG_HICACHE_JIT_ARCH, then
    TORCH_CUDA_ARCH_LIST, then the GPU ``device``, by default the current one),
    compiling it on first use. build=False only loads what is already cached."""
    if settings.disabled():
        raise DisabledError(f"The JIT kernels are disabled by {settings.DISABLE}=1.",
                            f"unset {settings.DISABLE} to use them.")
    archs, _ = resolve_archs(arch, device)
    library = _by_archs.get(archs)
    if library is None:
        result = ensure_built(archs, build=build)
        library = load_entry(result.entry, archs)
        _by_archs[archs] = library
    return library


def loaded_libraries() -> list[KernelLibrary]:
    return list(_loaded.values())
