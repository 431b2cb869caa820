"""Host KV pools on a real GPU (marked ``gpu``): the CPU matrix through both paths.

The round trips are the CPU file's (random bytes on both sides, whole-buffer
bit-exact comparisons after every backup and load), with CUDA device pools
and pinned host pools. The kernel path must be the one the pool picks here
(the probe has to say the kernel works on this GPU); the direct path must go
out as one batched copy call where the CUDA runtime has it.
"""

import json
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from sglang_hicache_jit import host_pool, ops
from sglang_hicache_jit.transfer import cuda, direct, route
from sglang_hicache_jit.probe import ProbeResult, probe

from test_host_pool import (LAYOUTS, PAGE_SIZES, ROW_BYTES, as_bytes, make_device_pool, make_host_pool,
                            round_trip)

pytestmark = pytest.mark.gpu


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


@pytest.fixture(scope="module", autouse=True)
def kernel_must_work():
    result = probe(1152)
    assert result.available, f"the probe says the kernel is unavailable: [{result.code}] {result.reason} {result.fix}"


def _expect(direct_mode=None):
    """A round-trip ``configure`` hook: the pool is pinned and chose the kernel (then,
    optionally, force the direct path's submission mode)."""
    def configure(pool):
        assert pool.kv_buffer.is_pinned(), "the host pool must be pinned (cudaHostRegister)"
        assert pool.transfer_path == "kernel", pool.transfer_path_reason
        if direct_mode:
            pool.direct_mode = direct_mode
    return configure


