"""GPU (marked ``gpu``): the index rule's attacks that need a GPU, with guard rows around every destination.

Every destination is a slice of a larger buffer whose rows before and after it hold random bytes; after each
case the whole buffer (guards included) is compared with what it held before, so a stray write fails the test
even where the op returned normally. After each test a canary transfer runs and is checked bit for bit: a
sticky CUDA error left by a case would fail it there. The CPU half of the attacks is tests/test_index_rule.py.
"""

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from sglang_hicache_jit import compat, ops
from sglang_hicache_jit.errors import TransferIndexError
from sglang_hicache_jit.host_pool import MHADevicePool, MHAHostKVPool, MLADevicePool, MLAHostKVPool
from sglang_hicache_jit.integrations.sglang import ops as routed
from sglang_hicache_jit.transfer import cuda, direct

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
TOP = (1 << 63) - 1
GUARD = 4


def rand_bytes(shape, *, device="cpu", pin=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    t = t.to(device)
    return t.pin_memory() if pin else t


class Guarded:
    """``rows`` rows of shape ``row`` (uint8) inside GUARD guard rows each side, random bytes throughout."""

    def __init__(self, rows, *row, device="cpu", pin=False, seed=0):
        self.whole = rand_bytes((rows + 2 * GUARD, *row), device=device, pin=pin, seed=seed)
        self.before = self.whole.clone()
        self.t = self.whole[GUARD:GUARD + rows]

    def untouched(self) -> bool:
        torch.cuda.synchronize()
        return torch.equal(self.whole.cpu(), self.before.cpu())


@pytest.fixture(autouse=True)
def canary():
    """After each test: a small host -> GPU -> host round trip on the kernel and the copy engines must come
    out bit-exact, and no transfer error may be pending."""
    yield
    torch.cuda.synchronize()
    ops.check_errors()
    src = rand_bytes((64, 256), pin=True, seed=99)
    dev = torch.zeros((64, 256), dtype=torch.uint8, device="cuda")
    back = torch.zeros((64, 256), dtype=torch.uint8, pin_memory=True)
    idx = torch.arange(64)
    ops.transfer_one_layer_mla(dev, idx.cuda(), src, idx)
    direct.copy_rows([(back, dev)], idx, idx)
    torch.cuda.synchronize()
    ops.check_errors()
    assert torch.equal(back, src), "the canary round trip came back wrong"


def _tables(layers):
    return torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64, device="cuda")


# ---------------------------------------------------------------------------
# The direct path: runs and whole pages that wrap past 2**63, every submission mode, both directions.

WRAPPING = {
    "top-index": ([TOP], [0], 1),
    "run-across-2^63": ([TOP - 1, TOP], [0, 1], 1),
    "whole-page-across-2^63": ([TOP - 3, TOP - 2, TOP - 1, TOP, -TOP - 1, -TOP, -TOP + 1, -TOP + 2],
                               list(range(8)), 8),
    "page-ending-at-2^63": (list(range(TOP - 7, TOP + 1)), list(range(8)), 8),
}


@pytest.mark.parametrize("mode", ["auto", "batch", "2d"])
@pytest.mark.parametrize("to_device", [True, False], ids=["h2d", "d2h"])
@pytest.mark.parametrize("strided", [False, True], ids=["packed", "strided"])
@pytest.mark.parametrize("case", WRAPPING, ids=list(WRAPPING))
@pytest.mark.parametrize("side", ["dst", "src"])
def test_direct_path_refuses_wrapping_indices(mode, to_device, strided, case, side):
    """Before: check_bounds wrapped at 2**63 and describe_copies addressed rows before the tensor."""
    row = 64
    dev = Guarded(32, row, device="cuda", seed=1)
    host = Guarded(32, 2 if strided else 1, row, pin=True, seed=2)
    host_rows = host.t[:, 1] if strided else host.t[:, 0]  # strided: one layer of a page_first buffer
    dst, src = (dev.t, host_rows) if to_device else (host_rows, dev.t)
    huge, small, page = WRAPPING[case]
    dst_idx, src_idx = (huge, small) if side == "dst" else (small, huge)
    with pytest.raises(TransferIndexError, match=f"indices_{side}"):
        direct.copy_rows([(dst, src)], torch.tensor(dst_idx, dtype=torch.int64),
                         torch.tensor(src_idx, dtype=torch.int64), mode=mode, page_size=page)
    assert dev.untouched() and host.untouched()


