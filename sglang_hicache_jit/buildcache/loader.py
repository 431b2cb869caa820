"""Finds, builds and loads the kernel library: the orchestration only.

    archs (arch.py) -> spec and key (spec.py)
      -> read-only prebuilt layers (SGLANG_HICACHE_JIT_PREBUILT_DIRS, local paths)
      -> the writable cache (cache.py)
      -> remote prebuilt layers (fsspec URLs, remote.py): copied into the cache
      -> on a miss: check tools (toolchain.py) -> lock -> look again
         -> compile in staging (build.py) -> verify -> publish -> size cap (prune.py)
    -> load: open the library, check owner, mode and sha256 on that open file, dlopen it

A warm hit reads the manifest, checks the library's sha256 and loads it: no
lock, no ninja, no compiler subprocess, and none of their modules: filelock,
build.py and remote.py (fsspec) are imported only when a build or a remote
layer needs them (tests/test_warm_path.py holds the warm path to that). ``load_kernels`` also makes sure the
library has machine code (SASS) for the GPU it is for: a build that would only
run through the driver's PTX JIT (slower, and compiled at every start) is
refused, or replaced by a build for that GPU.

Across processes one build runs at a time per entry: the builder holds a
``filelock`` (an OS lock, released by the kernel if the builder is killed, so
a SIGKILLed builder never wedges the others), and whoever gets the lock next
looks at the cache again before building.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

# Only what a warm hit uses is imported here: filelock alone took 65-80 ms to import, 15x the whole
# warm load, and build.py, remote.py and socket are needed only to build or fetch.
from .. import safeio, settings
from .arch import Arch, current_gpu_capability, resolve_archs
from .cache import BuildCache, CorruptEntry, Entry, open_verified, sass_numbers, touch_used
from ..errors import (ArchUnsupportedError, BuildFailedError, DisabledError, HicacheJitError, LockTimeoutError,
                     NotBuiltError, UnsafeCacheError, write_error)
from .spec import BuildSpec
from .record import record
from .toolchain import check_build_tools, find_toolkit, require_toolkit

log = logging.getLogger("sglang_hicache_jit")

_WAIT_LOG_SECONDS = 5.0


class BuildResult(record("BuildResult", ["kernel", "archs", "action", "seconds", "entry"])):  # see arch.Arch
    """What ``ensure_built`` did: action is 'built', 'cached' (in the writable
    cache), 'prebuilt' (in a read-only layer), 'fetched' (copied from a remote
    layer) or 'waited' (another process built it meanwhile)."""

    __slots__ = ()

    @property
    def path(self) -> Path:
        return self.entry.path


class KernelLibrary:
    """A loaded build: its op namespace (``ops.transfer``) and what it was built for."""

    def __init__(self, name: str, archs: tuple[Arch, ...], entry: Entry, ops: object, fd: int = -1,
                 handle: object = None):
        self.name = name
        self.archs = archs
        self.entry = entry
        self.ops = ops
        self.fd = fd  # the verified library, kept open (see load_entry)
        self.handle = handle  # ctypes handle: the C launcher, called directly by ops

    def __repr__(self) -> str:
        return f"KernelLibrary(name={self.name!r}, archs={self.archs!r}, entry={self.entry!r})"

    @property
    def path(self) -> Path:
        return self.entry.library

    def supports(self, capability: tuple[int, int]) -> bool:
        """True when the library has machine code (not just PTX) that runs on ``capability``."""
        sass = sass_numbers(self.entry.manifest)
        return any(a.runs_on(capability) and a.number in sass for a in self.archs)


_loaded: dict[str, KernelLibrary] = {}            # by extension name (= op namespace)
_by_archs: dict[tuple, KernelLibrary] = {}        # memo for load_kernels
_process_lock = threading.RLock()                 # one build or load at a time in this process


def writable_cache() -> BuildCache:
    return BuildCache(settings.cache_root())


def prebuilt_layers() -> list[BuildCache]:
    """The local read-only layers of SGLANG_HICACHE_JIT_PREBUILT_DIRS, in the order named."""
    dirs = settings.prebuilt_dirs()
    if not dirs:
        return []
    from . import remote

    return [BuildCache(Path(p), prebuilt=True) for p in dirs if not remote.is_url(p)]


def remote_layers() -> list[str]:
    """The fsspec URLs of SGLANG_HICACHE_JIT_PREBUILT_DIRS (consulted after the local cache)."""
    dirs = settings.prebuilt_dirs()
    if not dirs:
        return []
    from . import remote

    return [p for p in dirs if remote.is_url(p)]


@contextmanager
def _build_lock(cache: BuildCache, spec: BuildSpec, key: str):
    """Holds the entry's cross-process lock; yields True when another process held it first."""
    import socket

    import filelock

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
        except filelock.Timeout:  # (a TimeoutError, hence an OSError: caught first)
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
        except OSError as exc:  # the lock file cannot be created: a read-only or full lock directory
            raise write_error(exc, f"the build lock {path}") from None
    try:
        try:  # a new file renamed over the old one: a planted symlink is replaced, never written through
            safeio.write_atomic(owner_path, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                        "since": time.time()}).encode(), 0o644)
        except OSError as exc:  # informative only (waiters name the holder)
            log.debug("could not write %s: %s", owner_path, exc)
        yield waited
    finally:
        lock.release()


