"""The resident method on a real GPU (marked ``gpu``; skipped without one).

Bit-exact copies through the queue, stream order against producer and
consumer kernels, graph capture, a full queue, idle exit, shutdown and error
reporting. Every check compares whole pools against plain indexing.
"""

import os
import subprocess
import sys
import time

import pytest
import torch

from sglang_hicache_jit import ops, settings
from sglang_hicache_jit.errors import TransferIndexError

pytestmark = pytest.mark.gpu

HOST_SLOTS, DEVICE_SLOTS, PAGE, LAYERS = 4096, 2048, 64, 4


@pytest.fixture(autouse=True)
def fresh_queue():
    """Each test starts without a resident kernel and leaves none behind."""
    ops.stop_resident()
    yield
    ops.stop_resident()


def _random(shape, device="cuda"):
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=device)


def _pools(row_bytes):
    host = torch.empty((HOST_SLOTS, LAYERS, row_bytes), dtype=torch.uint8, pin_memory=True)
    host.copy_(_random(host.shape))
    dev = _random((DEVICE_SLOTS, row_bytes))
    return host, dev


def _indices(pages, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    host = torch.randperm(HOST_SLOTS // PAGE, generator=gen)[:pages].sort().values
    dev = torch.randperm(DEVICE_SLOTS // PAGE, generator=gen)[:pages]
    expand = lambda p: (p[:, None] * PAGE + torch.arange(PAGE)).reshape(-1).to(dtype)  # noqa: E731
    return expand(host).cuda(), expand(dev).cuda()


@pytest.mark.parametrize("row_bytes", [1152, 576, 656, 256, 12])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_round_trip_through_the_queue(row_bytes, dtype):
    host, dev = _pools(row_bytes)
    layer = host[:, 2]
    hidx, didx = _indices(8, dtype)
    expected_dev = dev.clone()
    expected_dev[didx.long()] = layer[hidx.long().cpu()].cuda()
    used = ops.transfer_one_layer_mla(dev, didx, layer, hidx, method="resident")
    # Rows that are not a multiple of 16 bytes are launched as usual, with the same ordering.
    assert used.startswith("resident-") == (row_bytes % 16 == 0), used
    torch.cuda.synchronize()
    assert torch.equal(dev, expected_dev)

    expected_host = host.clone()
    expected_host[hidx.long().cpu(), 1] = dev[didx.long()].cpu()
    ops.transfer_one_layer_mla(host[:, 1], hidx, dev, didx, method="resident")
    torch.cuda.synchronize()
    assert torch.equal(host, expected_host)  # every other layer and slot untouched
    stats = ops.resident_stats()
    if row_bytes % 16 == 0:
        assert stats["queued"] == 2 and stats["finished"] == 2 and stats["fallbacks"] == 0, stats
    else:
        assert stats["queued"] == 0 and stats["fallbacks"] == 2, stats


def test_k_and_v_and_all_layers():
    k_host, k_dev = _pools(2048)
    v_host, v_dev = _pools(2048)
    hidx, didx = _indices(4, torch.int64, seed=3)
    ops.transfer_one_layer(k_host[:, 0], v_host[:, 0], hidx, k_dev, v_dev, didx, method="resident")
    torch.cuda.synchronize()
    assert torch.equal(k_host[hidx.cpu(), 0], k_dev[didx].cpu())
    assert torch.equal(v_host[hidx.cpu(), 0], v_dev[didx].cpu())

    host_layers = [k_host[:, l] for l in range(LAYERS)]
    dev_layers = [_random((DEVICE_SLOTS, 2048)) for _ in range(LAYERS)]
    ops.transfer_all_layer(dev_layers, didx, host_layers, hidx, method="resident")
    torch.cuda.synchronize()
    for l in range(LAYERS):
        assert torch.equal(dev_layers[l][didx].cpu(), k_host[hidx.cpu(), l])


def test_stream_order_against_producer_and_consumer():
    """A transfer starts after its stream's earlier kernels and ends before its later ones."""
    row = 1152
    host, dev = _pools(row)
    hidx, didx = _indices(16, torch.int64, seed=5)
    stream = torch.cuda.Stream()
    for value in range(1, 6):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000)  # ~1 ms: the producer is still running when the transfer is queued
            dev.fill_(value)  # producer
            ops.transfer_one_layer_mla(host[:, 0], hidx, dev, didx, method="resident")
            ops.transfer_one_layer_mla(dev, didx, host[:, 1], hidx, method="resident")
            snapshot = dev[didx].clone()  # consumer
        stream.synchronize()
        assert torch.all(host[hidx.cpu(), 0] == value)
        assert torch.equal(snapshot.cpu(), host[hidx.cpu(), 1])


def test_two_streams_interleaved():
    host, dev = _pools(576)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    expected = host.clone()
    for i in range(40):
        hidx, didx = _indices(2, torch.int32, seed=100 + i)
        with torch.cuda.stream(streams[i % 2]):
            layer = i % LAYERS
            torch.cuda._sleep(20_000 * (i % 3))
            ops.transfer_one_layer_mla(host[:, layer], hidx, dev, didx, method="resident")
        expected[hidx.long().cpu(), layer] = dev[didx.long()].cpu()
    torch.cuda.synchronize()
    assert torch.equal(host, expected)


def test_graph_capture_replays_an_ordinary_launch():
    host, dev = _pools(1152)
    hidx, didx = _indices(4, torch.int64, seed=7)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    ops.transfer_one_layer_mla(dev, didx, host[:, 0], hidx, method="resident")  # warm up outside the capture
    torch.cuda.synchronize()
    before = ops.resident_stats()["fallbacks"]
    with torch.cuda.graph(graph, stream=stream):
        used = ops.transfer_one_layer_mla(dev, didx, host[:, 0], hidx, method="resident")
    assert not used.startswith("resident-")  # captured as an ordinary kernel
    assert ops.resident_stats()["fallbacks"] == before + 1
    for _ in range(3):
        host[:, 0].copy_(_random((HOST_SLOTS, 1152), "cpu"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dev[didx].cpu(), host[hidx.cpu(), 0])


def test_full_queue_falls_back_instead_of_waiting():
    """More transfers than queue slots while the stream is blocked: no deadlock, all correct."""
    host, dev = _pools(256)
    stream = torch.cuda.Stream()
    jobs = [(i % LAYERS, *_indices(1, torch.int64, seed=200 + i)) for i in range(ops.RESIDENT_QUEUE_SLOTS + 20)]
    expected = host.clone()
    for layer, hidx, didx in jobs:  # every job writes rows of a device pool nothing changes
        expected[hidx.cpu(), layer] = dev[didx].cpu()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # ~25 ms: nothing queued can start yet
        for layer, hidx, didx in jobs:
            ops.transfer_one_layer_mla(host[:, layer], hidx, dev, didx, method="resident")
    stats = ops.resident_stats()
    assert stats["fallbacks"] >= 20
    stream.synchronize()
    assert torch.equal(host, expected)


def test_idle_exit_lets_device_synchronize_return(monkeypatch):
    monkeypatch.setenv(settings.RESIDENT_IDLE_US, "2000")
    host, dev = _pools(1152)
    hidx, didx = _indices(2, torch.int64, seed=9)
    ops.transfer_one_layer_mla(host[:, 0], hidx, dev, didx, method="resident")
    start = time.perf_counter()
    torch.cuda.synchronize()  # waits for the resident kernel's idle exit
    assert time.perf_counter() - start < 1.0
    ops.transfer_one_layer_mla(host[:, 1], hidx, dev, didx, method="resident")
    torch.cuda.synchronize()
    assert ops.resident_stats()["launches"] == 2  # relaunched after the idle exit
    assert torch.equal(host[hidx.cpu(), 1], dev[didx].cpu())


def test_out_of_range_index_is_reported_like_other_methods():
    host, dev = _pools(1152)
    hidx, didx = _indices(1, torch.int64, seed=11)
    hidx[5] = HOST_SLOTS + 3
    ops.transfer_one_layer_mla(dev, didx, host[:, 0], hidx, method="resident")
    with pytest.raises(TransferIndexError, match="indices_src"):
        ops.check_errors()


def test_bad_arguments_raise_before_anything_is_queued():
    host, dev = _pools(1152)
    hidx, didx = _indices(1, torch.int64)
    with pytest.raises(TypeError, match="indices_src"):
        ops.transfer_one_layer_mla(dev, didx, host[:, 0], hidx.float(), method="resident")
    with pytest.raises(ValueError, match="method"):
        ops.transfer_one_layer_mla(dev, didx, host[:, 0], hidx, method="residential")
    assert ops.resident_stats() is None  # nothing started


def test_process_exits_cleanly_with_the_kernel_running():
    code = (
        "import torch; from sglang_hicache_jit import ops\n"
        "h = torch.randint(0, 256, (256, 64), dtype=torch.uint8).pin_memory(); d = torch.zeros(256, 64, "
        "dtype=torch.uint8, device='cuda')\n"
        "i = torch.arange(256, device='cuda')\n"
        "ops.transfer_one_layer_mla(d, i, h, i, method='resident')\n"
        "torch.cuda.current_stream().synchronize()\n"
        "assert torch.equal(d.cpu(), h)\n"
        "print('ok', flush=True)\n"
    )
    env = dict(os.environ, SGLANG_HICACHE_JIT_RESIDENT_IDLE_US="60000000")  # only the exit handler can stop it
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"
    assert time.perf_counter() - start < 60
