"""One real SGLang engine for one cell of the server tests: start it, send the workload, write JSON.

    python3 tools/sglang_server/engine_cell.py --spec '<json>' --out DIR

The spec (``plan.py`` writes them) names the model folder, the HiCache configuration, the mode and the
workload. The mode sets, before SGLang is imported (its processes inherit the environment):

* ``upstream``: this package's plugin off (``SGLANG_HICACHE_JIT_SGLANG_PLUGIN=0``): SGLang's own ops,
  the real sgl-kernel and SGLang's own JIT kernels;
* ``plugin``: the plugin on (the JIT kernel where the probe says ok, else the copy engines);
* ``plugin-nojit``: the plugin on with ``SGLANG_HICACHE_JIT_DISABLE=1`` (copy engines only);
* ``plugin-nostaging``: the plugin on with ``SGLANG_HICACHE_JIT_STAGING=0``: SGLang's staged write-back
  is declined, so every backup is the kernel writing rows to the host (the A/B of staging's host time);
* ``plugin-sidestream``: the plugin on, its staged backups gathering on a side stream that overlaps the
  copies (``HICACHE_SERVER_STAGING_SIDE_STREAM=1``, read by ``harness_plugin.py``): the A/B of
  ``staging.GATHER_ON_SIDE_STREAM``;
* ``plugin-loadquota2``: the plugin on, its one-layer loads at 2 CTAs, upstream's budget, instead of the
  package's default (``HICACHE_SERVER_LOAD_QUOTA=2``): the A/B of the 8K host hit's 3 ms gap;
* ``plugin-plain``: the plugin on, its one-layer loads through the kernel's plain copy loop, whose CTAs use
  no shared memory, at its default 8 CTAs (``HICACHE_SERVER_LOAD_METHOD=plain``), instead of the bulk
  copies, whose CTA takes a whole multiprocessor's shared memory and so waits for one to drain: the A/B of
  that wait beside the forward pass;
* ``plugin-resident``: the plugin on, its one-layer loads handed to CTAs that are already resident
  (``HICACHE_SERVER_LOAD_METHOD=resident``), so no load waits for a multiprocessor;
* ``control``: as ``upstream``, with every row loaded back from the host zeroed on the device
  (``harness_plugin.py``): its outputs must differ, or the test cannot see the KV bytes;
* ``control-plugin``: the same corruption with the plugin on;
* ``hicache-off``: no hierarchical cache at all (the real-size runs' TPOT baseline).

Workloads: ``correctness`` (the default), ``ttft`` and ``realsize`` (the real-size models: TTFT with
alternated hits alone and beside decoding, then TPOT of a steady decode batch under three traffics).

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
    "plugin-nostaging": {"SGLANG_HICACHE_JIT_SGLANG_PLUGIN": "1", "SGLANG_HICACHE_JIT_STAGING": "0"},
    "plugin-sidestream": {"SGLANG_HICACHE_JIT_SGLANG_PLUGIN": "1", "HICACHE_SERVER_STAGING_SIDE_STREAM": "1"},
    "plugin-loadquota2": {"SGLANG_HICACHE_JIT_SGLANG_PLUGIN": "1", "HICACHE_SERVER_LOAD_QUOTA": "2"},
    "plugin-plain": {"SGLANG_HICACHE_JIT_SGLANG_PLUGIN": "1", "HICACHE_SERVER_LOAD_METHOD": "plain"},
    "plugin-resident": {"SGLANG_HICACHE_JIT_SGLANG_PLUGIN": "1", "HICACHE_SERVER_LOAD_METHOD": "resident"},
    "control": {"SGLANG_HICACHE_JIT_SGLANG_PLUGIN": "0", "HICACHE_SERVER_CORRUPT": "zero"},
    "control-plugin": {"SGLANG_HICACHE_JIT_SGLANG_PLUGIN": "1", "HICACHE_SERVER_CORRUPT": "zero"},
    "hicache-off": {"SGLANG_HICACHE_JIT_SGLANG_PLUGIN": "0"},
}
HICACHE_KEYS = ("hicache_io_backend", "hicache_mem_layout", "hicache_write_policy", "hicache_ratio", "page_size",
                "max_total_tokens", "attention_backend", "sampling_backend", "attn_cp_size", "tp_size")


def engine_kwargs(spec: dict, fields: set | None = None) -> tuple:
    """(kwargs for sglang.Engine, names dropped because this release's ServerArgs lacks them)."""
    wanted = {
        "model_path": spec["model"], "tokenizer_path": spec["model"], "load_format": "dummy", "dtype": "bfloat16",
        "enable_hierarchical_cache": spec.get("mode") != "hicache-off", "hicache_io_backend": spec["io_backend"],
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
    async def hit(kind, row):
        out, took = await one(item[kind])
        row[kind] = {"ttft_s": round(took, 5), "host_hit": out["host_hit"], "device_hit": out["device_hit"],
                     "cached": out["cached"]}

    for item in rounds:
        if time.time() > spec.get("deadline", float("inf")):
            record["ttft_cut"] = "deadline"
            break
        row = {"length": item["length"], "round": item["round"], "background": background,
               "device_first": item.get("device_first", False)}
        out, took = await one(item["warm"])  # no hit: the whole prompt is computed (what a miss costs)
        row["cold"] = {"ttft_s": round(took, 5), "cached": out["cached"]}
        if row["device_first"]:  # still on the device right after its miss
            await hit("device", row)
        for filler in item["fillers"]:
            await one(filler)
        await hit("host", row)
        if not row["device_first"]:
            await hit("device", row)
        record["ttft"].append(row)
    stop.append(True)
    if task is not None:
        await task


def run_realsize(engine, spec: dict, record: dict) -> None:
    """The real-size workloads in one engine: TTFT (miss, device hit, host hit per length, hits in
    alternated order, alone then beside decoding; not with HiCache off), then TPOT under each traffic."""
    from sglang_server import workload

    workloads = spec.get("workloads", ("ttft", "tpot"))
    record["ttft"] = []
    if spec.get("mode") != "hicache-off" and "ttft" in workloads:
        for background in (False, True):  # fresh prefixes for each: nothing is cached from the first pass
            rounds = workload.ttft_rounds(spec["vocab"], spec.get("lengths", (8192, 32768)),
                                          rounds=spec.get("rounds", 7), device_tokens=spec["device_tokens"],
                                          seed=11 + int(background), alternate=True)
            engine.loop.run_until_complete(_measure(engine, spec, rounds, background, record))
        record["ttft_summary"] = summarize_ttft(record["ttft"])
    record["tpot"] = []
    if "tpot" not in workloads:
        return
    if not record["ttft"]:
        # Nothing has run yet: without this the first window can end before the decoders' first tokens
        # (on a fresh machine HiCache off's quiet window got no sample, its first prefill still compiling).
        record["warm_up_s"] = round(engine.loop.run_until_complete(_warm_up(engine, spec)), 2)
    for traffic in spec.get("traffics", ("quiet", "backups", "loads")):
        if time.time() > spec.get("deadline", float("inf")) - spec.get("tpot_window_s", 10.0) - 5:
            record["tpot_cut"] = traffic
            break
        record["tpot"].append(engine.loop.run_until_complete(_tpot(engine, spec, traffic)))


async def _warm_up(engine, spec: dict) -> float:
    """A long prompt, then the decode batch for a few tokens: the seconds it took."""
    import asyncio

    from sglang_server import workload

    began = time.perf_counter()
    await engine.async_generate(input_ids=workload.warm_up(spec["vocab"], spec.get("traffic_tokens", 8192)),
                                sampling_params={"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True})
    few = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    await asyncio.gather(*(engine.async_generate(input_ids=ids, sampling_params=few)
                           for ids in workload.tpot_decoders(spec["vocab"], spec.get("tpot_decoders", 32))))
    return time.perf_counter() - began


async def _tpot(engine, spec: dict, traffic: str) -> dict:
    """TPOT of a steady decode batch beside one traffic: every decoder streams, and each gap between two
    of its chunks inside the window (after a warm-up) counts, per token, as one sample. The traffic's
    requests go one at a time, one every ``interval`` seconds at most, so every mode gets the same load."""
    import asyncio

    from sglang_server import workload

    count = spec.get("tpot_decoders", 32)
    prompts = workload.tpot_decoders(spec["vocab"], count)
    window, warmup = spec.get("tpot_window_s", 10.0), spec.get("tpot_warmup_s", 2.0)
    interval = spec.get("traffic_interval_s", 1.0)
    reqs = workload.tpot_traffic(spec["vocab"], traffic, count=int(window / interval) + 4,
                                 length=spec.get("traffic_tokens", 8192))
    one_token = {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True}
    for ids in reqs["warm"]:  # the ring is computed and written through before the window
        await engine.async_generate(input_ids=ids, sampling_params=one_token)
    params = {"temperature": 0.0, "max_new_tokens": spec.get("tpot_tokens", 256), "ignore_eos": True}
    samples, state = [], {"start": None, "end": None, "stop": False}
    # time.perf_counter, not the event loop's clock: SGLang's engine runs on uvloop, whose clock ticks in
    # whole milliseconds, which turned every decode gap of the first run into 7.000 ms.
    clock = time.perf_counter

    async def decoder(ids):
        while not state["stop"]:
            last_t, last_n = None, 0
            stream = await engine.async_generate(input_ids=ids, sampling_params=params, stream=True)
            async for chunk in stream:
                now, n = clock(), chunk["meta_info"].get("completion_tokens", 0)
                if last_t is not None and n > last_n and state["start"] is not None and \
                        state["start"] <= last_t and (state["end"] is None or now <= state["end"]):
                    samples.extend([(now - last_t) / (n - last_n)] * (n - last_n))
                last_t, last_n = now, n

    tasks = [asyncio.ensure_future(decoder(ids)) for ids in prompts]
    await asyncio.sleep(warmup)
    state["start"] = clock()
    sent = []
    for ids in reqs["stream"]:
        if clock() - state["start"] >= window:
            break
        began = clock()
        out = _outputs(await engine.async_generate(input_ids=ids, sampling_params=one_token))
        sent.append({"s": round(clock() - began, 4), "prompt": len(ids), "host_hit": out["host_hit"],
                     "device_hit": out["device_hit"]})
        await asyncio.sleep(max(0.0, interval - (clock() - began)))
    await asyncio.sleep(max(0.0, window - (clock() - state["start"])))
    state["end"] = clock()
    state["stop"] = True  # each decoder ends its request (a cancelled one could decode on into the next traffic)
    await asyncio.gather(*tasks)
    ms = sorted(x * 1000 for x in samples)
    return {"traffic": traffic, "samples": len(ms), "window_s": round(state["end"] - state["start"], 2),
            "median_ms": round(statistics.median(ms), 3) if ms else None,
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3) if ms else None,
            "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 3) if ms else None,
            "mean_ms": round(statistics.fmean(ms), 3) if ms else None,
            "requests": sent, "host_hit_tokens": sum(r["host_hit"] for r in sent)}


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



def effective_args(server_args) -> dict:
    """The HiCache arguments the engine runs with. SGLang 0.5.17-0.5.19 rewrite the fields themselves
    (``kernel`` + ``page_first_direct`` becomes ``direct``, ``direct`` + ``page_first`` becomes
    ``page_first_direct``); from 0.5.20 (its ``arg_groups``) the fields stay as given and each rewrite is
    stashed in ``_resolved_overrides`` as (source, {field: value}), applied when the arguments are
    published, so the fields alone name the pair asked for, not the one served (0.5.23's matrix,
    2026-12-07: its traces showed the rewritten pair's ops)."""
    effective = {k: getattr(server_args, k, None) for k in HICACHE_KEYS}
    for entry in getattr(server_args, "_resolved_overrides", None) or ():
        fields = entry[1] if isinstance(entry, tuple) and len(entry) == 2 else {}
        effective.update({k: v for k, v in dict(fields).items() if k in effective})
    return effective


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    spec = json.loads(args.spec)
    if "max_s" in spec:  # this engine's own time box, from now, within the run's deadline
        spec["deadline"] = min(spec.get("deadline", float("inf")), time.time() + spec["max_s"])
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
        record["effective"] = effective_args(server_args)
        start = time.perf_counter()
        workloads = {"ttft": run_ttft, "realsize": run_realsize}
        workloads.get(spec.get("workload"), run_correctness)(engine, spec, record)
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