def _read_owner(path: Path) -> str:
    try:
        owner = json.loads(safeio.read_regular(path, 4096))
        return f"pid {int(owner['pid'])} on {str(owner['host'])[:255]}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _fail_fast(cache: BuildCache, spec: BuildSpec, key: str, newer_than: float | None = None) -> None:
    """Raises the remembered failure of this build, unless there is none, it is
    older than ``newer_than``, or its cause was transient (killed, disk full:
    the build is simply tried again)."""
    failure = cache.read_failure(spec.arch_tag, spec.kernel, key)
    if failure is None or failure.get("transient") or (newer_than is not None and failure.get("time", 0) < newer_than):
        return
    reason = (failure["reason"].strip().splitlines() or ["no reason recorded"])[0]
    raise BuildFailedError(
        f"The build of {spec.kernel} for {spec.arch_tag} failed earlier: {reason}",
        f"read {failure['log_path']}, fix the cause, then run `sglang-hicache-jit clean --failed` "
        "(or `sglang-hicache-jit prewarm`, which retries).",
        log_path=failure["log_path"],
    )


def find_entry(spec: BuildSpec, key: str | None, toolkit: str | None, cache: BuildCache, *,
               hash_library: bool = True) -> tuple[Entry, str] | None:
    """A usable entry without building: prebuilt layers, the cache, remote layers.
    Returns it with the action to report. A corrupt exact entry in the writable
    cache is only reported here; the caller rebuilds it under the lock.
    hash_library=False: see cache.verify_entry."""
    for layer in prebuilt_layers():
        try:
            entry = layer.find(spec.arch_tag, spec.kernel, spec.abi_key, key, toolkit, hash_library=hash_library)
        except OSError as exc:  # e.g. a layer this user cannot read (`doctor` reports it)
            log.warning("prebuilt layer %s skipped: %s", layer.root, exc)
            continue
        if entry is not None:
            return entry, "prebuilt"
    try:
        entry = cache.find(spec.arch_tag, spec.kernel, spec.abi_key, key, toolkit, hash_library=hash_library)
        if entry is not None:
            return entry, "cached"
    except CorruptEntry as exc:
        log.warning("a cache entry failed verification, so it is built again: %s", exc)
    for url in remote_layers():
        from . import remote

        try:
            entry = remote.fetch_entry(url, cache, spec.arch_tag, spec.kernel, spec.abi_key, key, toolkit)
        except UnsafeCacheError:  # refused like an unsafe local layer, not skipped silently
            raise
        except Exception as exc:  # fsspec backends raise their own types; a layer that is down must not stop a build
            log.warning("prebuilt layer %s skipped: %s: %s", url, type(exc).__name__, exc)
            continue
        if entry is not None:
            return entry, "fetched"
    return None


