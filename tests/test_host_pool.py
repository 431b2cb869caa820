"""Host KV pools and the direct path without a GPU: every layout x backend x operation.

The device pools here are CPU tensors, so every transfer runs the direct
path's plan with slice copies; the GPU files run the same helpers on CUDA.
Each round trip fills both sides with random bytes, so the whole-buffer
comparisons also prove that slots and layers nobody addressed are untouched.
"""

import ctypes
import json
import logging
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_hicache_jit import host_pool
from sglang_hicache_jit.transfer import cuda, direct, route
from sglang_hicache_jit.errors import TransferIndexError
from sglang_hicache_jit.host_pool import MHADevicePool, MHAHostKVPool, MLADevicePool, MLAHostKVPool

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = host_pool.LAYOUTS
PAGE_SIZES = [1, 16, 64]
ROW_BYTES = [1152, 576, 656]
LAYERS, OWNED = 4, (1, 3)
DEVICE_SLOTS, HOST_SIZE = 384, 500  # HOST_SIZE is not a multiple of 16 or 64: the pool rounds it up

# (kind, row bytes) -> (dtype, row shape): DeepSeek MLA bf16 / FP8, DSA packed bytes, and MHA heads.
ROW_SPECS = {
    ("mla", 1152): (torch.bfloat16, (1, 576)),
    ("mla", 576): (torch.float8_e4m3fn, (1, 576)),
    ("mla", 656): (torch.uint8, (1, 656)),
    ("mha", 1152): (torch.bfloat16, (9, 64)),
    ("mha", 576): (torch.float8_e4m3fn, (9, 64)),
    ("mha", 656): (torch.uint8, (4, 164)),
}


# ---------------------------------------------------------------------------
# Helpers shared with the GPU tests.

