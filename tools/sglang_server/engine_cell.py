"""One real SGLang engine for one cell of the server tests: start it, send the workload, write JSON.

    python3 tools/sglang_server/engine_cell.py --spec '<json>' --out DIR

The spec (``plan.py`` writes them) names the model folder, the HiCache configuration, the mode and the
workload. The mode sets, before SGLang is imported (its processes inherit the environment):

* ``upstream``: this package's plugin off (``SGLANG_HICACHE_JIT_SGLANG_PLUGIN=0``): SGLang's own ops,
  the real sgl-kernel and SGLang's own JIT kernels;
* ``plugin``: the plugin on (the JIT kernel where the probe says ok, else the copy engines);
* ``plugin-nojit``: the plugin on with ``SGLANG_HICACHE_JIT_DISABLE=1`` (copy engines only);
* ``control``: as ``upstream``, with every row loaded back from the host zeroed on the device
  (``harness_plugin.py``): its outputs must differ, or the test cannot see the KV bytes;
* ``control-plugin``: the same corruption with the plugin on.

Writes ``DIR/<cell>.json``: the effective server arguments (SGLang rewrites some layout x backend
pairs), each request's output ids, logprobs and cached-token split, timings, and any error. The engine's
own log is this process's stderr (the runner sends it to ``<cell>.log``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MODES = {
    "upstream": {"SGLANG_HICACHE_JIT_SGLANG_PLUGIN": "0"},
    "plugin": {"SGLANG_HICACHE_JIT_SGLANG_PLUGIN": "1"},
    "plugin-nojit": {"SGLANG_HICACHE_JIT_SGLANG_PLUGIN": "1", "SGLANG_HICACHE_JIT_DISABLE": "1"},
    "control": {"SGLANG_HICACHE_JIT_SGLANG_PLUGIN": "0", "HICACHE_SERVER_CORRUPT": "zero"},
    "control-plugin": {"SGLANG_HICACHE_JIT_SGLANG_PLUGIN": "1", "HICACHE_SERVER_CORRUPT": "zero"},
}
HICACHE_KEYS = ("hicache_io_backend", "hicache_mem_layout", "hicache_write_policy", "hicache_ratio", "page_size",
                "max_total_tokens", "attention_backend", "sampling_backend", "attn_cp_size", "tp_size")


def engine_kwargs(spec: dict, fields: set | None = None) -> tuple:
    """(kwargs for sglang.Engine, names dropped because this release's ServerArgs lacks them)."""
    wanted = {
        "model_path": spec["model"], "tokenizer_path": spec["model"], "load_format": "dummy", "dtype": "bfloat16",
        "enable_hierarchical_cache": True, "hicache_io_backend": spec["io_backend"],
        "hicache_mem_layout": spec["layout"], "hicache_write_policy": "write_through",
        "hicache_ratio": spec.get("host_ratio", 4.0), "page_size": spec.get("page", 64),
        "max_total_tokens": spec["device_tokens"], "max_running_requests": spec.get("max_running", 16),
        "chunked_prefill_size": spec.get("chunk", 8192), "attention_backend": "triton",
        "sampling_backend": "pytorch", "disable_cuda_graph": True, "mem_fraction_static": spec.get("mem_fraction", 0.8),
        "random_seed": 0, "log_level": "info", "port": spec["port"], "nccl_port": spec["port"] + 7,
        "context_length": spec.get("context", 40960), "enable_metrics": False, "decode_log_interval": 1000,
        **spec.get("extra_args", {}),
    }
    if fields is None:
        return wanted, []
    return {k: v for k, v in wanted.items() if k in fields}, sorted(k for k in wanted if k not in fields)


def server_fields(server_args_cls) -> set | None:
    """The names ServerArgs takes: its dataclass fields (up to 0.5.22), else its constructor's parameters
    (0.5.23 assembles the class); None where it takes any keyword."""
    import dataclasses
    import inspect

    try:
        return {f.name for f in dataclasses.fields(server_args_cls)}
    except TypeError:
        params = inspect.signature(server_args_cls).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return None
        return {p.name for p in params}


def _outputs(result) -> dict:
    meta = result["meta_info"]
    logprobs = meta.get("output_token_logprobs") or []
    details = meta.get("cached_tokens_details") or {}
    return {"output_ids": result.get("output_ids") or [t[1] for t in logprobs],
            "logprobs": [t[0] for t in logprobs], "cached": meta.get("cached_tokens", 0),
            "device_hit": details.get("device", 0), "host_hit": details.get("host", 0),
            "e2e": meta.get("e2e_latency")}


def _generate(engine, ids, max_new_tokens: int) -> tuple:
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    start = time.perf_counter()
    result = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    return result, time.perf_counter() - start


def run_correctness(engine, spec: dict, record: dict) -> None:
    from sglang_server import workload

    requests = workload.correctness(spec["vocab"], seed=spec.get("seed", 0))
    record["requests"] = []
    for request in requests:
        result, took = _generate(engine, request["input_ids"], request["max_new_tokens"])
        out = _outputs(result)
        out.update(id=request["id"], phase=request["phase"], prompt=len(request["input_ids"]), seconds=round(took, 4))
        record["requests"].append(out)
    record["host_hit_tokens"] = sum(r["host_hit"] for r in record["requests"])
    record["host_hits"] = sum(1 for r in record["requests"] if r["host_hit"] > 0)


def run_ttft(engine, spec: dict, record: dict) -> None:
    """TTFT of host hits and device hits per prefix length, alone and beside decoding requests (all in the
    engine's own event loop: the decoders are tasks, the timed requests are awaited one at a time)."""
    from sglang_server import workload

    rounds = workload.ttft_rounds(spec["vocab"], spec.get("lengths", (2048, 8192, 32768)),
                                  rounds=spec.get("rounds", 5), device_tokens=spec["device_tokens"])
    record["ttft"] = []
    for background in (False, True):
        engine.loop.run_until_complete(_measure(engine, spec, rounds, background, record))
    record["ttft_summary"] = summarize_ttft(record["ttft"])


async def _measure(engine, spec: dict, rounds: list, background: bool, record: dict) -> None:
    import asyncio

    from sglang_server import workload

    async def one(ids):
        start = time.perf_counter()
        result = await engine.async_generate(input_ids=ids, sampling_params={
            "temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True})
        return _outputs(result), time.perf_counter() - start

    stop = []
    prompts = workload.decoders(spec["vocab"], count=spec.get("decoders", 8))
    params = {"temperature": 0.0, "max_new_tokens": spec.get("decode_tokens", 256), "ignore_eos": True}

    async def decode():
        while not stop:
            await engine.async_generate(input_ids=prompts, sampling_params=params)

    task = asyncio.ensure_future(decode()) if background else None
    if task is not None:
        await asyncio.sleep(2.0)  # the decoders are running
    for item in rounds:
        if time.time() > spec.get("deadline", float("inf")):
            record["ttft_cut"] = "deadline"
            break
        row = {"length": item["length"], "round": item["round"], "background": background}
        out, took = await one(item["warm"])  # no hit: the whole prompt is computed (what a miss costs)
        row["cold"] = {"ttft_s": round(took, 5), "cached": out["cached"]}
        for filler in item["fillers"]:
            await one(filler)
        for kind in ("host", "device"):
            out, took = await one(item[kind])
            row[kind] = {"ttft_s": round(took, 5), "host_hit": out["host_hit"], "device_hit": out["device_hit"]}
        record["ttft"].append(row)
    stop.append(True)
    if task is not None:
        await task


def summarize_ttft(rows: list) -> list:
    """Medians per (length, background) of host-hit and device-hit TTFT, only rows that were the hit asked for."""
    out = []
    for key in sorted({(r["length"], r["background"]) for r in rows}):
        sel = [r for r in rows if (r["length"], r["background"]) == key]
        host = [r["host"]["ttft_s"] for r in sel if r["host"]["host_hit"] >= key[0] - 64]
        device = [r["device"]["ttft_s"] for r in sel if r["device"]["device_hit"] >= key[0] - 64]
        cold = [r["cold"]["ttft_s"] for r in sel if "cold" in r and r["cold"]["cached"] == 0]
        out.append({"length": key[0], "background": key[1], "host_hit_ms": _median_ms(host),
                    "device_hit_ms": _median_ms(device), "cold_ms": _median_ms(cold), "host_rounds": len(host),
                    "rounds": len(sel)})
    return out


def _median_ms(values):
    return round(statistics.median(values) * 1000, 2) if values else None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    spec = json.loads(args.spec)
    os.environ.update(MODES[spec["mode"]])
    os.environ.update(spec.get("env", {}))
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["HICACHE_SERVER_TRACE"] = str(args.out / f"{spec['cell']}.trace.jsonl")
    record = {"cell": spec["cell"], "spec": spec, "ok": False, "error": "", "started": time.time()}
    out_file = args.out / f"{spec['cell']}.json"
    engine = None
    try:
        import sglang
        from sglang.srt.server_args import ServerArgs

        kwargs, dropped = engine_kwargs(spec, server_fields(ServerArgs))
        record.update(sglang=sglang.__version__, dropped_args=dropped)
        start = time.perf_counter()
        engine = sglang.Engine(**kwargs)
        record["engine_start_s"] = round(time.perf_counter() - start, 2)
        server_args = getattr(engine, "server_args", None)
        record["effective"] = {k: getattr(server_args, k, None) for k in HICACHE_KEYS}
        start = time.perf_counter()
        (run_ttft if spec.get("workload") == "ttft" else run_correctness)(engine, spec, record)
        record["workload_s"] = round(time.perf_counter() - start, 2)
        record["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - a cell's failure is a result, written like any other
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["trace"] = traceback.format_exc()[-4000:]
    finally:
        out_file.write_text(json.dumps(record) + "\n")
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as exc:  # noqa: BLE001
                record["shutdown_error"] = repr(exc)
                out_file.write_text(json.dumps(record) + "\n")
    print(f"cell {spec['cell']}: ok={record['ok']} {record['error'][:300]}", flush=True)
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
