"""One stand-in CUDA device for running the transfer ops' Python layer without a GPU.

Used by tests/test_plan_cache.py and tools/bench.py host-cost (the stream and event stand-ins also by the
staging tests). Tensors keep CPU memory but claim to be on cuda:0 (``cuda(t)``) or in pinned memory
(``pinned(t)``); the device state is built through launcher._DeviceState with the
library loader, the capability query and pinned allocation stubbed, so the
state is the real class with the real launch code. Its C launcher is what the
caller passes: a Python recorder (tests) or a no-op C function (the bench).
Nothing here ever reaches a GPU: CPU-index uploads are stubbed by
``stub_uploads``, which only the bench uses.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import shutil
import subprocess
import tempfile
import types
from pathlib import Path

import torch

_DISABLED = torch._C._disabled_torch_function_impl


class FakeCuda(torch.Tensor):
    """CPU memory that says it is on cuda:0. torch functions are not
    intercepted (results of ops are plain CPU tensors): only the attributes
    ops.py reads to place a tensor are overridden."""

    __torch_function__ = _DISABLED
    is_cuda = True
    device = torch.device("cuda", 0)

    def get_device(self):
        return 0

    def view(self, *shape):  # views stay on the "GPU"
        return cuda(torch.Tensor.view(self, *shape))

    def clone(self, *args, **kwargs):  # so do copies (pointer_tables.py copies a table before reading it)
        return cuda(torch.Tensor.clone(self, *args, **kwargs))

    def __getitem__(self, index):  # and slices (a staging area cuts its buffers out of one tensor)
        return cuda(torch.Tensor.__getitem__(self, index))

    def __add__(self, other):  # and sums (pointer_tables.py shifts a table by adding to it)
        return cuda(torch.Tensor.__add__(self, other))


class FakePinned(torch.Tensor):
    """CPU memory that says it is pinned."""

    __torch_function__ = _DISABLED

    def is_pinned(self, device=None):
        return True

    def view(self, *shape):
        return pinned(torch.Tensor.view(self, *shape))

    def __getitem__(self, index):  # a slice of pinned memory is pinned memory
        return pinned(torch.Tensor.__getitem__(self, index))


# as_subclass makes a view: ``_base`` leads to the plain tensor underneath,
# as it leads from a real view to its buffer.
def cuda(t: torch.Tensor) -> FakeCuda:
    return t.as_subclass(FakeCuda)


def pinned(t: torch.Tensor) -> FakePinned:
    return t.as_subclass(FakePinned)


class Recorder:
    """A Python stand-in for hicache_transfer_launch: keeps a copy of every
    HicacheTransfer it is given and reports ``method`` as the one that ran."""

    def __init__(self, method: int = 1):
        self.method = method
        self.calls: list[dict] = []

    def __call__(self, spec, stream, method_used) -> int:
        from sglang_hicache_jit.transfer.abi import _CTransfer

        # ops passes both by address (an int) or as ctypes.byref().
        spec = _CTransfer.from_address(spec) if isinstance(spec, int) else spec._obj
        call = {name: getattr(spec, name) for name, _ in _CTransfer._fields_}
        # Without a GPU the indices are CPU memory: read them.
        element = ctypes.c_int32 if spec.index_bytes == 4 else ctypes.c_int64
        for side in ("src", "dst"):
            address = call[f"indices_{side}"]
            call[f"{side}_index_values"] = list((element * spec.num_items).from_address(address)) if address else []
        self.calls.append(call)
        method_used = ctypes.c_int.from_address(method_used) if isinstance(method_used, int) else method_used._obj
        method_used.value = self.method
        return 0

    @property
    def last(self) -> dict:
        return self.calls[-1]


class Copier(Recorder):
    """A Python stand-in for hicache_transfer_launch that does what the kernel does, on the stand-in device's
    memory (CPU memory, so every address in the struct is real): for each item, cache and layer, the row at
    ``base + index * stride`` of the source (``base``: the layer's entry of the cache's pointer table, or the
    cache's base address) to the same place of the destination; a negative index skips its pair, an index
    at or past ``src_rows`` / ``dst_rows`` (where those are known) is skipped and reported in the error words,
    and a caller's table (``*_live*``) that differs from the checked copy the rows go through makes the whole
    transfer copy nothing and report a stale table (kernels/hicache_copy.cuh). So the Python layer's GPU
    path (tables, views, strides, indices) can be checked bit for bit without a GPU."""

    def __call__(self, spec, stream, method_used) -> int:
        from sglang_hicache_jit.transfer.abi import _CTransfer

        result = super().__call__(spec, stream, method_used)
        t = _CTransfer.from_address(spec) if isinstance(spec, int) else spec._obj
        words = (ctypes.c_uint32 * 4).from_address(t.error_flags) if t.error_flags else [0] * 4
        layers, caches = t.num_layers, t.num_caches

        def table(address, layer):
            return ctypes.c_uint64.from_address(address + 8 * layer).value

        for c in range(caches):
            for live, kept in ((getattr(t, f"src_live{c}"), getattr(t, f"src_table{c}")),
                               (getattr(t, f"dst_live{c}"), getattr(t, f"dst_table{c}"))):
                if live and kept and any(table(live, l) != table(kept, l) for l in range(layers)):
                    words[3] = 1
                    return result
        element = ctypes.c_int32 if t.index_bytes == 4 else ctypes.c_int64
        src_idx = (element * t.num_items).from_address(t.indices_src) if t.num_items else []
        dst_idx = (element * t.num_items).from_address(t.indices_dst) if t.num_items else []
        for si, di in zip(src_idx, dst_idx):
            if si < 0 or di < 0:
                continue
            if t.src_rows >= 0 and si >= t.src_rows:
                words[0] = 1
                continue
            if t.dst_rows >= 0 and di >= t.dst_rows:
                words[1] = 1
                continue
            for c in range(caches):
                src_table, dst_table = getattr(t, f"src_table{c}"), getattr(t, f"dst_table{c}")
                for l in range(layers):
                    src = table(src_table, l) if src_table else getattr(t, f"src_base{c}")
                    dst = table(dst_table, l) if dst_table else getattr(t, f"dst_base{c}")
                    ctypes.memmove(dst + di * t.dst_stride, src + si * t.src_stride, t.row_bytes)
        return result


_NOOP_SOURCE = r"""
#include <stdint.h>
int hicache_transfer_launch(const void* transfer, void* stream, int* method_used) {
  (void)transfer; (void)stream;
  if (method_used) *method_used = 1;
  return 0;
}
const char* hicache_error_string(int code) { (void)code; return "fake"; }
"""


_noop_path: list[Path] = []


def noop_library() -> ctypes.CDLL:
    """A C library with the launcher's signature that does nothing: the ctypes
    call costs what the real one does, minus the CUDA launch. Needs cc. Each
    call returns a new handle (ops sets argtypes on the handle's functions)."""
    if not _noop_path:
        folder = Path(tempfile.mkdtemp(prefix="hicache-noop-"))
        # Once per process; the handle stays open until exit, so the folder goes then, not after the test.
        atexit.register(shutil.rmtree, folder, True)
        (folder / "noop.c").write_text(_NOOP_SOURCE)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(folder / "noop.so"), str(folder / "noop.c")],
                       check=True)
        _noop_path.append(folder / "noop.so")
    return ctypes.CDLL(str(_noop_path[0]))


