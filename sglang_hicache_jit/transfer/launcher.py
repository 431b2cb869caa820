"""Per-device state and the ctypes launcher: the loaded library and its C entry points on each GPU,
the pinned words the kernel reports skipped rows in, and the calls that read them (check_errors) or
stop the resident kernel on every device (stop_resident, resident_stats, and at exit)."""

from __future__ import annotations

import atexit
import ctypes
import threading

import torch

from .. import settings
from ..errors import ArchUnsupportedError, TransferIndexError
from .abi import _ERROR_MESSAGES, _ERROR_WORDS, _RESIDENT, _c_launcher, _current_device, _raw_stream
from .resident import ResidentQueue


class _DeviceState(ResidentQueue):
    """Per-device library handle and the pinned words the kernel reports errors in."""

    def __init__(self, device: int):
        from ..buildcache.arch import current_gpu_capability
        from ..buildcache.loader import load_kernels

        self.device = device
        self.capability = current_gpu_capability(device)
        self.library = load_kernels(device=device)
        if not self.library.supports(self.capability):
            major, minor = self.capability
            raise ArchUnsupportedError(
                f"The kernel library was built for {', '.join(map(str, self.library.archs))}, "
                f"which cannot run on cuda:{device} (compute capability {major}.{minor}).",
                f"include {major}.{minor} in {settings.ARCH} (or TORCH_CUDA_ARCH_LIST), or unset it.",
            )
        self.error_flags = torch.zeros(_ERROR_WORDS, dtype=torch.int32, pin_memory=True)
        self.error_flags_ptr = self.error_flags.data_ptr()
        self.error_view = (ctypes.c_uint32 * _ERROR_WORDS).from_address(self.error_flags_ptr)
        # The words the kernel sets, read as one bytes object: the cheapest
        # "no error pending" test for the per-call path (_Plan.run).
        self.error_bytes = (ctypes.c_char * (4 * len(_ERROR_MESSAGES))).from_address(self.error_flags_ptr)
        self.transfer = self.library.ops.transfer
        self._launch_c = _c_launcher(self.library.handle)
        self._method_used = ctypes.c_int(0)
        self._method_used_ref = ctypes.byref(self._method_used)
        self.resident = None  # the resident kernel's queue (a C pointer), created by the first resident transfer
        self._resident_lock = threading.Lock()

    def launch_torch_op(self, idx_src: torch.Tensor, idx_dst: torch.Tensor, *args) -> int:
        """One copy through the binding's torch op, for a library without the C
        entry points (plans call the C launcher through ctypes otherwise: a torch
        op call with 22 arguments costs ~10 us of host time in the dispatcher,
        ctypes ~2 us). ``args`` are the op's integer arguments after the two
        index tensors. There is no resident queue on this path. Returns the
        method that ran."""
        args = list(args)
        args[16] &= ~_RESIDENT
        return self.transfer(idx_src, idx_dst, *args)

    def submit(self, spec, method_used) -> None:
        """Calls the C launcher on the current stream of this device with a
        filled HicacheTransfer; it stores the method that ran in a c_int.
        Both are passed by address (an int) or as ``ctypes.byref``."""
        launch, device = self._launch_c, self.device
        if _current_device() == device:
            err = launch(spec, _raw_stream(device), method_used)
        else:
            with torch.cuda.device(device):
                err = launch(spec, _raw_stream(device), method_used)
        if err:
            raise RuntimeError(f"hicache transfer: {self._error_string(err)}")

    def _error_string(self, err: int) -> str:
        message = self.library.handle.hicache_error_string(err)
        return message.decode() if message else str(err)


_states: dict[int, _DeviceState] = {}
_states_lock = threading.Lock()


def _state(device: int) -> _DeviceState:
    state = _states.get(device)
    if state is None:
        with _states_lock:
            state = _states.get(device)
            if state is None:
                state = _states[device] = _DeviceState(device)
    return state


def _raise_reported(state: _DeviceState) -> None:
    words = state.error_view
    if words[0] | words[1] | words[2] | words[3]:
        problems = [msg for i, msg in enumerate(_ERROR_MESSAGES) if words[i]]
        indices = words[0] | words[1]
        if words[3]:  # a table rewritten behind torch: forget every check, so the next call reads tables anew
            from . import pointer_tables

            pointer_tables.clear()
        for i in range(_ERROR_WORDS):
            words[i] = 0
        raise TransferIndexError(
            f"a transfer on cuda:{state.device} skipped rows: {'; '.join(problems)}. Those rows were "
            "neither read nor written. (Reported by the first op on this device after the faulty one"
            + (f"; set {settings.STRICT}=1 to check indices before each launch.)" if indices else ".)")
        )


def _device_index(device: int | torch.device | None) -> int:
    """A device argument as an index: None (or 'cuda' without an index) is the current device."""
    index = device.index if isinstance(device, torch.device) else (None if device is None else
                                                                    torch.device("cuda", device).index)
    return torch.cuda.current_device() if index is None else index


def check_errors(device: int | torch.device | None = None, *, synchronize: bool = True) -> None:
    """Raises TransferIndexError if a finished transfer on ``device`` skipped an
    out-of-range index. With synchronize=True it waits for the device first."""
    index = _device_index(device)
    state = _states.get(index)
    if state is None:
        return
    if synchronize:
        torch.cuda.synchronize(index)
    _raise_reported(state)


def stop_resident(device: int | torch.device | None = None) -> None:
    """Stops the resident copy kernel (method 'resident') and gives its SMs back.

    Queued transfers finish first: it waits up to 2 s for streams that have
    not reached theirs yet. A stream that reaches a queued transfer only after
    that would wait for it forever, so stop when no stream still has resident
    transfers ahead of it (e.g. after synchronizing them). ``device=None``
    stops it on every device. The next resident transfer starts it again.
    Called at interpreter exit.
    """
    states = list(_states.values()) if device is None else [_states.get(_device_index(device))]
    for state in states:
        if state is not None:
            state.stop_resident()


def resident_stats(device: int | torch.device | None = None) -> dict | None:
    """The resident queue's counters on ``device`` (launches of the resident
    kernel, transfers queued, fallbacks to an ordinary launch, transfers
    finished), or None when it is not running there."""
    state = _states.get(_device_index(device))
    return state.resident_stats() if state is not None else None


def _stop_all_resident() -> None:
    try:
        stop_resident()
    except Exception:  # at exit the CUDA context may already be gone; nothing is left to protect
        pass


atexit.register(_stop_all_resident)
