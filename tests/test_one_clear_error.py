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