class _FakeKernels:
    archs = ("sm_90",)

    def __init__(self, handle, transfer):
        self.handle = handle
        self.ops = types.SimpleNamespace(transfer=transfer)

    def supports(self, capability):
        return True


def _state_modules(ops) -> list:
    """Where the device state and the per-call CUDA queries live: transfer/launcher.py and
    transfer/resident.py beside ``ops``, or ``ops`` itself for a one-file ops.py of an older revision
    (tools/bench.py host-cost --baseline)."""
    if hasattr(ops, "_DeviceState"):
        return [ops]
    return [importlib.import_module(f"{ops.__package__}.{name}") for name in ("launcher", "resident")]


def install(ops, *, handle=None, transfer=None, device: int = 0):
    """Builds ops' state for ``device`` around ``handle`` (a ctypes library
    with hicache_transfer_launch, or None for the torch-op fallback) and
    ``transfer`` (the torch op stand-in). Returns the state."""
    from sglang_hicache_jit.buildcache import arch, loader

    real_zeros = torch.zeros

    def zeros(*args, pin_memory=False, **kwargs):  # no pinned memory without a GPU
        return real_zeros(*args, **kwargs)

    saved = (arch.current_gpu_capability, loader.load_kernels, torch.zeros)
    arch.current_gpu_capability = lambda device=None: (9, 0)
    loader.load_kernels = lambda device=None, **kwargs: _FakeKernels(handle, transfer or (lambda *a: 1))
    torch.zeros = zeros
    try:
        state = _state_modules(ops)[0]._DeviceState(device)
    finally:
        arch.current_gpu_capability, loader.load_kernels, torch.zeros = saved
    _state_modules(ops)[0]._states[device] = state
    return state


def _plan_modules(ops) -> list:
    """transfer/plans.py beside ``ops`` where it exists (not in a one-file ops.py of an older revision)."""
    if hasattr(ops, "_DeviceState"):
        return []
    return [importlib.import_module(f"{ops.__package__}.plans")]


_ANSWERS = {"_raw_stream": lambda device: 0, "_current_device": lambda: 0,
            "_host_registered": lambda address: True}  # fake pinned memory stays pinned


@contextlib.contextmanager
def stub_cuda_runtime(ops):
    """The CUDA runtime queries ops makes per call, answered without a GPU."""
    modules = _state_modules(ops) + _plan_modules(ops)
    saved = [(m, name, getattr(m, name)) for m in modules for name in _ANSWERS if hasattr(m, name)]
    saved_current = torch.cuda.current_device
    for module, name, _ in saved:
        setattr(module, name, _ANSWERS[name])
    torch.cuda.current_device = lambda: 0
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        torch.cuda.current_device = saved_current