def _pools(kind, layout, *, page=4, slots=64, layers=3):
    guarded = [Guarded(slots, 1, 288, device="cuda", seed=10 + i) for i in range(layers * (1 if kind == "mla" else 2))]
    tensors = [g.t.view(torch.bfloat16) for g in guarded]  # (slots, 1, 144) bf16: 288-B rows
    device = (MLADevicePool(tensors) if kind == "mla" else MHADevicePool(tensors[:layers], tensors[layers:]))
    cls = MLAHostKVPool if kind == "mla" else MHAHostKVPool
    return guarded, device, cls(device, size=slots, page_size=page, layout=layout)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_host_pool_direct_transfers_refuse_wrapping_device_pages(kind, layout):
    """Before: 12 cases through the pools' direct loads wrote rows before the device layers."""
    guarded, device, pool = _pools(kind, layout)
    pool.direct_mode = "batch"  # the copy engines themselves (by default copies this small take a one-CTA kernel)
    host_before = pool.kv_buffer.clone()
    device_idx = torch.tensor([TOP - 3, TOP - 2, TOP - 1, TOP])  # a whole page of 4 ending at 2**63 - 1
    with pytest.raises(TransferIndexError, match="indices_dst"):
        pool.load_to_device_per_layer(device, torch.arange(4), device_idx, 1, "direct")
    with pytest.raises(TransferIndexError, match="indices_src"):
        pool.backup_from_device_all_layer(device, torch.arange(4), device_idx, "direct")
    assert all(g.untouched() for g in guarded)
    assert torch.equal(pool.kv_buffer.view(torch.uint8), host_before.view(torch.uint8))  # bytes: NaNs


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_host_pool_page_first_direct_refuses_wrapping_host_tokens(io_backend):
    """Tokens 2**62 + k times layers x page wrapped to host page 0; on GPU indices the kernel refuses them."""
    guarded, device, pool = _pools("mla", "page_first_direct")
    host_before = pool.kv_buffer.clone()
    big = (1 << 62) + torch.arange(4)
    for where in ("cpu", "cuda"):
        # CPU indices: refused on the host, naming them; GPU indices: the kernel skips the rows and reports them.
        with pytest.raises(TransferIndexError, match="host_indices|indices_dst"):
            pool.backup_from_device_all_layer(device, big.to(where), torch.arange(4).to(where), io_backend)
            ops.check_errors()
    torch.cuda.synchronize()
    assert torch.equal(pool.kv_buffer.view(torch.uint8), host_before.view(torch.uint8))  # bytes: NaNs
    assert all(g.untouched() for g in guarded)


# ---------------------------------------------------------------------------
# Pointer tables where the host buffer is a tensor: the staged write-back and the routed lf_pf ops.

SLOTS, LAYERS, ROW = 32, 3, 656  # DSA-sized rows


def _write_back_case(seed):
    dev = [rand_bytes((SLOTS, 1, ROW), device="cuda", seed=seed + i) for i in range(LAYERS)]
    host = Guarded(SLOTS, LAYERS, 1, ROW, pin=True, seed=seed + 10)
    return dev, host


@pytest.mark.parametrize("bad", [SLOTS, SLOTS + 2, TOP], ids=["slots", "slots+2", "2^63-1"])
def test_compat_staged_write_back_refuses_an_index_past_the_host_buffer(bad):
    """Before: a destination index of slots, slots+2 or 2**63-1 wrote outside dst on the GPU."""
    dev, host = _write_back_case(20)
    staging = torch.empty((4, LAYERS, 1, ROW), dtype=torch.uint8, device="cuda")
    with pytest.raises(TransferIndexError, match="indices_dst"):
        compat.transfer_hicache_all_layer_mla_staged_lf_pf(_tables(dev), torch.tensor([0, 1], device="cuda"),
                                                           torch.tensor([bad, 0], device="cuda"), staging, host.t,
                                                           page_size=1)
        ops.check_errors()
    expected = host.before.clone()
    for layer in range(LAYERS):  # the valid pair (device 1 -> host 0) was copied; nothing else was touched
        expected[GUARD, layer] = dev[layer][1].cpu()
    torch.cuda.synchronize()
    assert torch.equal(host.whole, expected)


