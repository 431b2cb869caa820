"""The real-size server runs' planning, requests and tables (issue 36), on the CPU: no engine starts here."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from sglang_server import engine_cell, models, plan, summary, workload  # noqa: E402


def test_real_size_shapes_have_the_real_models_kv_bytes():
    assert models.kv_row_bytes("mha-8b") == {"row": 4096, "token": 131072, "layers": 32}  # 128 KiB per token
    assert models.kv_row_bytes("mla-v2lite") == {"row": 1152, "token": 31104, "layers": 27}
    cfg = models.config("mla-v2lite")
    assert (cfg["first_k_dense_replace"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]) == (1, 64, 6)
    assert cfg["q_lora_rank"] is None
    assert models.config("mla-v2lite-dense")["first_k_dense_replace"] == 27
    llama = models.config("mha-8b")
    assert (llama["hidden_size"], llama["intermediate_size"], llama["num_key_value_heads"]) == (4096, 14336, 8)


def test_realsize_plan_runs_the_compared_modes_first_with_decode_graphs_on():
    cells = plan.select(plan.realsize("0.5.17"), only="mha-8b")
    assert [c.mode for c in cells] == ["upstream", "plugin", "plugin-nojit", "hicache-off"]
    spec = plan.spec(cells[0], model_dir="/m", vocab=models.VOCAB, port=1)
    assert spec["extra_args"]["disable_cuda_graph"] is False
    assert spec["rounds"] >= 7 and spec["lengths"] == [8192, 32768]
    # one 32K prefix and the TTFT decoders fit the device pool, two prefixes do not: the fillers evict
    decoders = 8 * (512 + 256)
    assert 32768 + 64 + decoders < spec["device_tokens"] < 2 * 32768
    # the host holds a prefix and every filler of its round
    rounds = workload.ttft_rounds(models.VOCAB, [32768], rounds=1, device_tokens=spec["device_tokens"])
    fillers = sum(len(f) for f in rounds[0]["fillers"])
    assert fillers > spec["device_tokens"]
    assert spec["device_tokens"] * spec["host_ratio"] > 32768 + fillers


def test_hits_alternate_their_order_between_rounds():
    rounds = workload.ttft_rounds(models.VOCAB, (8192, 32768), rounds=7, device_tokens=45056, alternate=True)
    for length in (8192, 32768):
        order = [r["device_first"] for r in rounds if r["length"] == length]
        assert order == [False, True, False, True, False, True, False]
    assert not any(r["device_first"] for r in workload.ttft_rounds(models.VOCAB, (2048,), rounds=3,
                                                                    device_tokens=4096))


def test_tpot_traffic_is_the_same_stream_for_every_mode():
    a = workload.tpot_traffic(models.VOCAB, "loads", 12)
    assert a == workload.tpot_traffic(models.VOCAB, "loads", 12)
    ring = [w[:8192] for w in a["warm"]]
    assert len(ring) == 6 and all(s[:8192] in ring for s in a["stream"])  # every request re-uses a ring prefix
    assert len({tuple(s[8192:]) for s in a["stream"]}) == 12  # with its own suffix
    b = workload.tpot_traffic(models.VOCAB, "backups", 5)
    assert b["warm"] == [] and len({tuple(s) for s in b["stream"]}) == 5
    assert workload.tpot_traffic(models.VOCAB, "quiet", 5) == {"warm": [], "stream": []}
    with pytest.raises(ValueError, match="kind"):
        workload.tpot_traffic(models.VOCAB, "writes", 5)


def _record(mode, host_hit=8192, device_hit=8192, cached=0):
    rows = [{"length": 8192, "background": False, "round": i, "device_first": i % 2 == 1,
             "cold": {"ttft_s": 0.30, "cached": cached},
             "host": {"ttft_s": 0.060 + 0.001 * i, "host_hit": host_hit, "device_hit": 8192 - host_hit},
             "device": {"ttft_s": 0.020, "host_hit": 0, "device_hit": device_hit}} for i in range(7)]
    return {"spec": {"workload": "realsize", "kind": "mha-8b", "mode": mode}, "ok": True, "ttft": rows, "_trace": [],
            "tpot": [{"traffic": "quiet", "samples": 100, "median_ms": 9.0, "p90_ms": 9.4, "window_s": 10.0,
                      "requests": [], "host_hit_tokens": 0}]}


def test_tables_pair_host_and_device_hits_and_compare_with_the_floor():
    tables = summary.realsize_tables([_record("plugin")], h2d_gbps=50.0)
    row = tables["ttft"][0]
    assert row["host_hits_proven"] == row["device_hits_proven"] == 7
    assert row["host_minus_device"] == {"median": 43.0, "min": 40.0, "max": 46.0, "n": 7}
    assert row["floor_ms"] == pytest.approx(8192 * 131072 / 50e9 * 1000, abs=0.01)
    assert row["of_floor"] == pytest.approx(43.0 / row["floor_ms"], abs=1e-3)
    text = summary.realsize_markdown(tables)
    assert row["device_after_miss"]["n"] == 3 and row["device_after_host"]["n"] == 4  # rounds 1, 3, 5 go device first
    # host hits take 60 + i ms in round i: rounds 0, 2, 4, 6 right after the miss, 1, 3, 5 after the device hit
    assert row["host_after_miss"] == {"median": 63.0, "min": 60.0, "max": 66.0, "n": 4}
    assert row["host_after_device"] == {"median": 63.0, "min": 61.0, "max": 65.0, "n": 3}
    assert "| 63.0 [60.0-66.0] n=4 | 63.0 [61.0-65.0] n=3 | 43.0 [40.0-46.0] n=7 |" in text
    assert "| mha-8b | plugin | 8192 | no |" in text and "| mha-8b | plugin | quiet | 9.0 | - | 9.4 | - | - |" in text


def test_tpot_rows_are_compared_with_hicache_off_under_the_same_traffic():
    off = _record("hicache-off")
    off["ttft"] = []
    off["tpot"][0].update(median_ms=8.0, mean_ms=8.1, p99_ms=9.9)
    text = summary.realsize_markdown(summary.realsize_tables([_record("plugin"), off], h2d_gbps=50.0))
    assert "| mha-8b | plugin | quiet | 9.0 | - | 9.4 | - | +12.5% |" in text
    assert "| mha-8b | HiCache off | quiet | 8.0 | 8.1 | 9.4 | 9.9 | +0.0% |" in text


def test_a_hit_that_did_not_come_from_the_host_is_not_counted_as_one():
    # half the prefix still on the device: not a host hit, so no host-hit TTFT and no pair
    row = summary.realsize_tables([_record("plugin", host_hit=4096)], h2d_gbps=50.0)["ttft"][0]
    assert row["host"] is None and row["host_minus_device"] is None and row["host_hits_proven"] == 0
    # a "miss" that found a cached prefix is not a miss
    row = summary.realsize_tables([_record("upstream", cached=4096)], h2d_gbps=50.0)["ttft"][0]
    assert row["miss"] is None
    # no floor measured: no ratio, not a made-up link rate
    row = summary.realsize_tables([_record("plugin")], h2d_gbps=None)["ttft"][0]
    assert row["floor_ms"] is None and row["of_floor"] is None


def test_alternated_rounds_reuse_their_fillers_and_they_outnumber_the_device_pool():
    rounds = workload.ttft_rounds(models.VOCAB, (8192, 32768), rounds=7, device_tokens=45056, alternate=True)
    assert all(r["fillers"] is rounds[0]["fillers"] for r in rounds)
    assert sum(len(f) for f in rounds[0]["fillers"]) > 45056
    prefixes = {tuple(r["warm"][:r["length"]]) for r in rounds}
    assert len(prefixes) == 14 and not any(tuple(f[:8192]) in prefixes for f in rounds[0]["fillers"])


def test_tpot_alone_runs_its_baseline_then_the_plugin_first():
    from sglang_server import main as server_main

    cells = server_main.configure(plan.realsize("0.5.17", models=("mha-8b",)), "tpot", rounds=9)
    assert [c.mode for c in cells][:2] == ["hicache-off", "plugin"]
    assert all(c.extra["workloads"] == ["tpot"] and c.extra["rounds"] == 9 for c in cells)
    both = server_main.configure(plan.realsize("0.5.17", models=("mha-8b",)), "ttft,tpot")
    assert [c.mode for c in both] == list(plan.REALSIZE_MODES)
    with pytest.raises(ValueError, match="--workloads"):
        server_main.configure(plan.realsize("0.5.17"), "ttft,decode")


def test_order_runs_the_named_modes_first_and_refuses_an_unknown_one():
    from sglang_server import main as server_main

    cells = server_main.configure(plan.realsize("0.5.17", models=("mha-8b",)), "ttft", order="plugin,upstream")
    assert [c.mode for c in cells] == ["plugin", "upstream", "plugin-nojit", "hicache-off"]
    tpot = server_main.configure(plan.realsize("0.5.17", models=("mha-8b",)), "tpot", order="upstream")
    assert [c.mode for c in tpot] == ["upstream", "hicache-off", "plugin", "plugin-nojit"]
    with pytest.raises(ValueError, match="--order"):
        server_main.configure(plan.realsize("0.5.17"), "ttft", order="plugin,upstrem")
    assert set(plan.ALL_MODES) == set(engine_cell.MODES)


def test_lengths_sets_the_ttft_prefixes_and_refuses_what_is_not_one():
    from sglang_server import main as server_main

    cells = server_main.configure(plan.realsize("0.5.17", models=("mha-8b",)), "ttft", lengths="8192")
    assert {tuple(c.extra["lengths"]) for c in cells} == {(8192,)}
    assert "lengths" not in server_main.configure(plan.realsize("0.5.17", models=("mha-8b",)), "ttft")[0].extra
    for bad in ("8k", "512", "8192,-1"):
        with pytest.raises(ValueError, match="--lengths"):
            server_main.configure(plan.realsize("0.5.17"), "ttft", lengths=bad)


def test_the_warm_up_prompt_is_sent_by_no_timed_workload():
    warm = workload.warm_up(models.VOCAB)
    assert len(warm) == 8192
    sent = [r for kind in ("backups", "loads") for part in workload.tpot_traffic(models.VOCAB, kind, 10).values()
            for r in part]
    assert all(r[:64] != warm[:64] for r in sent)
    assert all(r[:64] != warm[:64] for r in workload.tpot_decoders(models.VOCAB, 32))


def test_spans_give_each_transfer_its_time_and_rate_by_token_count():
    record = _record("plugin")
    record["_trace"] = [
        {"event": "span", "of": "backup", "tokens": 8192, "ms": 25.0, "host_ms": 0.3},
        {"event": "span", "of": "backup", "tokens": 8192, "ms": 27.0, "host_ms": 24.0},
        {"event": "span", "of": "backup", "tokens": 8192, "ms": 80.0, "host_ms": 0.5},
        {"event": "span", "of": "load", "tokens": 8192, "ms": 20.0, "layers": 32},
        {"event": "span", "of": "backup", "tokens": 64, "ms": 0.2},
        {"event": "backup", "tokens": 8192, "ops": {"transfer_kv_all_layer_lf_pf": 8192}},
        {"event": "backup", "tokens": 64, "ops": {"transfer_kv_all_layer_lf_pf": 64}}]
    spans = summary.transfer_spans(record, 131072)
    assert spans["backup"][8192] == {"n": 3, "ms": 27.0, "gbps": round(8192 * 131072 / 27e6, 2), "host_ms": 0.5,
                                     "held": 1}  # the 24-ms call kept the scheduler
    assert spans["load"][8192]["ms"] == 20.0 and spans["backup"][64]["n"] == 1
    assert spans["load"][8192]["host_ms"] is None  # a trace from before host times were recorded
    assert spans["backup_ops"] == {"transfer_kv_all_layer_lf_pf": 8256}
    text = summary.realsize_markdown(summary.realsize_tables([record], h2d_gbps=50.0))
    assert "| mha-8b | plugin | backup | 8192 | 3 | 27.0 | 39.77 | 0.5 | 1 | transfer_kv_all_layer_lf_pf 8256 |" in text
    assert "| mha-8b | plugin | load | 8192 | 1 | 20.0 | 53.69 | - | - | - |" in text
    assert "| backup | 64 |" not in text  # a page of a suffix is left out of the table


def test_the_timeline_splits_host_hits_device_hits_and_misses_by_prefix():
    record = _record("plugin")
    record["_trace"] = [
        {"event": "timeline", "load": True, "extend_tokens": 64, "prefix_tokens": 8192, "forward_ms": 30.0,
         "to_forward_ms": 1.0, "to_end_ms": 31.0, "host_to_forward_ms": 2.0},
        {"event": "timeline", "load": True, "extend_tokens": 64, "prefix_tokens": 8192, "forward_ms": 34.0,
         "to_forward_ms": 3.0, "to_end_ms": 37.0, "host_to_forward_ms": 4.0},
        {"event": "timeline", "load": True, "extend_tokens": 64, "prefix_tokens": 8128, "forward_ms": 28.0,
         "to_forward_ms": 1.5, "to_end_ms": 29.5, "host_to_forward_ms": 2.5},
        {"event": "timeline", "load": False, "extend_tokens": 64, "prefix_tokens": 8192, "forward_ms": 9.0},
        {"event": "timeline", "load": False, "extend_tokens": 8256, "prefix_tokens": 0, "forward_ms": 250.0},
        {"event": "timeline", "load": False, "extend_tokens": 8192, "prefix_tokens": 8192, "forward_ms": 260.0},
        {"event": "timeline", "load": False, "extend_tokens": 64, "prefix_tokens": 64, "forward_ms": 5.0}]
    rows = summary.forward_timeline(record)
    assert [(r["kind"], r["prefix"], r["n"]) for r in rows] == [
        ("host hit", 8128, 1), ("host hit", 8192, 2), ("device hit", 8192, 1), ("miss", 8192, 1)]
    assert rows[1] == {"kind": "host hit", "prefix": 8192, "n": 2, "forward_ms": 32.0, "to_forward_ms": 2.0,
                       "to_end_ms": 34.0, "host_to_forward_ms": 3.0}
    assert rows[2]["to_forward_ms"] is None  # no load: nothing to measure from
    text = summary.realsize_markdown(summary.realsize_tables([record], h2d_gbps=50.0))
    assert "| mha-8b | plugin | host hit | 8192 | 2 | 32.0 | 2.0 | 34.0 | 3.0 |" in text
    assert "| mha-8b | plugin | device hit | 8192 | 1 | 9.0 | - | - | - |" in text
