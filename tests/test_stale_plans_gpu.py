"""Copy-engine plans that cannot go stale, on a real GPU (marked ``gpu``): the cases of test_stale_plans.py that
need CUDA index tensors or CUDA graphs. Every check compares whole device tensors, so a row written from a
stale plan, or to a row nobody named, fails the test."""

import pytest
import torch

from sglang_hicache_jit.integrations.sglang import ops as routed

from test_host_pool import (LAYOUTS, as_bytes, device_caches, fill_random, get_host_rows, host_caches,
                            make_device_pool, make_host_pool, set_host_rows)

pytestmark = pytest.mark.gpu

PAGE = 4


def _pool(kind, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    dp = make_device_pool(kind, 1152, gen, device="cuda")
    pool = make_host_pool(dp, page_size=PAGE, layout=layout)
    for buf in host_caches(pool):
        fill_random(buf, gen)
    return gen, dp, pool


def _expect_load(dp, pool, layer, host_idx, dev_idx):
    host_idx, dev_idx = host_idx.cpu().long(), dev_idx.cpu().long()
    out = []
    for c, layers in enumerate(device_caches(dp)):
        want = as_bytes(layers[layer]).cpu().clone()
        want[dev_idx] = get_host_rows(as_bytes(host_caches(pool)[c]), pool.layout, PAGE, layer, host_idx)
        out.append(want)
    return out


def _check_layer(dp, layer, expected):
    torch.cuda.synchronize()
    for c, layers in enumerate(device_caches(dp)):
        assert torch.equal(as_bytes(layers[layer]).cpu(), expected[c]), f"cache {c} layer {layer}: stale rows"


@pytest.mark.parametrize("kind", ["mla", "mha"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_device_indices_changed_through_data_between_layers(layout, kind):
    gen, dp, pool = _pool(kind, layout, seed=1)
    host = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23])
    dev = torch.tensor([4, 5, 6, 7, 40, 41, 42, 43], device="cuda")
    pool.load_to_device_per_layer(dp, host, dev, 0, "direct")
    dev.data[:4] = torch.tensor([60, 61, 62, 63], device="cuda")
    expected = _expect_load(dp, pool, 1, host, dev)
    pool.load_to_device_per_layer(dp, host, dev, 1, "direct")
    _check_layer(dp, 1, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_cuda_graph_replay_that_rewrites_the_indices_is_seen(layout):
    """A captured copy into the index tensor bumps its version once, at capture; every replay writes it again
    without a bump. Before: the load after a replay reused the plan of the indices before it."""
    gen, dp, pool = _pool("mla", layout, seed=2)
    host = torch.tensor([8, 9, 10, 11])
    dev = torch.tensor([4, 5, 6, 7], device="cuda")
    source = torch.tensor([4, 5, 6, 7], device="cuda")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        dev.copy_(source)
    pool.load_to_device_per_layer(dp, host, dev, 0, "direct")
    source.copy_(torch.tensor([30, 31, 32, 33], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert dev.tolist() == [30, 31, 32, 33]
    expected = _expect_load(dp, pool, 1, host, dev)
    pool.load_to_device_per_layer(dp, host, dev, 1, "direct")
    _check_layer(dp, 1, expected)


@pytest.mark.parametrize("io_backend", ["direct", "auto"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_inference_tensors_on_the_gpu(layout, io_backend):
    """SGLANG_ENABLE_TORCH_INFERENCE_MODE=1: index tensors made under torch.inference_mode(), CPU host indices
    and CUDA device indices as SGLang hands them. Before: every copy-engine load and backup raised."""
    gen, dp, pool = _pool("mha", layout, seed=3)
    with torch.inference_mode():
        host = torch.arange(8, 16)
        dev = torch.arange(32, 40, device="cuda")
    expected = [as_bytes(b).clone() for b in host_caches(pool)]
    for c, layers in enumerate(device_caches(dp)):
        for layer, t in enumerate(layers):
            set_host_rows(expected[c], layout, PAGE, layer, host, as_bytes(t).cpu()[dev.cpu()])
    pool.backup_from_device_all_layer(dp, host, dev, io_backend)
    torch.cuda.synchronize()
    for c, buf in enumerate(host_caches(pool)):
        assert torch.equal(as_bytes(buf), expected[c])
    for layers in device_caches(dp):
        for t in layers:
            fill_random(t, gen)
    for layer in range(len(dp.k_buffer)):
        want = _expect_load(dp, pool, layer, host, dev)
        pool.load_to_device_per_layer(dp, host, dev, layer, io_backend)
        _check_layer(dp, layer, want)


def test_routed_direct_load_with_cuda_indices_changed_between_layers():
    gen = torch.Generator().manual_seed(4)
    host = torch.randint(-1000, 1000, (4, 2, PAGE, 1, 8), generator=gen, dtype=torch.int32).pin_memory()
    dev = [torch.zeros((6 * PAGE, 1, 8), dtype=torch.int32, device="cuda") for _ in range(2)]
    h, d = torch.arange(2 * PAGE, 3 * PAGE), torch.arange(PAGE, 2 * PAGE, device="cuda")
    routed.transfer_kv_per_layer_direct_pf_lf([host], [dev[0]], h, d, 0, PAGE)
    d.data[:] = torch.arange(3 * PAGE, 4 * PAGE, device="cuda")
    routed.transfer_kv_per_layer_direct_pf_lf([host], [dev[1]], h, d, 1, PAGE)
    torch.cuda.synchronize()
    want = torch.zeros_like(dev[1]).cpu()
    want[3 * PAGE:4 * PAGE] = host[2, 1]
    assert torch.equal(dev[1].cpu(), want), "layer 1 went to the old device rows"
