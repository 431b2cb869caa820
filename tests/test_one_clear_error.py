"""Issue 26, "Tracebacks instead of one clear error": the cases that are not about indices or geometry.

* ``SlotAllocator`` larger than the machine (torch's out-of-memory error before);
* the resident method inside a CUDA graph capture (it invalidated the capture; GPU);
* ``tools/sglang_releases.py`` on a malformed wheel (StopIteration, SyntaxError, RecursionError before).
"""

import pytest

# ---- a slot allocator larger than the machine was torch's out-of-memory error ----------------------------------------

def test_a_slot_allocator_larger_than_the_machine_is_one_clear_error():
    from sglang_hicache_jit.transfer.slot_allocator import SlotAllocator

    with pytest.raises(ValueError, match=r"size=10000000000000 slots needs 83819\.0 GiB for the slot allocator's "
                                         r"bookkeeping \(9 B a slot\), more than this machine's .* GiB of memory; "
                                         r"at most \d+ slots fit \(whole pages of 64\)"):
        SlotAllocator(10**13, 64)


def test_a_slot_allocator_the_memory_free_now_cannot_hold_is_one_clear_error(monkeypatch):
    from sglang_hicache_jit.transfer import slot_allocator

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes.")

    monkeypatch.setattr(slot_allocator.torch, "zeros", out_of_memory)
    with pytest.raises(ValueError, match=r"size=4096 slots needs 0\.0 GiB .*which could not be allocated "
                                         r"\(DefaultCPUAllocator: can't allocate memory.*\); .* GiB are free now; "
                                         r"at most \d+ slots fit"):
        slot_allocator.SlotAllocator(4096, 64)


# ---- the resident method inside a CUDA graph capture: creating its queue invalidated the capture --------------------

def test_no_resident_queue_is_created_while_a_graph_is_captured(monkeypatch):
    """Without a GPU: a stand-in device state whose queue creation fails the test; the capture launches as usual."""
    import ctypes
    import threading

    import torch

    from sglang_hicache_jit.transfer import resident

    class State(resident.ResidentQueue):
        device, resident = 0, None

        def __init__(self):
            self._resident_lock = threading.Lock()
            self._method_used = ctypes.c_int(0)
            self._method_used_ref = ctypes.byref(self._method_used)
            self.launched = []

        def submit(self, spec, method_used):
            self.launched.append(spec)
            self._method_used.value = 2

        def _create_resident_queue(self):
            raise AssertionError("the resident queue was created inside a graph capture")

    monkeypatch.setattr(resident, "_current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    state, spec = State(), ctypes.c_int(7)
    assert state._submit_resident(spec) == 2
    assert state.launched == [ctypes.addressof(spec)] and state.resident is None


@pytest.mark.gpu
def test_the_resident_method_inside_a_capture_records_an_ordinary_launch():
    import torch

    from sglang_hicache_jit import ops

    ops.stop_resident()
    host = torch.randint(0, 256, (1024, 1152), dtype=torch.uint8).pin_memory()
    dev = torch.zeros((2 + 512, 1152), dtype=torch.uint8, device="cuda")  # a guard row either side
    hidx = (torch.tensor([3, 9, 1, 14])[:, None] * 64 + torch.arange(64)).reshape(-1).cuda()
    didx = torch.arange(256, device="cuda")
    ops.transfer_one_layer_mla(dev[1:-1], didx, host, hidx)  # the device's state exists before the capture
    torch.cuda.synchronize()
    dev.zero_()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    try:
        with torch.cuda.graph(graph, stream=stream):  # the first resident transfer, inside the capture
            used = ops.transfer_one_layer_mla(dev[1:-1], didx, host, hidx, method="resident")
        assert not used.startswith("resident-") and ops.resident_stats() is None  # captured as a launch
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dev[1:257].cpu(), host[hidx.cpu()]) and not dev[257:].any() and not dev[0].any()
        dev.zero_()
        assert ops.transfer_one_layer_mla(dev[1:-1], didx, host, hidx, method="resident").startswith("resident-")
        torch.cuda.synchronize()
        assert torch.equal(dev[1:257].cpu(), host[hidx.cpu()]) and ops.resident_stats()["queued"] == 1
    finally:
        ops.stop_resident()
