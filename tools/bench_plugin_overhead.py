#!/usr/bin/env python3
"""Python cost the SGLang plugin adds per transfer call, measured without a GPU.

The op underneath (ops.transfer_one_layer_mla) is replaced by a no-op, so what
is timed is only the layers above it: SGLang's REPLACE hook wrapper plus the
routing (``integrations/sglang/ops.py``) against ``compat`` called directly. Run
with the sgl-kernel stand-in on the path, sglang 0.5.23 installed, and this
package installed (the entry point must be registered):

    PYTHONPATH=tests/sglang_stubs python3 tools/bench_plugin_overhead.py

Compare the difference with the host time of a real op (tools/bench_sglang.py
--overhead, bench --mode overhead) to get the plugin's share.
"""

import statistics
import time

import torch
from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.kernels.ops.kvcache import hicache  # noqa: E402  (patched by the plugin now)

from sglang_hicache_jit import compat, ops  # noqa: E402
from sglang_hicache_jit.integrations.sglang import ops as sglang_ops  # noqa: E402

ops.transfer_one_layer_mla = lambda *args, **kwargs: "plain"
sglang_ops._kernel_ok[1152] = True  # as after a successful probe
dst = torch.empty(1024, 1, 576, dtype=torch.bfloat16)
src = torch.empty(4096, 8, 1, 576, dtype=torch.bfloat16).transpose(0, 1)[3]
idx = torch.arange(64)
calls = {"through the plugin": hicache.transfer_hicache_one_layer_mla,
         "compat directly": compat.transfer_hicache_one_layer_mla}
samples = {name: [] for name in calls}
for _ in range(15):  # interleaved rounds
    for name, fn in calls.items():
        start = time.perf_counter()
        for _ in range(20000):
            fn(cache_dst=dst, indices_dst=idx, cache_src=src, indices_src=idx, element_dim=576, page_size=64)
        samples[name].append((time.perf_counter() - start) / 20000 * 1e9)
medians = {name: statistics.median(v) for name, v in samples.items()}
for name, ns in medians.items():
    print(f"{name:20s} {ns:6.0f} ns per call above the op")
print(f"plugin adds          {medians['through the plugin'] - medians['compat directly']:6.0f} ns per call")