@pytest.mark.parametrize("path", ["kernel", "direct"])
@pytest.mark.parametrize("bad", [SLOTS, SLOTS + 2, TOP], ids=["slots", "slots+2", "2^63-1"])
def test_routed_mla_lf_pf_refuses_an_index_past_the_host_buffer(path, bad):
    """Before: the routed transfer_kv_all_layer_mla_lf_pf accepted the same indices silently."""
    dev, host = _write_back_case(30)
    context = routed.copy_engines_only() if path == "direct" else contextlib.nullcontext()
    with context, pytest.raises(TransferIndexError, match="indices_dst"):
        routed.transfer_kv_all_layer_mla_lf_pf(_tables(dev), host.t, torch.tensor([0], device="cuda"),
                                               torch.tensor([bad], device="cuda"), ROW, LAYERS * ROW, LAYERS)
        ops.check_errors()
    assert host.untouched()


def test_routed_direct_write_back_refuses_tokens_past_the_pool():
    """Before: destination tokens 2**62 + [0..3] overwrote host page 0 of every layer."""
    page = 4
    dev = [rand_bytes((SLOTS, 1, 288), device="cuda", seed=40 + i) for i in range(LAYERS)]
    host = Guarded(SLOTS // page, LAYERS, page, 1, 288, pin=True, seed=50)
    with pytest.raises(TransferIndexError, match="dst_indices"):
        routed.transfer_kv_all_layer_direct_lf_pf(dev, [host.t], torch.arange(page).cuda(),
                                                  (1 << 62) + torch.arange(page), page)
    assert host.untouched()


def test_page_unified_write_back_refuses_a_page_past_the_host_buffer():
    pages, page = 6, 4
    dev = [rand_bytes((SLOTS, 288), device="cuda", seed=60 + i) for i in range(LAYERS)]
    host = Guarded(pages, LAYERS, page, 288, pin=True, seed=70)
    staging = torch.empty((2, LAYERS, page, 288), dtype=torch.uint8, device="cuda")
    for bad in (pages, (1 << 62) // page):
        for where in ("cpu", "cuda"):
            with pytest.raises(TransferIndexError, match="dst_pages|indices_dst"):
                compat.transfer_hicache_all_layer_mla_staged_lf_page_unified(
                    _tables(dev), torch.tensor([0], device="cuda"), torch.tensor([bad]).to(where), staging, host.t)
                ops.check_errors()
    assert host.untouched()


# ---------------------------------------------------------------------------
# Zero-size transfers.

@pytest.mark.parametrize("indices_on", ["cpu", "cuda"])
@pytest.mark.parametrize("to_device", [True, False], ids=["h2d", "d2h"])
@pytest.mark.parametrize("op", ["one-layer-mla", "one-layer-mha", "all-layer-mla", "all-layer-mha", "pointer-tables"])
@pytest.mark.parametrize("method", [None, "plain", "resident"])
def test_zero_size_transfers_are_no_ops(op, to_device, indices_on, method):
    """Before: a zero-size H2D raised RuntimeError "invalid transfer arguments" (one- and all-layer, MLA and MHA)."""
    dev = [Guarded(16, 256, device="cuda", seed=80 + i) for i in range(2)]
    host = [Guarded(16, 256, pin=True, seed=90 + i) for i in range(2)]
    d, h = [g.t for g in dev], [g.t for g in host]
    dst, src = (d, h) if to_device else (h, d)
    empty = torch.empty(0, dtype=torch.int64, device=indices_on)
    for _ in range(2):  # the first call builds the plan, the second runs from it
        if op == "one-layer-mla":
            ops.transfer_one_layer_mla(dst[0], empty, src[0], empty, method=method)
        elif op == "one-layer-mha":
            ops.transfer_one_layer(dst[0], dst[1], empty, src[0], src[1], empty, method=method)
        elif op == "all-layer-mla":
            ops.transfer_all_layer(ops.LayerTable(dst, written=True), empty, ops.LayerTable(src), empty, method=method)
        elif op == "all-layer-mha":
            ops.transfer_all_layer(ops.LayerTable(([dst[0]], [dst[1]]), written=True), empty,
                                   ops.LayerTable(([src[0]], [src[1]])), empty, method=method)
        else:
            ops.transfer_pointer_tables(_tables(dst), empty, _tables(src), empty, dst_stride_bytes=256,
                                        src_stride_bytes=256, element_size=256, method=method)
    torch.cuda.synchronize()
    ops.check_errors()
    assert all(g.untouched() for g in dev + host)
    if method == "resident":
        ops.stop_resident()


# ---------------------------------------------------------------------------
# The launch-plan cache and host memory unregistered under a cached plan.

_UNREGISTER = textwrap.dedent("""
    import torch
    from sglang_hicache_jit import ops
    from sglang_hicache_jit.transfer import cuda, direct

    runtime = cuda.cuda_runtime()
    pinned = torch.empty((8, 64), dtype=torch.uint8, pin_memory=True)  # cudaHostAlloc
    assert runtime.host_registered(pinned.data_ptr()) and runtime.host_registered(pinned[3].data_ptr())
    assert not runtime.host_registered(torch.empty((8, 64), dtype=torch.uint8).data_ptr())

    def registered(rows):  # as a pool's host buffer: pageable memory, then cudaHostRegister
        # 256 KiB: malloc maps pages of their own for it, so no registration overlaps another's pages; the
        # whole storage is registered, as the pools do (torch's is_pinned asks about the storage's start).
        raw = torch.empty(256 * 1024, dtype=torch.uint8)
        t = raw[:rows * 512].view(rows, 2, 256)
        t.random_(0, 256)
        runtime.host_register(raw.data_ptr(), raw.numel())
        assert runtime.host_registered(t.data_ptr()) and runtime.host_registered(t[rows - 1, 1].data_ptr())
        return t

    dev = torch.zeros((64, 256), dtype=torch.uint8, device="cuda")
    idx = torch.arange(16)
    for op in ("h2d", "d2h", "mha", "all-layer"):
        host = registered(64)
        layer = host[:, 1]  # a page_first layer view
        table = ops.LayerTable([host[:, 0], host[:, 1]], name="host_pool", written=True)
        device_table = ops.LayerTable([dev, dev.clone()], name="device_pool")
        def run():
            if op == "h2d":
                ops.transfer_one_layer_mla(dev, idx.cuda(), layer, idx)
            elif op == "d2h":
                ops.transfer_one_layer_mla(layer, idx, dev, idx.cuda())
            elif op == "mha":
                ops.transfer_one_layer(dev, dev, idx.cuda(), layer, layer, idx)
            else:
                ops.transfer_all_layer(table, idx, device_table, idx.cuda())
        run()
        run()  # from the plan
        torch.cuda.synchronize()
        runtime.host_unregister(host.data_ptr())
        assert not runtime.host_registered(host.data_ptr())
        try:
            run()
        except ValueError as exc:
            assert "no longer pinned" in str(exc), exc
            print("REFUSED", op, str(exc).split(" is host memory")[0])
        else:
            print("LAUNCHED", op)
        torch.cuda.synchronize()  # a launch into the unpinned memory would fail here, or kill the process
    ops.check_errors()
    print("DONE")
""")


def test_a_cached_plan_refuses_host_memory_unregistered_under_it():
    """Before: the next transfer on the cached plan hit an illegal memory access (a sticky error that ends
    the process). Run in a child process, so that a regression cannot take the test session with it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _UNREGISTER], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.split("\n")
    assert [line.split()[:2] for line in lines if line.startswith(("REFUSED", "LAUNCHED"))] == [
        ["REFUSED", op] for op in ("h2d", "d2h", "mha", "all-layer")], out.stdout
    assert "DONE" in lines, out.stdout