def random_rows(slots, dtype, row_shape, gen, device="cpu"):
    nbytes = torch.empty((), dtype=dtype).element_size() * int(torch.tensor(row_shape).prod())
    raw = torch.randint(0, 256, (slots, nbytes), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(slots, *row_shape).to(device)


def make_device_pool(kind, row_bytes, gen, *, device="cpu", sharded=False, slots=DEVICE_SLOTS, layers=LAYERS):
    dtype, row_shape = ROW_SPECS[(kind, row_bytes)]
    owned = OWNED if sharded else None
    if kind == "mla":
        return MLADevicePool([random_rows(slots, dtype, row_shape, gen, device) for _ in range(layers)], owned)
    return MHADevicePool([random_rows(slots, dtype, row_shape, gen, device) for _ in range(layers)],
                         [random_rows(slots, dtype, row_shape, gen, device) for _ in range(layers)], owned)


def make_host_pool(device_pool, *, size=HOST_SIZE, page_size, layout, **kwargs):
    cls = MLAHostKVPool if isinstance(device_pool, MLADevicePool) else MHAHostKVPool
    return cls(device_pool, size=size, page_size=page_size, layout=layout, **kwargs)


def device_caches(device_pool):
    if isinstance(device_pool, MLADevicePool):
        return [device_pool.kv_buffer]
    return [device_pool.k_buffer, device_pool.v_buffer]


def host_caches(pool):
    return [pool.kv_buffer] if pool.num_caches == 1 else [pool.kv_buffer[0], pool.kv_buffer[1]]


def as_bytes(t):
    return t.view(torch.uint8)


def set_host_rows(buf, layout, page, layer, tokens, rows):
    """Reference writer: host rows of ``layer`` at ``tokens`` (the layout's formula, written out)."""
    if layout == "layer_first":
        buf[layer, tokens] = rows
    elif layout == "page_first":
        buf[tokens, layer] = rows
    else:
        buf[tokens // page, layer, tokens % page] = rows


def get_host_rows(buf, layout, page, layer, tokens):
    if layout == "layer_first":
        return buf[layer, tokens]
    if layout == "page_first":
        return buf[tokens, layer]
    return buf[tokens // page, layer, tokens % page]


def fill_random(t, gen):
    flat = as_bytes(t).view(-1)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen).to(flat.device))


def shuffle_allocator(pool, gen):
    """Hands the pool's pages out in a random order, as a pool that has served a while does."""
    everything = pool.alloc(pool.available_size())
    pages = everything.view(-1, pool.page_size)
    pool.free(pages[torch.randperm(pages.shape[0], generator=gen)].reshape(-1))


def random_indices(pool, gen, *, device_slots, padding, dtype):
    """Whole random pages on both sides (host pages from the pool's allocator), a few padding entries."""
    page = pool.page_size
    max_pages = min(device_slots, pool.size) // page
    pages = int(torch.randint(1, max_pages + 1, (1,), generator=gen))
    host = pool.alloc(pages * page)
    assert host is not None
    if bool(torch.randint(0, 2, (1,), generator=gen)):  # HiCache often sorts host pages; sometimes it does not
        host = host.view(-1, page)[host.view(-1, page)[:, 0].argsort()].reshape(-1)
    dev_pages = torch.randperm(device_slots // page, generator=gen)[:pages]
    dev = (dev_pages[:, None] * page + torch.arange(page)).reshape(-1)
    host_out, dev_out = host.clone(), dev.clone()
    if padding and host.numel() > 2:
        for _ in range(2):
            i = int(torch.randint(0, host.numel(), (1,), generator=gen))
            (host_out if i % 2 else dev_out)[i] = -1
    return host, host_out.to(dtype), dev_out.to(dtype)


def round_trip(kind, layout, page_size, row_bytes, sharded, io_backend, *, seed, device="cpu", rounds=3,
               index_device=None, configure=None):
    """Backup, overwrite the device, load every layer; compare whole buffers bit-exactly each time.
    ``configure(pool)`` runs before the first transfer. Returns the pool (for callers that check its path)."""
    gen = torch.Generator().manual_seed(seed)
    dp = make_device_pool(kind, row_bytes, gen, device=device, sharded=sharded)
    pool = make_host_pool(dp, page_size=page_size, layout=layout)
    if configure is not None:
        configure(pool)
    shuffle_allocator(pool, gen)
    start, end = OWNED if sharded else (0, LAYERS)
    for r in range(rounds):
        for buf in host_caches(pool):
            fill_random(buf, gen)
        dtype = (torch.int32, torch.int64)[r % 2]
        host, host_idx, dev_idx = random_indices(pool, gen, device_slots=DEVICE_SLOTS, padding=r > 0, dtype=dtype)
        keep = (host_idx >= 0) & (dev_idx >= 0)
        kh, kd = host_idx[keep].long(), dev_idx[keep].long()
        ix = (lambda t: t.to(index_device)) if index_device else (lambda t: t)

        # backup: device -> host, owned layers only
        expected = [as_bytes(b).clone() for b in host_caches(pool)]
        for c, layers in enumerate(device_caches(dp)):
            for l in range(start, end):
                set_host_rows(expected[c], layout, page_size, l - start, kh, as_bytes(layers[l]).cpu()[kd])
        pool.backup_from_device_all_layer(dp, ix(host_idx), ix(dev_idx), io_backend)
        _synchronize(device)
        for c, buf in enumerate(host_caches(pool)):
            assert torch.equal(as_bytes(buf), expected[c]), f"backup mismatch (round {r}, cache {c})"

        # load: host -> device, at other device slots into freshly randomized layers
        for layers in device_caches(dp):
            for t in layers:
                fill_random(t, gen)
        dev_idx2 = dev_idx[torch.randperm(dev_idx.numel(), generator=gen)] if r == 2 else dev_idx
        keep2 = (host_idx >= 0) & (dev_idx2 >= 0)
        kh2, kd2 = host_idx[keep2].long(), dev_idx2[keep2].long()
        expected_dev = [[as_bytes(t).cpu().clone() for t in layers] for layers in device_caches(dp)]
        for c, buf in enumerate(host_caches(pool)):
            for l in range(start, end):
                expected_dev[c][l][kd2] = get_host_rows(as_bytes(buf), layout, page_size, l - start, kh2)
        for l in range(LAYERS):  # not-owned layers must be silent no-ops
            pool.load_to_device_per_layer(dp, ix(host_idx), ix(dev_idx2), l, io_backend)
        _synchronize(device)
        for c, layers in enumerate(device_caches(dp)):
            for l, t in enumerate(layers):
                assert torch.equal(as_bytes(t).cpu(), expected_dev[c][l]), f"load mismatch (round {r}, layer {l})"
        pool.free(host)
    return pool


def _synchronize(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------
# The matrix.

@pytest.mark.parametrize("row_bytes", ROW_BYTES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("sharded", [False, True], ids=["all-layers", "sharded"])
@pytest.mark.parametrize("kind", ["mla", "mha"])
# Without a GPU side, an io_backend="kernel" cell runs the direct path (asserted below): the direct cell's work
# again. Those cells are in the slow set; the default run keeps the fallback through
# test_sharded_page_first_backup_without_kernel_succeeds_and_says_why.
@pytest.mark.parametrize("io_backend", [pytest.param("kernel", marks=pytest.mark.slow), "direct"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_matrix(layout, io_backend, kind, sharded, page_size, row_bytes):
    seed = zlib.crc32(repr((layout, io_backend, kind, sharded, page_size, row_bytes)).encode())
    pool = round_trip(kind, layout, page_size, row_bytes, sharded, io_backend, seed=seed)
    assert pool.transfer_path == "direct"  # no GPU on the other side


def test_auto_backend_round_trip():
    round_trip("mla", "page_first", 64, 1152, True, "auto", seed=5)


def test_sharded_page_first_backup_without_kernel_succeeds_and_says_why(caplog):
    """Upstream raises 'Layer-sharded MLA HiCache backup with page_first layout requires
    the JIT one-layer kernel.' here; the pool takes the direct path and logs why."""
    host_pool._logged_choices.clear()
    with caplog.at_level(logging.WARNING, logger="sglang_hicache_jit.host_pool"):
        pool = round_trip("mla", "page_first", 64, 1152, True, "kernel", seed=11, rounds=1)
        make_host_pool(pool.device_pool, page_size=64, layout="page_first")  # same reason: not logged again
    assert pool.transfer_path == "direct" and "not a GPU" in pool.transfer_path_reason
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "direct" in warnings[0].getMessage()


def test_path_choice_reports_the_probe_reason(monkeypatch):
    """With a GPU-side pool the probe decides; its code, reason and fix reach the pool."""
    from sglang_hicache_jit.probe import ProbeResult

    calls = []

    def fake_probe(element_size, *, device=None):
        calls.append((element_size, device))
        return ProbeResult(False, "build_failed", "nvcc said no.", "read the log")

    monkeypatch.setattr(route, "probe", fake_probe)
    gpu_layer = _FakeCudaTensor()
    path, reason = route.pool_path(gpu_layer, pinned=False, row_bytes=1152)  # not pinned: no probe needed
    assert path == "direct" and "not pinned" in reason and not calls
    path, reason = route.pool_path(gpu_layer, pinned=True, row_bytes=1152)
    assert path == "direct" and calls == [(1152, 0)]
    assert "[build_failed]" in reason and "nvcc said no." in reason and "read the log" in reason

    monkeypatch.setattr(route, "probe", lambda element_size, *, device=None: ProbeResult(True, "ok", "fine."))
    assert route.pool_path(gpu_layer, pinned=True, row_bytes=1152) == ("kernel", "the probe says: fine.")
    pool = make_host_pool(make_device_pool("mla", 1152, torch.Generator().manual_seed(0)), page_size=16,
                          layout="page_first")
    assert pool.transfer_path == "direct" and "not a GPU" in pool.transfer_path_reason  # a CPU device pool


class _FakeCudaTensor:
    """What the path choice asks of a device layer, as a CUDA tensor would answer."""

    is_cuda, device = True, torch.device("cuda", 0)


def test_auto_policy_is_one_function():
    assert route.auto_path("load", kernel_ok=True) == "kernel"
    assert route.auto_path("backup", kernel_ok=True) == "direct"  # staged: copy engines spare the compute SMs
    assert route.auto_path("backup", kernel_ok=True, layout="page_first_direct") == "direct"  # staged too
    assert route.auto_path("backup", kernel_ok=True, layout="layer_first") == "kernel"  # one page per copy
    assert route.auto_path("backup", kernel_ok=False, layout="layer_first") == "direct"
    assert route.auto_path("load", kernel_ok=False) == "direct"
    with pytest.raises(ValueError, match="operation"):
        route.auto_path("sideways", kernel_ok=True)


def test_auto_sends_host_indexed_loads_of_long_copies_and_few_tokens_to_the_copy_engines():
    long, short = {"copy_bytes": route.LOAD_ON_COPY_ENGINES_FROM}, {"copy_bytes": route.LOAD_ON_COPY_ENGINES_FROM - 4}
    few, many = 16 * 1024, route.LOAD_ON_COPY_ENGINES_BELOW_TOKENS
    assert route.auto_path("load", kernel_ok=True, **long, indices_on_host=True, tokens=few) == "direct"
    assert route.auto_path("load", kernel_ok=True, **long, indices_on_host=False, tokens=few) == "kernel"  # no sync
    assert route.auto_path("load", kernel_ok=True, **short, indices_on_host=True, tokens=few) == "kernel"
    assert route.auto_path("load", kernel_ok=True, **long, indices_on_host=True, tokens=many) == "kernel"


@pytest.mark.parametrize("layout, page, copy_rows", [("page_first_direct", 256, 256), ("layer_first", 256, 256),
                                                     ("page_first_direct", 64, 64), ("page_first", 256, 1)])
def test_auto_load_path_follows_the_layouts_copy_size(layout, page, copy_rows):
    """A 256-token page of one 1152-B layer (288 KiB) is one copy in page_first_direct and layer_first and
    goes to the copy engines below 32K tokens with host indices; 64-token pages (72 KiB) and page_first's
    single rows stay on the kernel. Backups: staged (copy engines) but layer_first on the kernel."""
    device = MLADevicePool([torch.zeros((1024, 1, 576), dtype=torch.bfloat16) for _ in range(2)])
    pool = MLAHostKVPool(device, size=1024, page_size=page, layout=layout, pin_memory=False)
    assert pool.copy_bytes == copy_rows * 1152
    pool.transfer_path = "kernel"  # as on a GPU where the probe said yes
    expected = "direct" if copy_rows * 1152 >= route.LOAD_ON_COPY_ENGINES_FROM else "kernel"
    assert pool._path("auto", "load", torch.zeros(1024, dtype=torch.int64)) == expected
    assert pool._path("auto", "load", _FakeCudaTensor()) == "kernel"
    assert pool._path("auto", "backup") == ("kernel" if layout == "layer_first" else "direct")


@pytest.mark.parametrize("layout, page, small", [("page_first", 64, True), ("layer_first", 16, True),
                                                 ("layer_first", 64, False), ("page_first_direct", 64, False)])
def test_direct_never_sends_small_copies_to_the_copy_engines_one_by_one(layout, page, small):
    """io_backend='direct' takes the kernel at one CTA for copies under route.SMALL_COPY_BYTES where the kernel
    works (page_first's single rows, 16-token pages); a backup the pool stages stays on the copy engines."""
    device = MLADevicePool([torch.zeros((1024, 1, 576), dtype=torch.bfloat16) for _ in range(2)])
    pool = MLAHostKVPool(device, size=1024, page_size=page, layout=layout, pin_memory=False)
    pool.transfer_path = "kernel"
    assert pool._path("direct", "load", torch.zeros(1024, dtype=torch.int64)) == ("kernel-small" if small else "direct")
    pool.pin_memory = True  # pinned: page_first staging applies to its backups
    staged = layout != "layer_first"
    assert pool._path("direct", "backup") == ("kernel-small" if small and not staged else "direct")
    pool.transfer_path = "direct"  # no kernel here: the copy engines, whatever the size
    assert pool._path("direct", "load", torch.zeros(1024, dtype=torch.int64)) == "direct"


class _Staging:
    """A pool's staging area that takes a backup (``takes``) or declines it, as for host slots in short runs."""

    def __init__(self, takes: bool):
        self.takes, self.calls = takes, 0

    def backup(self, host_indices, device_indices):
        self.calls += 1
        return self.takes


def _backup_ran(monkeypatch, pool, io_backend, staging) -> list:
    """What one backup of ``pool`` ran: ('kernel', block_quota) or ('direct', None), with its staging area
    replaced by ``staging`` (None: no area, as with SGLANG_HICACHE_JIT_STAGING=0)."""
    from sglang_hicache_jit.transfer import host_pool as pool_module
    from sglang_hicache_jit.transfer import ops

    ran = []
    monkeypatch.setattr(pool, "_staging", lambda side: staging)
    monkeypatch.setattr(pool, "_host_layer_table", lambda: "host table")
    monkeypatch.setattr(pool_module._DeviceSide, "table", lambda side: "device table")
    monkeypatch.setattr(ops, "transfer_all_layer", lambda *args, method=None, block_quota=None:
                        ran.append(("kernel", block_quota)))
    monkeypatch.setattr(pool, "_copy_direct", lambda *args, **kwargs: ran.append(("direct", None)))
    indices = torch.arange(64, dtype=torch.int64)
    pool.backup_from_device_all_layer(pool.device_pool, indices, indices, io_backend)
    return ran


@pytest.mark.parametrize("layout, io_backend, expected", [
    ("page_first", "auto", ("kernel", None)),  # the kernel's default budget into host memory
    ("page_first_direct", "auto", ("kernel", None)),
    ("page_first", "direct", ("kernel", route.SMALL_COPY_CTAS)),  # single rows, far under SMALL_COPY_BYTES
    ("page_first_direct", "direct", ("direct", None)),  # 72 KiB per page of a layer: the copy engines keep it
])
def test_a_backup_staging_does_not_take_goes_where_its_row_copies_would_not_crawl(monkeypatch, layout, io_backend,
                                                                                    expected):
    """Where staging declines a backup (host slots in short runs, padding) or is off, its rows would leave one copy
    per row or page of a layer: 'auto' takes the kernel where it works, 'direct' the one-CTA kernel for copies
    under SMALL_COPY_BYTES (route.unstaged_backup_path); without the kernel the copy engines. A backup that
    staging takes runs nothing else."""
    device = MLADevicePool([torch.zeros((1024, 1, 576), dtype=torch.bfloat16) for _ in range(2)])
    pool = MLAHostKVPool(device, size=1024, page_size=64, layout=layout, pin_memory=False)
    pool.transfer_path = "kernel"  # as on a GPU where the probe said yes
    pool.pin_memory = True  # pinned: the pool stages these backups
    declines = _Staging(False)
    assert _backup_ran(monkeypatch, pool, io_backend, declines) == [expected] and declines.calls == 1
    assert _backup_ran(monkeypatch, pool, io_backend, None) == [expected]  # staging off
    takes = _Staging(True)
    assert _backup_ran(monkeypatch, pool, io_backend, takes) == [] and takes.calls == 1
    assert pool.last_direct_mode == "staged"
    pool.transfer_path = "direct"  # no kernel for these rows: the copy engines, row by row
    assert _backup_ran(monkeypatch, pool, io_backend, _Staging(False)) == [("direct", None)]
    pool.transfer_path = "kernel"
    pool.direct_mode = "2d"  # a pool told how to submit its copies keeps them on the copy engines
    assert _backup_ran(monkeypatch, pool, "direct", _Staging(False)) == [("direct", None)]


# ---------------------------------------------------------------------------
# Allocator.

def test_allocator_pages_exhaustion_and_free():
    dp = make_device_pool("mla", 576, torch.Generator().manual_seed(1))
    pool = make_host_pool(dp, size=100, page_size=64, layout="page_first")
    assert pool.size == 128 and pool.page_num == 2 and pool.available_size() == 128
    first = pool.alloc(64)
    assert first.dtype == torch.int64 and first.device.type == "cpu" and first.tolist() == list(range(64))
    second = pool.alloc(64)
    assert pool.alloc(64) is None  # exhausted: None, as upstream, not an exception
    assert pool.available_size() == 0
    assert pool.free(first) == 64
    again = pool.alloc(64)
    assert torch.equal(again, first) and pool.alloc(64) is None
    assert pool.alloc(0).numel() == 0
    with pytest.raises(ValueError, match="multiple of the page size"):
        pool.alloc(32)
    with pytest.raises(ValueError, match="need_size"):
        pool.alloc(-64)
    with pytest.raises(ValueError, match="whole pages"):
        pool.free(second[:10])
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        pool.free(second + 128)
    with pytest.raises(TypeError, match="indices"):
        pool.free(second.tolist())
    pool.clear()
    assert pool.available_size() == 128


# ---------------------------------------------------------------------------
# Bad arguments.

@pytest.fixture(scope="module")
def small_pools():
    gen = torch.Generator().manual_seed(2)
    dp = make_device_pool("mla", 1152, gen)
    return dp, make_host_pool(dp, page_size=16, layout="page_first")


def test_constructor_rejects_bad_arguments():
    gen = torch.Generator().manual_seed(3)
    dp = make_device_pool("mla", 1152, gen)
    with pytest.raises(ValueError, match="Unsupported layout: 'page_head'"):
        MLAHostKVPool(dp, size=64, page_size=16, layout="page_head")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="size"):
            MLAHostKVPool(dp, size=bad, page_size=16, layout="page_first")
        with pytest.raises(ValueError, match="page_size"):
            MLAHostKVPool(dp, size=64, page_size=bad, layout="page_first")
    mha = make_device_pool("mha", 1152, gen)
    with pytest.raises(TypeError, match="kv_buffer"):
        MLAHostKVPool(mha, size=64, page_size=16, layout="page_first")
    with pytest.raises(TypeError, match="k_buffer and v_buffer"):
        MHAHostKVPool(dp, size=64, page_size=16, layout="page_first")
    with pytest.raises(ValueError, match="K layers"):
        MHAHostKVPool(MHADevicePool(mha.k_buffer, mha.v_buffer[:-1]), size=64, page_size=16, layout="page_first")
    for owned in ((2, 2), (3, 1), (0, LAYERS + 1), (-1, 2), "ab", (1, 2, 3)):
        with pytest.raises(ValueError, match="owned_layers"):
            MLAHostKVPool(MLADevicePool(dp.kv_buffer, owned), size=64, page_size=16, layout="page_first")
    mixed = MLADevicePool(dp.kv_buffer[:2] + [dp.kv_buffer[2].float()] + dp.kv_buffer[3:])
    with pytest.raises(ValueError, match="share dtype"):
        MLAHostKVPool(mixed, size=64, page_size=16, layout="page_first")
    # layers outside the owned range are never touched, so they may be anything
    sharded = MLADevicePool([None] + dp.kv_buffer[1:3] + [None], owned_layers=(1, 3))
    assert MLAHostKVPool(sharded, size=64, page_size=16, layout="page_first").layer_num == 2


def test_transfers_reject_bad_arguments(small_pools):
    dp, pool = small_pools
    idx = torch.arange(16)
    with pytest.raises(ValueError, match="Unsupported IO backend: 'kernel_ascend'"):
        pool.backup_from_device_all_layer(dp, idx, idx, "kernel_ascend")
    with pytest.raises(ValueError, match="Unsupported IO backend"):
        pool.load_to_device_per_layer(dp, idx, idx, 0, None)
    with pytest.raises(ValueError, match="same length"):
        pool.backup_from_device_all_layer(dp, idx, idx[:8], "direct")
    with pytest.raises(TypeError, match="host_indices must be int32 or int64"):
        pool.load_to_device_per_layer(dp, idx.float(), idx, 0, "kernel")
    with pytest.raises(TypeError, match="device_indices must be a torch.Tensor"):
        pool.load_to_device_per_layer(dp, idx, idx.tolist(), 0, "kernel")
    with pytest.raises(ValueError, match="1-D"):
        pool.backup_from_device_all_layer(dp, idx.view(4, 4), idx.view(4, 4), "direct")
    with pytest.raises(ValueError, match="layer_id 4 is out of range"):
        pool.load_to_device_per_layer(dp, idx, idx, LAYERS, "direct")
    with pytest.raises(TypeError, match="layer_id"):
        pool.load_to_device_per_layer(dp, idx, idx, 1.0, "direct")
    with pytest.raises(TransferIndexError, match="host_indices holds index"):
        pool.backup_from_device_all_layer(dp, idx + pool.size, idx, "direct")
    with pytest.raises(TransferIndexError, match="indices_src holds index 399"):
        pool.backup_from_device_all_layer(dp, idx, idx + DEVICE_SLOTS, "direct")
    with pytest.raises(TransferIndexError, match="indices_dst holds index 399"):
        pool.load_to_device_per_layer(dp, idx, idx + DEVICE_SLOTS, 1, "kernel")


def test_transfers_reject_mismatched_device_pools(small_pools):
    dp, pool = small_pools
    gen = torch.Generator().manual_seed(4)
    idx = torch.arange(16)
    cases = {
        "rows of": make_device_pool("mla", 576, gen),                       # other row size / dtype
        "layers owning": MLADevicePool(dp.kv_buffer[:3]),                   # other layer count
        "owning": MLADevicePool(dp.kv_buffer, owned_layers=(0, 2)),         # other shard
    }
    for message, other in cases.items():
        with pytest.raises(ValueError, match=message):
            pool.backup_from_device_all_layer(other, idx, idx, "direct")
    with pytest.raises(TypeError, match="kv_buffer"):
        pool.load_to_device_per_layer(make_device_pool("mha", 1152, gen), idx, idx, 0, "direct")
    # a second device pool of the same shape is fine (loads into a fresh pool)
    twin = MLADevicePool([torch.zeros_like(t) for t in dp.kv_buffer])
    pool.load_to_device_per_layer(twin, idx, idx, 2, "direct")


# ---------------------------------------------------------------------------
# Storage page API.

UPSTREAM_PAGE_SHAPES = {  # (kind, layout) -> page shape with L layers, P tokens per page, row (a, b)
    ("mla", "layer_first"): lambda L, P, a, b: (L, P, a, b),
    ("mla", "page_first"): lambda L, P, a, b: (P, L, a, b),
    ("mla", "page_first_direct"): lambda L, P, a, b: (1, L, P, a, b),
    ("mha", "layer_first"): lambda L, P, a, b: (2, L, P, a, b),
    ("mha", "page_first"): lambda L, P, a, b: (2, P, L, a, b),
    ("mha", "page_first_direct"): lambda L, P, a, b: (2, 1, L, P, a, b),
}


@pytest.mark.parametrize("kind", ["mla", "mha"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_data_pages(kind, layout):
    gen = torch.Generator().manual_seed(6)
    dp = make_device_pool(kind, 1152, gen)
    pool = make_host_pool(dp, page_size=16, layout=layout)
    for buf in host_caches(pool):
        fill_random(buf, gen)
    _, (a, b) = ROW_SPECS[(kind, 1152)]
    shape = UPSTREAM_PAGE_SHAPES[(kind, layout)](LAYERS, 16, a, b)
    page = pool.get_data_page(32, flat=False)
    assert tuple(page.shape) == shape
    flat = pool.get_data_page(torch.tensor(32))  # the controller passes a 0-d index tensor
    assert flat.dim() == 1 and torch.equal(as_bytes(flat), as_bytes(page.reshape(-1)))
    # token 35 of layer 2 sits where the layout says, inside the page
    row = get_host_rows(as_bytes(host_caches(pool)[-1]), layout, 16, 2, torch.tensor([35]))
    view = page[1] if kind == "mha" else page
    local = {"layer_first": lambda v: v[2, 3], "page_first": lambda v: v[3, 2],
             "page_first_direct": lambda v: v[0, 2, 3]}[layout](view)
    assert torch.equal(as_bytes(local.contiguous()).reshape(-1), row.reshape(-1))

    dummy = pool.get_dummy_flat_data_page()
    assert dummy.numel() == flat.numel() and dummy.dtype == pool.dtype and not dummy.view(torch.uint8).any()
    assert not torch.equal(as_bytes(pool.get_data_page(64)), as_bytes(flat))
    pool.set_from_flat_data_page(64, flat)
    assert torch.equal(as_bytes(pool.get_data_page(64)), as_bytes(flat))

    for bad in (8, -16, pool.size, 1 << 20):
        with pytest.raises(ValueError, match="first token slot of a page"):
            pool.get_data_page(bad)
    with pytest.raises(TypeError, match="index"):
        pool.get_data_page(16.0)
    with pytest.raises(ValueError, match="elements"):
        pool.set_from_flat_data_page(16, flat[:-1])
    with pytest.raises(ValueError, match="dtype"):
        pool.set_from_flat_data_page(16, flat.view(torch.uint8)[: flat.numel()])


def test_pages_outside_the_written_page_stay_untouched():
    gen = torch.Generator().manual_seed(7)
    dp = make_device_pool("mla", 656, gen)
    pool = make_host_pool(dp, page_size=16, layout="layer_first")
    fill_random(pool.kv_buffer, gen)
    before = pool.kv_buffer.clone()
    new = torch.randint(0, 256, (pool.get_data_page(0).numel(),), dtype=torch.uint8, generator=gen)
    pool.set_from_flat_data_page(48, new)
    diff = (pool.kv_buffer != before).any(dim=-1).any(dim=-1)  # (layers, slots)
    assert diff[:, 48:64].any() and not diff[:, :48].any() and not diff[:, 64:].any()


def test_storage_round_trip_through_pages():
    """Backup, copy pages to a second pool as an L3 backend would, load from it."""
    gen = torch.Generator().manual_seed(8)
    dp = make_device_pool("mha", 576, gen)
    src = make_host_pool(dp, page_size=16, layout="page_first")
    dst = make_host_pool(dp, page_size=16, layout="page_first")
    idx = torch.arange(64, 128)
    src.backup_from_device_all_layer(dp, idx, idx, "direct")
    for page in range(64, 128, 16):
        dst.set_from_flat_data_page(page + 128, src.get_data_page(page))
    fresh = MHADevicePool([torch.zeros_like(t) for t in dp.k_buffer], [torch.zeros_like(t) for t in dp.v_buffer])
    for layer in range(LAYERS):
        dst.load_to_device_per_layer(fresh, idx + 128, idx, layer, "direct")
        assert torch.equal(as_bytes(fresh.k_buffer[layer][64:128]), as_bytes(dp.k_buffer[layer][64:128]))
        assert torch.equal(as_bytes(fresh.v_buffer[layer][64:128]), as_bytes(dp.v_buffer[layer][64:128]))


def test_pinning_is_skipped_without_a_gpu_side():
    pool = make_host_pool(make_device_pool("mla", 576, torch.Generator().manual_seed(9)), page_size=16,
                          layout="page_first", pin_memory=True)
    assert pool.pin_memory is False and pool.kv_buffer.device.type == "cpu"


# ---------------------------------------------------------------------------
# direct.py: runs, descriptors, struct layout.

def naive_runs(dst, src):
    pairs = [(d, s) for d, s in zip(dst, src) if d >= 0 and s >= 0]
    runs = []
    for d, s in pairs:
        if runs and runs[-1][0] + runs[-1][2] == d and runs[-1][1] + runs[-1][2] == s:
            runs[-1][2] += 1
        else:
            runs.append([d, s, 1])
    return [tuple(r) for r in runs]


index_lists = st.lists(st.tuples(st.integers(-2, 40), st.integers(-2, 40)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(index_lists, st.sampled_from([torch.int32, torch.int64]))
def test_find_runs_matches_a_naive_scan(pairs, dtype):
    dst = torch.tensor([p[0] for p in pairs], dtype=dtype)
    src = torch.tensor([p[1] for p in pairs], dtype=dtype)
    assert direct.find_runs(dst, src).as_tuples() == naive_runs(dst.tolist(), src.tolist())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=20, unique=True), st.integers(1, 4),
       st.lists(st.integers(0, 30), min_size=1, max_size=20, unique=True))
def test_find_runs_of_pages_are_one_run_per_contiguous_stretch(page_ids, page, other):
    host = (torch.tensor(sorted(page_ids))[:, None] * page + torch.arange(page)).reshape(-1)
    dev = host.clone()
    runs = direct.find_runs(dev, host)
    stretches = 1 + sum(1 for a, b in zip(sorted(page_ids), sorted(page_ids)[1:]) if b != a + 1)
    assert len(runs) == stretches and int(runs.length.sum()) == host.numel()


@settings(max_examples=200, deadline=None)
@given(index_lists, st.integers(1, 7))
def test_split_runs_keeps_every_copy_and_caps_the_length(pairs, max_rows):
    dst = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
    src = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
    runs = direct.find_runs(dst, src)
    split = direct.split_runs(runs, max_rows)

    def rows(r):
        return sorted((d + i, s + i) for d, s, n in r.as_tuples() for i in range(n))

    assert rows(split) == rows(runs)
    assert all(0 < n <= max_rows for _, _, n in split.as_tuples())
    assert len(split) == sum(-(-n // max_rows) for _, _, n in runs.as_tuples())


def test_find_runs_rejects_bad_indices():
    with pytest.raises(ValueError, match="same length"):
        direct.find_runs(torch.arange(3), torch.arange(4))
    with pytest.raises(TypeError, match="int32 or int64"):
        direct.find_runs(torch.arange(3.0), torch.arange(3))
    with pytest.raises(TypeError, match="torch.Tensor"):
        direct.find_runs([0, 1], torch.arange(2))
    assert len(direct.find_runs(torch.tensor([-1, 3]), torch.tensor([2, -5]))) == 0


def execute_descriptors(words):
    """Runs copy descriptors on host memory with memmove, row by row: an executable
    model of what cudaMemcpy3DBatchAsync is asked to do."""
    col = {k: v // 8 for k, v in cuda.DESCRIPTOR_OFFSETS.items()}
    for w in words.tolist():
        assert w[col["extent.depth"]] == 1 and w[col["src.type"]] == 1 and w[col["dst.type"]] == 1
        assert w[col["srcAccessOrder"]] == 1  # stream order, flags 0 in the high half
        width, height = w[col["extent.width"]], w[col["extent.height"]]
        assert w[col["src.rowLength"]] >= width and w[col["dst.rowLength"]] >= width
        for y in range(height):
            ctypes.memmove(w[col["dst.ptr"]] + y * w[col["dst.rowLength"]],
                           w[col["src.ptr"]] + y * w[col["src.rowLength"]], width)


@pytest.mark.parametrize("seed", range(12))
def test_descriptors_copy_exactly_the_addressed_rows(seed):
    gen = torch.Generator().manual_seed(seed)
    row = int(torch.randint(1, 40, (1,), generator=gen)) * 4
    layers = int(torch.randint(1, 4, (1,), generator=gen))
    host = torch.randint(0, 256, (64, layers, row), dtype=torch.uint8, generator=gen)   # page_first-like
    dev = [torch.randint(0, 256, (48, row), dtype=torch.uint8, generator=gen) for _ in range(layers)]
    n = int(torch.randint(1, 40, (1,), generator=gen))
    src = torch.randperm(48, generator=gen)[:n]
    src[: n // 2] = src[: n // 2].sort().values  # some runs, some scattered
    dst = torch.randperm(64, generator=gen)[:n].sort().values
    dst[0] = -1 if seed % 3 == 0 else dst[0]
    pairs = direct.Pairs([(host[:, l], dev[l]) for l in range(layers)])
    expected = host.clone()
    keep = (dst >= 0) & (src >= 0)
    for l in range(layers):
        expected[dst[keep], l] = dev[l][src[keep]]
    runs = direct.find_runs(dst, src)
    words = direct.describe_copies(pairs, runs)
    assert words.shape == (layers * len(runs), cuda.DESCRIPTOR_BYTES // 8)
    execute_descriptors(words)
    assert torch.equal(host, expected)
    # packed pairs (both sides contiguous rows) become one block per run
    a, b = torch.zeros(64, row, dtype=torch.uint8), torch.randint(0, 256, (48, row), dtype=torch.uint8, generator=gen)
    packed = direct.describe_copies(direct.Pairs([(a, b)]), runs)
    assert (packed[:, cuda.DESCRIPTOR_OFFSETS["extent.height"] // 8] == 1).all()
    execute_descriptors(packed)
    reference = torch.zeros(64, row, dtype=torch.uint8)
    reference[dst[keep]] = b[src[keep]]
    assert torch.equal(a, reference)


def test_copy_rows_on_cpu_checks_pairs_and_bounds():
    a, b = torch.zeros(8, 4, dtype=torch.int32), torch.arange(32, dtype=torch.int32).view(8, 4)
    assert direct.copy_rows([(a, b)], torch.tensor([7, 0]), torch.tensor([1, 2])) == "torch"
    assert a[7].tolist() == [4, 5, 6, 7] and a[0].tolist() == [8, 9, 10, 11] and not a[1:7].any()
    with pytest.raises(TransferIndexError, match="indices_dst holds index 8"):
        direct.copy_rows([(a, b)], torch.tensor([8]), torch.tensor([0]))
    with pytest.raises(ValueError, match="must match"):
        direct.copy_rows([(a, b.float())], torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="contiguous rows"):
        direct.Rows(torch.zeros(8, 4)[:, ::2])
    with pytest.raises(ValueError, match="overlapping"):
        direct.Rows(torch.zeros(8, 4).as_strided((8, 4), (2, 1)))
    with pytest.raises(ValueError, match="mode"):
        direct.copy_rows([(a, b)], torch.tensor([0]), torch.tensor([0]), mode="fast")
    with pytest.raises(ValueError, match="at least one"):
        direct.Pairs([])


STRUCT_PROGRAM = r"""
#include <stdio.h>
#include <stddef.h>
#include <cuda_runtime_api.h>
#define F(name, expr) printf("%s %zu\n", name, (size_t)(expr));
int main(void) {
  typedef struct cudaMemcpy3DBatchOp Op;
  F("size", sizeof(Op))
  F("src.type", offsetof(Op, src.type))
  F("src.ptr", offsetof(Op, src.op.ptr.ptr))
  F("src.rowLength", offsetof(Op, src.op.ptr.rowLength))
  F("src.layerHeight", offsetof(Op, src.op.ptr.layerHeight))
  F("dst.type", offsetof(Op, dst.type))
  F("dst.ptr", offsetof(Op, dst.op.ptr.ptr))
  F("dst.rowLength", offsetof(Op, dst.op.ptr.rowLength))
  F("dst.layerHeight", offsetof(Op, dst.op.ptr.layerHeight))
  F("extent.width", offsetof(Op, extent.width))
  F("extent.height", offsetof(Op, extent.height))
  F("extent.depth", offsetof(Op, extent.depth))
  F("srcAccessOrder", offsetof(Op, srcAccessOrder))
  F("flags", offsetof(Op, flags))
  F("cudaMemcpyDefault", cudaMemcpyDefault)
  F("cudaMemcpySrcAccessOrderStream", cudaMemcpySrcAccessOrderStream)
  F("cudaMemcpyOperandTypePointer", cudaMemcpyOperandTypePointer)
  return 0;
}
"""


def _cuda_include():
    from sglang_hicache_jit.buildcache.toolchain import find_toolkit

    toolkit = find_toolkit()
    include = toolkit.home / "include" if toolkit else None
    if include is None or not (include / "driver_types.h").exists():
        return None
    text = (include / "driver_types.h").read_text(errors="replace")
    return include if "cudaMemcpy3DBatchOp" in text else None


def test_batch_descriptor_matches_the_cuda_header(tmp_path):
    include, compiler = _cuda_include(), shutil.which("gcc") or shutil.which("cc")
    if include is None or compiler is None:
        pytest.skip("needs a C compiler and CUDA 12.8+ headers")
    source = tmp_path / "layout.c"
    source.write_text(STRUCT_PROGRAM)
    binary = tmp_path / "layout"
    subprocess.run([compiler, "-I", str(include), str(source), "-o", str(binary)], check=True, capture_output=True)
    facts = dict(line.split() for line in subprocess.run([str(binary)], capture_output=True, text=True,
                                                        check=True).stdout.splitlines())
    facts = {k: int(v) for k, v in facts.items()}
    assert facts.pop("size") == cuda.DESCRIPTOR_BYTES == 112
    assert facts.pop("cudaMemcpyDefault") == cuda.CUDA_MEMCPY_DEFAULT
    assert facts.pop("cudaMemcpySrcAccessOrderStream") == cuda.SRC_ACCESS_ORDER_STREAM
    assert facts.pop("cudaMemcpyOperandTypePointer") == cuda.OPERAND_TYPE_POINTER
    assert facts == cuda.DESCRIPTOR_OFFSETS


# ---------------------------------------------------------------------------
# The demo, CPU edition.

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU demo (the GPU tests run the GPU one)")
def test_demo_runs_on_cpu_and_verifies():
    out = subprocess.run([sys.executable, "-m", "sglang_hicache_jit", "demo", "--tokens", "1024", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["device"] == "cpu" and report["chosen_path"] == "direct"
    assert report["results"] and all(r["bit_exact"] for r in report["results"])
    assert "no GPU" in report["note"] and report["schema"] == 1 and report["rates_meaningful"] is False
    assert "WARNING" not in out.stderr.upper(), out.stderr  # the first thing a new user runs is quiet


def test_allocator_refuses_double_and_foreign_frees():
    """Measured before the fix: after double frees available_size() was 44 on a
    pool of 32 and alloc handed out 12 slots twice."""
    dp = make_device_pool("mla", 576, torch.Generator().manual_seed(4))
    pool = make_host_pool(dp, size=32, page_size=4, layout="page_first")
    first, second = pool.alloc(8), pool.alloc(8)
    assert pool.free(first) == 8
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(first)  # the same slots again
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(torch.arange(28, 32))  # never handed out
    with pytest.raises(ValueError, match="more than once"):
        pool.free(torch.cat([second[:4], second[:4]]))
    assert pool.available_size() == 32 - 8  # the refused frees changed nothing
    handed = [pool.alloc(4) for _ in range(pool.available_size() // 4)]
    assert pool.alloc(4) is None
    every = torch.cat(handed + [second])
    assert torch.unique(every).numel() == every.numel() == 32  # no slot handed out twice
    for chunk in handed:
        pool.free(chunk)
    pool.free(second)
    assert pool.available_size() == 32


def test_allocator_reuses_freed_slots_in_order():
    from sglang_hicache_jit.transfer.slot_allocator import SlotAllocator

    alloc = SlotAllocator(16, 2)
    a, b = alloc.alloc(4), alloc.alloc(4)
    alloc.free(b)
    alloc.free(a)
    assert alloc.alloc(8).tolist() == list(range(8, 16))  # never-used slots first
    assert alloc.alloc(8).tolist() == b.tolist() + a.tolist()  # then freed ones, in the order freed
    assert alloc.alloc(2) is None


@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_resident_backend_without_the_kernel_takes_the_direct_path(kind):
    """io_backend='resident' asks for the kernel's resident method; where the kernel is not the
    pool's path (here: no GPU) it runs the direct path, like 'kernel' does."""
    pool = round_trip(kind, "page_first", 16, 576, False, "resident", seed=11)
    assert pool._path("resident", "load") == "direct"


# ---------------------------------------------------------------------------
# Issue 18: D3 (a free that breaks a page), T8-T10 (inputs that raised from inside torch or Python).

def test_d3_a_free_must_be_whole_pages_so_no_slot_gets_two_owners():
    dp = make_device_pool("mla", 656, torch.Generator().manual_seed(5))
    pool = make_host_pool(dp, size=16, page_size=4, layout="page_first")
    first = pool.alloc(8)  # [0..7]: the first owner holds slots 0-7
    for broken in ([0, 1, 2, 5], [1, 0, 2, 3], [4, 5, 6, 7, 1, 2, 3, 4], [2, 3, 4, 5]):
        with pytest.raises(ValueError, match="whole pages.*nothing was freed"):
            pool.free(torch.tensor(broken))
    assert pool.available_size() == 8  # the refused frees changed nothing
    second = pool.alloc(8)
    assert sorted(second.tolist()) == list(range(8, 16))  # never a slot the first owner still holds
    owned = [pool.get_data_page(p).clone() for p in (0, 4)]
    for start in (int(second[0]), int(second[4])):  # the new owner writes its whole pages
        pool.set_from_flat_data_page(start, pool.get_dummy_flat_data_page() + 1)
    assert all(torch.equal(pool.get_data_page(p), page) for p, page in zip((0, 4), owned))
    assert pool.free(first) == 8 and pool.free(second) == 8 and pool.available_size() == 16
    assert pool.free(torch.tensor([], dtype=torch.int64)) == 0


@pytest.mark.parametrize("size,page_size,match", [
    (10, 0, "page_size must be an int of at least 1"),  # alloc() raised ZeroDivisionError
    (-1, 1, "size must be an int of at least 0"),  # RuntimeError from torch.zeros(-1)
    (10, -1, "page_size must be an int of at least 1"),  # accepted
    (10, 3, r"size \(10\) must be a multiple of page_size \(3\)"),
    (True, 1, "size must be an int"), (10.0, 1, "size must be an int"), (10, None, "page_size must be an int")])
def test_t8_slot_allocator_validates_its_construction(size, page_size, match):
    from sglang_hicache_jit.transfer.slot_allocator import SlotAllocator

    with pytest.raises(ValueError, match=match):
        SlotAllocator(size, page_size)


def test_t8_a_valid_slot_allocator_still_works():
    from sglang_hicache_jit.transfer.slot_allocator import SlotAllocator

    assert SlotAllocator(0, 4).alloc(0).numel() == 0 and SlotAllocator(0, 4).alloc(4) is None
    alloc = SlotAllocator(12, 4)
    assert alloc.alloc(12).tolist() == list(range(12))


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


@pytest.mark.parametrize("kind", ["meta", "sparse", "sparse_csr"])
def test_t9_meta_and_sparse_tensors_are_refused_naming_the_argument(kind):
    dp = make_device_pool("mla", 656, torch.Generator().manual_seed(6))
    pool = make_host_pool(dp, size=16, page_size=4, layout="page_first")
    held = pool.alloc(8)
    convert = {"meta": _meta, "sparse": lambda t: t.to_sparse(),
               "sparse_csr": lambda t: t.reshape(1, -1).to_sparse_csr()}[kind]
    error, what = (ValueError, "must be on the CPU or a GPU, got a meta tensor") if kind == "meta" else \
        (TypeError, "must be a dense \\(strided\\) tensor")
    with pytest.raises(error, match=f"indices {what}"):
        pool.free(convert(held))
    with pytest.raises(error, match=f"data_page {what}"):
        pool.set_from_flat_data_page(0, convert(pool.get_dummy_flat_data_page()))
    for name, args in (("host_indices", (convert(held), held)), ("device_indices", (held, convert(held)))):
        with pytest.raises(error, match=f"{name} {what}"):
            pool.backup_from_device_all_layer(dp, *args, "direct")
        with pytest.raises(error, match=f"{name} {what}"):
            pool.load_to_device_per_layer(dp, *args, 0, "direct")
    if kind == "meta":
        meta_pool = MLADevicePool([_meta(t) for t in dp.kv_buffer])
        with pytest.raises(error, match=f"device_pool layer 0 {what}"):
            MLAHostKVPool(meta_pool, size=16, page_size=4, layout="page_first")
        with pytest.raises(error, match=f"device_pool layer 0 {what}"):
            pool.backup_from_device_all_layer(meta_pool, held, held, "direct")
    assert pool.available_size() == 8 and pool.free(held) == 8


@pytest.mark.parametrize("size,page_size,match", [(4, 2 ** 40, "page_size .* must not exceed size"),
                                                  (2 ** 62, 1, "size .* is too large"),
                                                  (2 ** 62, 2 ** 20, "size .* is too large")])
def test_t10_a_pool_that_cannot_exist_is_refused_before_allocating(size, page_size, match):
    dp = make_device_pool("mla", 576, torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match=match):
        MLAHostKVPool(dp, size=size, page_size=page_size, layout="page_first")


def test_t10_a_size_between_pages_is_still_rounded_up():
    dp = make_device_pool("mla", 576, torch.Generator().manual_seed(8))
    assert make_host_pool(dp, size=10, page_size=4, layout="page_first").size == 12
    assert make_host_pool(dp, size=4, page_size=4, layout="page_first").size == 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), max_size=12, unique_by=lambda p: p[0]),
       st.integers(2, 4))
def test_page_runs_match_find_runs_on_the_pages_rows(pages, page):
    """Planning one entry per page gives the runs planning one entry per row gives."""
    dst = torch.tensor([d for d, _ in pages], dtype=torch.int64) * page
    src = torch.tensor([s for _, s in pages], dtype=torch.int64) * page
    rows = lambda starts: (starts[:, None] + torch.arange(page)).reshape(-1)  # noqa: E731
    assert direct.page_runs(dst, src, page).as_tuples() == direct.find_runs(rows(dst), rows(src)).as_tuples()


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(-6, 40), max_size=8), st.integers(1, 4), st.booleans(),
       st.sampled_from(["none", "bump", "drop"]), st.integers(0, 40))
def test_whole_pages_says_yes_only_for_whole_pages(starts, page, aligned, damage, where):
    indices = [s + i for s in starts for i in range(page)]  # pages from any start: aligned or not, negative
    if indices and damage == "bump":
        indices[where % len(indices)] += 1
    elif indices and damage == "drop":
        del indices[where % len(indices)]
    groups = [indices[i:i + page] for i in range(0, len(indices), page)]
    whole = (page > 1 and len(indices) > 0 and len(indices) % page == 0
             and all(g[0] >= 0 and g == list(range(g[0], g[0] + page)) and (not aligned or g[0] % page == 0)
                     for g in groups))
    found = direct.whole_pages(torch.tensor(indices, dtype=torch.int64), page, aligned=aligned)
    assert (found is not None) == whole
    if whole:
        assert found.tolist() == [g[0] for g in groups]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_whole_pages_are_planned_per_page(layout, monkeypatch):
    """No padding: every transfer is planned one entry per page (find_runs, one entry per row, never runs)."""
    def per_row(*args):
        raise AssertionError("planned per row")

    monkeypatch.setattr(direct, "row_runs", per_row)
    round_trip("mla", layout, 16, 1152, False, "direct", seed=3, rounds=1)
    with pytest.raises(AssertionError, match="per row"):  # padding falls back to per-row planning
        round_trip("mla", layout, 16, 1152, False, "direct", seed=3, rounds=2)