def ensure_built(archs: tuple[Arch, ...], *, build: bool = True, retry_failed: bool = False,
                 hash_library: bool = True) -> BuildResult:
    """Makes sure a verified entry exists for ``archs``; builds it when needed and allowed.
    hash_library=False leaves the library's sha256 to a caller that loads it (see _load)."""
    started = time.time()
    # Settings a build needs, read before anything is created (a bad one leaves nothing behind).
    settings.lock_timeout(), settings.build_jobs()
    spec = BuildSpec.for_archs(archs)
    cache = writable_cache()
    toolkit = find_toolkit()
    identity = toolkit.identity if toolkit is not None else None
    # Without a compiler here, any verified entry of this ABI will do (cache.acceptable).
    key = spec.key(identity) if identity is not None else None
    found = find_entry(spec, key, identity, cache, hash_library=hash_library)
    if found is not None:
        entry, action = found
        return BuildResult(spec.kernel, spec.archs, action, time.time() - started if action == "fetched" else 0.0,
                           entry)
    if key is None:
        require_toolkit()  # raises the no_nvcc error
    if not retry_failed:
        _fail_fast(cache, spec, key)
    if not build:
        raise NotBuiltError(
            f"{spec.kernel} for {spec.arch_tag} is not in the cache at {cache.root}.",
            f"run `sglang-hicache-jit prewarm --arch '{';'.join(map(str, spec.archs))}'`.",
        )
    tools = check_build_tools(spec.archs)
    cache.ensure_root()  # refuses a cache directory other users could write to
    with _process_lock, _build_lock(cache, spec, key) as waited:
        try:
            entry = cache.lookup(spec.arch_tag, spec.kernel, key)
            if entry is not None:
                return BuildResult(spec.kernel, spec.archs, "waited" if waited else "cached", time.time() - started, entry)
        except CorruptEntry:
            cache.discard_corrupt(spec.arch_tag, spec.kernel, key)
        # A failure recorded while we waited is final for this call; an older one is retried only on request.
        _fail_fast(cache, spec, key, newer_than=started if retry_failed else None)
        result = _build(cache, spec, key, tools)
    if result.action == "built":
        from .prune import apply_size_cap  # housekeeping after a publication, never on the warm path

        apply_size_cap(cache, keep=(result.entry.path,))
    return result


def compile_entry(spec: BuildSpec, key: str, tools, staging: Path) -> tuple[Path, float]:
    """build.compile_entry, imported by the first build rather than by every warm load."""
    from . import build

    return build.compile_entry(spec, key, tools, staging)


