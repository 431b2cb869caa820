"""The benchmark's upstream providers move the right rows on a real GPU (marked ``gpu``; skipped without
one, without SGLang, or where SGLang's kernel does not take the rows: the benchmark skips those too)."""

import pytest
import torch

from sglang_hicache_jit.bench import upstream as bench_upstream
from sglang_hicache_jit.bench import providers, workloads
from sglang_hicache_jit.bench.upstream import Unavailable

pytestmark = pytest.mark.gpu

LAYER, TOKENS, PAGE = 3, 512, 64


@pytest.fixture(scope="module", params=["mla-bf16", "mla-fp8", "mha-small"])
def pools(request):
    return workloads.make_pools(request.param, 4096, 2048)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("scope", ["one", "all"])
@pytest.mark.parametrize("provider", ["upstream", "upstream-reg", "upstream-tma", "upstream-tma-q8"])
def test_upstream_provider_copies_the_addressed_rows(pools, provider, scope, direction):
    if not bench_upstream.importable():
        pytest.skip("SGLang is not importable")
    host_idx, dev_idx = workloads.make_indices(TOKENS, PAGE, pools.host_slots, pools.device_slots, seed=7)
    try:
        call = providers.build_call(provider, pools, scope, direction, LAYER, host_idx, dev_idx, PAGE, {})
    except Unavailable as exc:
        pytest.skip(str(exc))
    layers = range(workloads.LAYERS) if scope == "all" else [LAYER]
    dev_cuda, expected = dev_idx.cuda(), {}
    for cache in range(pools.caches):  # fresh source rows, zeroed destination rows
        for layer in layers:
            rows = torch.randint(0, 256, (TOKENS, pools.row_bytes), dtype=torch.uint8)
            expected[cache, layer] = rows
            if direction == "h2d":
                pools.host[cache][host_idx, layer] = rows
                pools.device[cache][layer][dev_cuda] = 0
            else:
                pools.device[cache][layer][dev_cuda] = rows.cuda()
                pools.host[cache][host_idx, layer] = 0
    torch.cuda.synchronize()
    call()
    torch.cuda.synchronize()
    for (cache, layer), rows in expected.items():
        assert torch.equal(pools.host[cache][host_idx, layer], rows), (provider, scope, direction, cache, layer)
        assert torch.equal(pools.device[cache][layer][dev_cuda].cpu(), rows), (provider, scope, direction, cache, layer)
    assert call.kernel in ("reg", "tma")