@contextlib.contextmanager
def stub_uploads():
    """CPU indices go through pin_memory() and .to(cuda): without a GPU both
    return the tensor itself (their real cost is torch's, not ops.py's)."""
    saved = (torch.Tensor.pin_memory, torch.Tensor.to)
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    torch.Tensor.to = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.pin_memory, torch.Tensor.to = saved


class _Stream:
    """A stream that orders nothing: on the CPU every op runs when submitted. Its handle is not the legacy
    NULL stream's (0), as SGLang's load and write streams are not."""

    cuda_stream = 1

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass


@contextlib.contextmanager
def stub_streams():
    """torch.cuda's stream, event, device and capture calls that transfer/staging.py and direct.py make,
    answered without a GPU (one stream, events that order nothing)."""
    stream = _Stream()
    names = {"is_current_stream_capturing": lambda: False, "current_stream": lambda device=None: stream,
             "stream": lambda s: contextlib.nullcontext(), "device": lambda d: contextlib.nullcontext(),
             "Stream": lambda *a, **k: _Stream(), "Event": _Event}
    saved = {name: getattr(torch.cuda, name) for name in names}
    for name, value in names.items():
        setattr(torch.cuda, name, value)
    try:
        yield stream
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


@contextlib.contextmanager
def stub_device_tensors():
    """``torch.tensor(..., device=<a GPU>)`` (a staging area's gather builds its pointer tables so) and
    ``torch.empty(..., device=<a GPU>)`` (a staging area's buffers) made in CPU memory dressed as cuda:0."""
    saved = {"tensor": torch.tensor, "empty": torch.empty}

    def on_stand_in(real):
        def make(*args, device=None, **kwargs):
            if device is not None and torch.device(device).type == "cuda":
                return cuda(real(*args, **kwargs))
            return real(*args, device=device, **kwargs)
        return make

    for name, real in saved.items():
        setattr(torch, name, on_stand_in(real))
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(torch, name, real)


class _CopyEngines:
    """The CUDA runtime's copy calls as direct.py makes them (descriptors handed over): doing nothing, or
    (``perform``) each descriptor's 2-D copy in CPU memory, row by row, as the copy engines would."""

    has_batch = True
    version = 13000

    def __init__(self, perform: bool = False):
        self.perform = perform
        self.copies = 0

    def memcpy_2d(self, words, stream):
        self._run(words)

    def memcpy_batch(self, words, stream):
        self._run(words)

    def _run(self, words):
        if not self.perform:
            return
        from sglang_hicache_jit.transfer.cuda import word

        columns = [word(f) for f in ("dst.ptr", "dst.rowLength", "src.ptr", "src.rowLength", "extent.width",
                                     "extent.height")]
        for dst, dpitch, src, spitch, width, height in words[:, columns].tolist():
            self.copies += 1
            for h in range(height):
                ctypes.memmove(dst + h * dpitch, src + h * spitch, width)


@contextlib.contextmanager
def stub_copy_engines(perform: bool = False):
    """direct.py's copies on the stand-in device: planned and described as on a GPU, then submitted to
    nothing, or (``perform``) carried out in CPU memory. Yields the stand-in runtime."""
    from sglang_hicache_jit.transfer import direct

    saved = direct.cuda_runtime
    engines = _CopyEngines(perform)
    direct.cuda_runtime = lambda: engines
    try:
        yield engines
    finally:
        direct.cuda_runtime = saved


def random_bits(shape, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """A tensor of ``shape`` whose 16-bit words are random (any bit pattern, NaNs included), seeded."""
    bits = torch.randint(-(1 << 15), 1 << 15, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int16)
    return bits.view(dtype)


def int16_bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as int16 words, so that comparisons are bit for bit (NaN equals itself)."""
    return t.view(torch.int16)


@contextlib.contextmanager
def copying_device(ops):
    """The stand-in cuda:0 with a launcher and copy engines that really copy (Copier, stub_copy_engines(
    perform=True)), and every torch.cuda call the transfer layer makes answered: yields (the Copier, the copy
    engines). On leaving, the device state, the checked pointer tables, the routed ops' staging areas and the
    probe's verdicts are forgotten, so nothing of the stand-in reaches a later test."""
    from sglang_hicache_jit.integrations.sglang import ops as routed
    from sglang_hicache_jit.transfer import launcher, pointer_tables, route

    copier = Copier()
    saved = dict(launcher._states)
    with (stub_cuda_runtime(ops), stub_uploads(), stub_streams(), stub_device_tensors(),
          stub_copy_engines(perform=True) as engines):
        install(ops, handle=noop_library())._launch_c = copier
        try:
            yield copier, engines
        finally:
            launcher._states.clear()
            launcher._states.update(saved)
            pointer_tables.clear()
            routed._stagings.clear()
            route.reset()