def _build(cache: BuildCache, spec: BuildSpec, key: str, tools) -> BuildResult:
    """Compiles and publishes one entry; the caller holds its lock. The staging
    directory is removed whatever happens."""
    from .prune import reap_stale_staging

    entry_name = f"{spec.kernel}-{key}"
    reap_stale_staging(cache, entry_name)  # left by an earlier builder of this entry that was killed
    try:
        staging = cache.new_staging_dir(entry_name)
    except OSError as exc:
        raise write_error(exc, f"the cache directory {cache.root} ({cache.setting})") from None
    # The staging directory goes away after publication: the log path worth printing is the published one.
    log.info("compiling %s for %s with nvcc %s", spec.kernel, spec.arch_tag, tools.nvcc_version)
    try:
        try:
            entry_dir, seconds = compile_entry(spec, key, tools, staging)
        except BuildFailedError as exc:
            log_text = exc.reason
            if exc.log_path:
                try:
                    log_text = safeio.read_regular(exc.log_path, 64 << 20).decode(errors="replace")
                except OSError:
                    pass
            try:
                log_path = str(cache.record_failure(spec.arch_tag, spec.kernel, key, exc.reason, log_text,
                                                    cause=exc.cause, transient=exc.transient))
            except OSError:  # e.g. the disk is full: the error itself still goes to the caller
                log_path = None
            if exc.transient:
                fix = (f"{exc.fix} It was not the sources: the next call builds again."
                       if exc.fix else "It was not the sources: the next call builds again.")
            else:
                fix = (f"read {log_path}; after fixing the cause run `sglang-hicache-jit clean --failed` or "
                       "`sglang-hicache-jit prewarm`.")
            raise BuildFailedError(exc.reason, fix, log_path=log_path, transient=exc.transient) from None
        try:
            cache.clear_failure(spec.arch_tag, spec.kernel, key)
            entry = cache.publish(entry_dir, spec.arch_tag, spec.kernel, key)
        except OSError as exc:
            raise write_error(exc, f"publishing into {cache.root} ({cache.setting})") from None
    finally:
        _remove_tree(staging)
    log.info("compiled %s for %s in %.1f s; build log: %s", spec.kernel, spec.arch_tag, seconds, entry.log)
    return BuildResult(spec.kernel, spec.archs, "built", seconds, entry)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _dlopen(fd: int, entry: Entry):
    """Loads the library through its verified open file and returns its ctypes
    handle. torch.ops.load_library would resolve /proc/self/fd/N back to the
    path (realpath), so this does what it does (ctypes.CDLL, then record the
    path) on the descriptor."""
    import ctypes

    import torch

    fd_path = f"/proc/self/fd/{fd}"
    if not os.path.exists(fd_path):  # no /proc (not Linux): load by path, checked just before
        torch.ops.load_library(str(entry.library))
        return ctypes.CDLL(str(entry.library))  # already loaded: the same handle
    handle = ctypes.CDLL(fd_path)
    torch.ops.loaded_libraries.add(str(entry.library))
    return handle


def load_entry(entry: Entry, archs: tuple[Arch, ...]) -> KernelLibrary:
    """Loads a verified entry into this process (once per build).

    The library is opened once, checked on that open file (owner and mode,
    size, sha256) and loaded through it, so what runs is what was checked even
    if the entry is pruned or replaced meanwhile. The descriptor stays open:
    glibc recognises an already loaded library by its path string, so a
    /proc/self/fd/N path must never be reused for another library.
    Raises CorruptEntry when the library vanished or changed since the lookup.
    """
    name = entry.manifest["name"]
    with _process_lock:
        library = _loaded.get(name)
        if library is None:
            fd = open_verified(entry)
            try:
                import torch

                handle = _dlopen(fd, entry)
                library = KernelLibrary(name, archs, entry, getattr(torch.ops, name), fd, handle)
            except BaseException:
                os.close(fd)
                raise
            _loaded[name] = library
            touch_used(entry)
    return library


def load_archs(archs: tuple[Arch, ...], build: bool = True) -> KernelLibrary:
    """The library for exactly ``archs`` (no GPU involved), loaded the way load_kernels loads it:
    an entry removed or replaced between the look and the load (a prune, a clean or a rebuild by
    another process) is looked for again, so with build=False it ends as NotBuiltError, never as
    a CorruptEntry (`check --arch`)."""
    return _load(archs, build)


def _load(archs: tuple[Arch, ...], build: bool) -> KernelLibrary:
    """ensure_built + load_entry, looking again when the entry vanished or changed in between
    (a prune or a rebuild by another process)."""
    problem = None
    for attempt in range(3):
        # load_entry hashes the library on the descriptor it loads, so the first look leaves the
        # hash out (0.3 ms of a 5 ms warm load); after a mismatch the look hashes too, which
        # reports a corrupt entry and rebuilds it.
        result = ensure_built(archs, build=build, hash_library=attempt > 0)
        try:
            return load_entry(result.entry, archs)
        except CorruptEntry as exc:
            problem = exc
            log.info("the cache entry changed while loading it (%s); looking again", exc)
    raise NotBuiltError(
        f"The cache entry for {';'.join(map(str, archs))} was removed or changed three times while loading it "
        f"({problem}).",
        "check for a process that prunes or rewrites the cache in a loop (a tiny "
        f"{settings.CACHE_MAX_SIZE}?), then retry.",
    )


