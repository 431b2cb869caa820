"""Does an all-layer backup hold the calling thread while the GPU computes? (issue 36)

In a real server (docs/BENCHMARKS.md, "a real-size SGLang server") a miss took 28 ms longer at 8K tokens
with the plugin than upstream, about one backup's transfer time. SGLang starts a write-through backup from
its scheduler thread while the compute stream is busy; anything in that call that waits for the GPU (a
device sync, a pageable host-to-device copy on the compute stream) delays the scheduler by the compute
queued ahead of it. This measures, with about ``--busy-ms`` of bf16 matmuls queued on the compute stream:

* ``move_indices``: what SGLang itself does before a kernel backup when the staged write-back is declined
  (the plugin declines it): ``host_indices.to(cuda, non_blocking=True)`` of pageable CPU indices, on the
  compute stream;
* ``routed-gpu-indices``: the plugin's ``transfer_kv_all_layer_lf_pf`` on a side stream (SGLang's write
  stream) with CUDA indices (the kernel path SGLang takes with the plugin);
* ``routed-cpu-indices``: the same with CPU host indices (the staging path);

each as the calling thread's time in the call (median of ``--rounds``) and the GPU time of the backup.
Prints one JSON line per case. MHA rows of Llama-3.1-8B (32 layers, 2 x 2048-B rows a token), page_first.

    PYTHONPATH=. python3 tools/backup_block.py [--tokens 8192] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def busy(ms: float, a: torch.Tensor, b: torch.Tensor, per_matmul_ms: float) -> None:
    for _ in range(max(1, round(ms / per_matmul_ms))):
        torch.matmul(a, b)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--busy-ms", type=float, default=60.0)
    args = parser.parse_args(argv)
    from sglang_hicache_jit.integrations.sglang import ops as routed

    layers, row, tokens = 32, 2048, args.tokens
    device_rows, host_slots = 4 * tokens, 2 * tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_layers = [torch.randint(0, 255, (device_rows, row), dtype=torch.uint8, device="cuda", generator=gen)
                for _ in range(layers)]
    v_layers = [torch.randint(0, 255, (device_rows, row), dtype=torch.uint8, device="cuda", generator=gen)
                for _ in range(layers)]
    k_table = torch.tensor([t.data_ptr() for t in k_layers], dtype=torch.uint64, device="cuda")
    v_table = torch.tensor([t.data_ptr() for t in v_layers], dtype=torch.uint64, device="cuda")
    # One pinned tensor for K and V, passed as a fresh view of each on every call: SGLang 0.5.17's MHA host
    # pool does so (its k_buffer and v_buffer are properties returning kv_buffer[0] and kv_buffer[1]).
    host_kv = torch.zeros((2, host_slots, layers, row), dtype=torch.uint8, pin_memory=True)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.matmul(a, b)  # cuBLAS's first call sets up (tens of ms): not a matmul's time
    torch.cuda.synchronize()
    start.record()
    for _ in range(5):
        torch.matmul(a, b)
    end.record()
    end.synchronize()
    per_matmul_ms = start.elapsed_time(end) / 5
    side = torch.cuda.Stream()
    device_idx = torch.randperm(device_rows, device="cuda")[:tokens].sort().values
    host_idx = torch.arange(tokens, dtype=torch.int64) + tokens // 2  # SGLang's host slots: CPU, pageable

    def routed_backup(host_indices, device_indices):
        routed.transfer_kv_all_layer_lf_pf(k_table, host_kv[0], v_table, host_kv[1], device_indices, host_indices,
                                           row, layers * row, layers)

    host_idx_gpu = host_idx.to("cuda")  # SGLang moves them before the call: not the call's time
    cases = {
        "move_indices": lambda: host_idx.to("cuda", non_blocking=True),
        "routed-gpu-indices": lambda: routed_backup(host_idx_gpu, device_idx),
        "routed-cpu-indices": lambda: routed_backup(host_idx, device_idx),
    }
    for name, call in cases.items():
        call()  # warm: plans, tables, staging area
        torch.cuda.synchronize()
        host_ms, gpu_ms, returned_early = [], [], []
        for _ in range(args.rounds):
            busy(args.busy_ms, a, b, per_matmul_ms)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if name == "move_indices":  # on the compute stream, as SGLang's move_indices
                t0 = time.perf_counter()
                call()
                host_ms.append((time.perf_counter() - t0) * 1e3)
            else:  # on a side stream that first waits for the compute stream, as SGLang's write stream
                with torch.cuda.stream(side):
                    side.wait_stream(torch.cuda.default_stream())
                    s.record()
                    t0 = time.perf_counter()
                    call()
                    host_ms.append((time.perf_counter() - t0) * 1e3)
                    e.record()
                # the compute still queued when the call returned: the call did not wait for it
                returned_early.append(not torch.cuda.default_stream().query())
            torch.cuda.synchronize()
            if name != "move_indices":
                gpu_ms.append(s.elapsed_time(e))
        print(json.dumps({"case": name, "tokens": tokens, "busy_ms": args.busy_ms,
                          "matmul_ms": round(per_matmul_ms, 3), "host_ms_median": round(statistics.median(host_ms), 3),
                          "host_ms": [round(x, 3) for x in host_ms],
                          "returned_before_compute_ended": sum(returned_early) if returned_early else None,
                          "gpu_ms_median": round(statistics.median(gpu_ms), 3) if gpu_ms else None}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
