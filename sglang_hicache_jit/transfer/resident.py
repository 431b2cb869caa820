"""The resident copy kernel's lifecycle on one device: its queue is created by the first resident
transfer, takes submissions, reports counters and is stopped (ops.stop_resident, and at exit).
A mixin of launcher._DeviceState, which holds the library, the lock and the method-used word."""

from __future__ import annotations

import ctypes

import torch

from .. import settings
from .abi import RESIDENT_QUEUE_SLOTS, _current_device, _raw_stream, _resident_signatures


def _capturing() -> bool:
    """Whether the current stream is being captured into a CUDA graph."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # no usable CUDA context here (torch's AcceleratorError): nothing is being captured
        return False


class ResidentQueue:
    """The resident-queue methods of a device state (see launcher._DeviceState)."""

    def _submit_resident(self, spec) -> int:
        if _current_device() != self.device:
            with torch.cuda.device(self.device):
                return self._submit_resident(spec)
        # One lock for submit, create and stop: a stop frees the queue, which a concurrent submit must not
        # be using; the method-used word is shared too.
        with self._resident_lock:
            if self.resident is None and _capturing():
                # Creating the queue allocates memory and synchronizes a stream, which invalidates a CUDA
                # graph being captured. A graph replays an ordinary launch anyway (what the C side captures
                # once the queue exists), so launch that; the queue is created by the next call outside.
                self.submit(ctypes.addressof(spec), self._method_used_ref)
                return self._method_used.value
            queue = self.resident or self._create_resident_queue()
            err = self.library.handle.hicache_resident_submit(queue, ctypes.byref(spec), _raw_stream(self.device),
                                                              self._method_used_ref)
            if err:
                raise RuntimeError(f"hicache transfer (resident): {self._error_string(err)}")
            return self._method_used.value

    def _create_resident_queue(self) -> int:
        """The resident kernel's queue on this device (called with _resident_lock held)."""
        handle = self.library.handle
        _resident_signatures(handle)
        blocks = settings.resident_blocks()
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        if blocks > sms:  # every resident CTA must fit at once, or a transfer would wait forever
            raise settings.bad(settings.RESIDENT_BLOCKS, str(blocks),
                               f"cuda:{self.device} has {sms} SMs and each resident CTA needs one")
        out = ctypes.c_void_p()
        err = handle.hicache_resident_create(blocks, RESIDENT_QUEUE_SLOTS, settings.resident_idle_us(),
                                             ctypes.byref(out))
        if err:
            raise RuntimeError(f"the resident method is unavailable on cuda:{self.device}: "
                               f"{self._error_string(err)}. Use method 'auto' instead.")
        self.resident = out.value
        return self.resident

    def stop_resident(self, timeout_ms: int = 2000) -> None:
        with self._resident_lock:
            queue, self.resident = self.resident, None
            if queue is None:
                return
            with torch.cuda.device(self.device):
                err = self.library.handle.hicache_resident_destroy(queue, timeout_ms)
        if err:
            raise RuntimeError(f"stopping the resident copy kernel on cuda:{self.device}: {self._error_string(err)}")

    def resident_stats(self) -> dict | None:
        with self._resident_lock:
            if self.resident is None:
                return None
            out = (ctypes.c_uint64 * 4)()
            self.library.handle.hicache_resident_stats(self.resident, out)
        return dict(launches=out[0], queued=out[1], fallbacks=out[2], finished=out[3])