def load_kernels(arch: str | None = None, *, device: int | None = None, build: bool = True) -> KernelLibrary:
    """The kernel library for ``arch`` (default: SGLANG_HICACHE_JIT_ARCH, then
    TORCH_CUDA_ARCH_LIST, then the GPU ``device``, by default the current one),
    compiling it on first use. build=False only loads what is already cached.

    When the library is for a GPU (``arch`` not given, or ``device`` given) it
    must hold machine code for that GPU: an arch list from the environment that
    lacks it (PTX at most) is replaced by a build for the GPU's own arch, with a
    warning; ArchUnsupportedError says why when that cannot be done.
    """
    if settings.disabled():
        raise DisabledError(f"The JIT kernels are disabled by {settings.DISABLE}=1.",
                            f"unset {settings.DISABLE} to use them.")
    archs, source = resolve_archs(arch, device)
    capability = None
    if source != "current GPU" and (arch is None or device is not None):
        capability = current_gpu_capability(device)
    memo = (archs, capability)
    library = _by_archs.get(memo)
    if library is None:
        with _collector_paused():
            library = _load_for(archs, source, capability, device, build)
        _by_archs[memo] = library
    return library


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for the block (as it was, after). A warm load allocates
    enough to start a collection or two, and in a process that imported torch (and numpy, as every
    SGLang process does) one collection cost 0.2-1.5 ms of the load's 4.5 ms budget. A build under it
    keeps the collector paused for its seconds too: the compile runs in a child process."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _load_for(archs: tuple[Arch, ...], source: str, capability: tuple[int, int] | None, device: int | None,
              build: bool) -> KernelLibrary:
    """load_kernels after its memo: the library for ``archs``, checked to run on ``capability``."""
    if capability is not None and not any(a.runs_on(capability) for a in archs):
        library = _load_for_gpu(archs, source, capability, device, build)
    else:
        library = _load(archs, build)
    if capability is not None and not library.supports(capability):
        raise ArchUnsupportedError(
            f"The library {library.path} has no machine code for compute capability "
            f"{capability[0]}.{capability[1]} (its manifest lists SASS for "
            f"{', '.join(sorted(sass_numbers(library.entry.manifest))) or 'nothing'}).",
            "run `sglang-hicache-jit clean` and build again; if it persists, report it.",
        )
    return library


def _load_for_gpu(archs: tuple[Arch, ...], source: str, capability: tuple[int, int], device: int | None,
                  build: bool) -> KernelLibrary:
    """``archs`` (named by ``source``) has no machine code for the GPU: load a build for the GPU's arch
    instead, or say why that is not possible."""
    named = ";".join(map(str, archs))
    gpu = Arch(*capability)
    where = f"cuda:{device}" if device is not None else "the current GPU"
    problem = f"{source}={named} has no machine code for {where} (compute capability {gpu})"
    if any(a.ptx for a in archs):
        problem += "; its PTX would be JIT-compiled by the driver at every start into a slower path"
    if source == "argument":
        raise ArchUnsupportedError(f"load_kernels({named!r}) has no machine code for {where} (compute capability "
                                   f"{gpu}).", f"pass an arch list that includes {gpu}, or leave arch unset.")
    log.warning("%s; using a build for %s instead", problem, gpu)
    try:
        return _load((gpu,), build)
    except HicacheJitError as exc:
        raise ArchUnsupportedError(
            f"{problem}, and a build for {gpu} cannot be had here: {exc.reason}",
            f"add {gpu} to {source} and prewarm it where nvcc is installed, or: {exc.fix}",
        ) from exc


def loaded_libraries() -> list[KernelLibrary]:
    return list(_loaded.values())