@pytest.mark.parametrize("row_bytes", ROW_BYTES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("sharded", [False, True], ids=["all-layers", "sharded"])
@pytest.mark.parametrize("kind", ["mla", "mha"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_matrix_on_gpu(layout, io_backend, kind, sharded, page_size, row_bytes):
    """``direct`` here is the copy engines themselves (their batched submission named, so copies under
    route.SMALL_COPY_BYTES do not take the one-CTA kernel; test_direct_small_copies_take_a_one_cta_kernel)."""
    mode = "batch" if io_backend == "direct" and direct.batch_status()[0] else None
    pool = round_trip(kind, layout, page_size, row_bytes, sharded, io_backend, device="cuda",
                      seed=_seed(layout, io_backend, kind, sharded, page_size, row_bytes), configure=_expect(mode))
    ops.check_errors()
    if io_backend == "direct":
        expected = "batch" if direct.batch_status()[0] else "2d"
        assert pool.last_direct_mode == expected, direct.batch_status()[1]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["mla", "mha"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_direct_small_copies_take_a_one_cta_kernel(layout, kind, page_size):
    """io_backend='direct' with the submission left to 'auto': copies under route.SMALL_COPY_BYTES (one row of
    page_first, pages of 1 or 16 tokens) run on the kernel with one CTA, bit for bit (round_trip checks every
    row), and say so (last_direct_mode None: no copy-engine submission ran)."""
    pool = round_trip(kind, layout, page_size, 1152, False, "direct", device="cuda",
                      seed=_seed("small", layout, kind, page_size), configure=_expect())
    ops.check_errors()
    assert pool._path("direct", "load", torch.zeros(4, dtype=torch.int64)) == "kernel-small"


@pytest.mark.parametrize("sharded", [False, True], ids=["all-layers", "sharded"])
@pytest.mark.parametrize("kind", ["mla", "mha"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_direct_path_one_2d_copy_per_run(layout, kind, sharded):
    pool = round_trip(kind, layout, 16, 656, sharded, "direct", device="cuda", seed=_seed(layout, kind, sharded),
                      configure=_expect(direct_mode="2d"))
    assert pool.last_direct_mode == "2d"


@pytest.mark.parametrize("io_backend", ["kernel", "direct", "auto", "resident"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_index_tensors(layout, io_backend):
    round_trip("mla", layout, 64, 1152, True, io_backend, device="cuda", index_device="cuda",
               seed=_seed(layout, io_backend), configure=_expect())
    ops.check_errors()


@pytest.mark.parametrize("io_backend", ["kernel", "direct", "resident"])
def test_on_a_side_stream(io_backend):
    """HiCache runs transfers on its own streams; both paths must use the current one."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        round_trip("mha", "page_first", 64, 1152, False, io_backend, device="cuda", seed=_seed("stream", io_backend),
                   configure=_expect())
    torch.cuda.synchronize()


@pytest.mark.parametrize("kind", ["mla", "mha"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_backup_with_the_kernel_unavailable(monkeypatch, kind, layout):
    """The upstream failure ('Layer-sharded MLA HiCache backup with page_first layout requires
    the JIT one-layer kernel.') becomes the direct path, on a real GPU."""
    monkeypatch.setattr(route, "probe", lambda element_size, *, device=None: ProbeResult(
        False, "build_failed", "pretend the build failed.", "see the log"))

    def configure(pool):
        assert pool.transfer_path == "direct" and "[build_failed]" in pool.transfer_path_reason

    pool = round_trip(kind, layout, 64, 1152, True, "kernel", device="cuda", seed=_seed("nokernel", kind, layout),
                      configure=configure)
    assert pool.last_direct_mode in ("batch", "2d")


def test_unpinned_host_pool_uses_the_direct_path():
    gen = torch.Generator().manual_seed(1)
    dp = make_device_pool("mla", 1152, gen, device="cuda")
    pool = make_host_pool(dp, page_size=64, layout="page_first", pin_memory=False)
    assert pool.transfer_path == "direct" and "not pinned" in pool.transfer_path_reason
    assert not pool.kv_buffer.is_pinned()
    idx = torch.arange(64, 192)
    pool.backup_from_device_all_layer(dp, idx, idx, "kernel")
    torch.cuda.synchronize()
    for layer in range(len(dp.kv_buffer)):
        assert torch.equal(as_bytes(pool.kv_buffer[64:192, layer]), as_bytes(dp.kv_buffer[layer][64:192]).cpu())


def test_pools_release_their_pinned_memory(monkeypatch):
    """cudaHostRegister'd buffers are unregistered once the pool and its views are gone."""
    import gc

    runtime = cuda.cuda_runtime()
    released = []
    real = runtime.host_unregister
    monkeypatch.setattr(runtime, "host_unregister", lambda ptr: (released.append(ptr), real(ptr)))
    gen = torch.Generator().manual_seed(2)
    dp = make_device_pool("mla", 1152, gen, device="cuda", sharded=True)
    pointers = []
    for _ in range(5):
        released.clear()  # an address freed earlier is often handed out again
        pool = make_host_pool(dp, size=1 << 14, page_size=64, layout="page_first")
        pointers.append(pool.kv_buffer.data_ptr())
        page = pool.get_data_page(0, flat=False)  # a view keeps the registration alive
        pool.backup_from_device_all_layer(dp, torch.arange(64), torch.arange(64), "direct")
        torch.cuda.synchronize()
        del pool
        gc.collect()
        assert pointers[-1] not in released and page.is_pinned()
        del page
        gc.collect()
        assert pointers[-1] in released


def test_demo_on_the_gpu_checks_both_paths_quickly():
    root = Path(__file__).resolve().parent.parent
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "sglang_hicache_jit", "demo", "--json"], cwd=root,
                         capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - started
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["device"] == "cuda" and report["chosen_path"] == "kernel", report["reason"]
    assert {(r["path"], r["op"]) for r in report["results"]} == {
        ("kernel", "backup"), ("kernel", "load"), ("direct", "backup"), ("direct", "load")}
    assert all(r["bit_exact"] for r in report["results"])
    assert seconds < 60, f"the demo took {seconds:.1f} s"
    # Issue 33: it says what it does while it runs (one line per step on stderr).
    steps = [line for line in out.stderr.splitlines() if line.startswith("demo [")]
    for step in ("filling 8 layers", "building a page_first host pool", "kernel path: backing up",
                 "kernel path: loading", "direct path: backing up", "direct path: loading", "measuring the ceiling",
                 "done"):
        assert sum(step in line for line in steps) == 1, (step, out.stderr)
    print(json.dumps({r["path"] + " " + r["op"]: round(r["GBps"], 1) for r in report["results"]}))
