"""tools/bench.py without a GPU: every workload's options parse, the device script's commands parse, and
the GPU workloads run through on CPU tensors (--smoke), bit-exact checks included, writing the one result
format (a header line, then a line per row) that `report` reads back."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from fleet_helpers import ROOT

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_driver", ROOT / "tools" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


REQUIRED = {"sglang-pool": ["--label", "x"], "warm-ab": ["--side", "a=/bin/python:/tmp/a", "--side", "b=/bin/python:/tmp/b"]}


def test_list_names_every_workload_and_its_question(bench, capsys):
    assert bench.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name, workload in bench.WORKLOADS.items():
        assert f"{name} " in out and workload.question in out
    assert "report" in out


@pytest.mark.parametrize("name", ["layouts", "cta", "grid", "beside", "overhead", "host-cost", "plan-cost",
                                  "copy-sizes", "copy-queue", "layered", "loader", "warm-ab", "sglang-pool",
                                  "releases"])
def test_every_workload_parses_its_defaults(bench, name):
    args = bench._parser().parse_args([name, *REQUIRED.get(name, [])])
    assert args.workload == name and args.out is None


@pytest.mark.parametrize("beside", ["none", "decode", "matmul"])
def test_layered_runs_through_on_the_cpu_bit_exact(bench, tmp_path, capsys, beside):
    """The host-hit stand-in: the per-layer loads, the forward pass that waits for each layer, the device hit
    beside it, one row per provider with the gap between them (times meaningless on the CPU)."""
    result = tmp_path / "layered.jsonl"
    assert bench.main(["layered", "--smoke", "--beside", beside, "--out", str(result)]) == 0, capsys.readouterr().out
    header, *rows = _lines(result)
    assert header["bench"] == "layered" and "layered --smoke" in header["command"]
    assert [(r["provider"], r["exact"], r["beside"]) for r in rows] == [("torch", True, beside)]
    row = rows[0]
    assert row["host_minus_device_ms"] == pytest.approx(row["samples"][0]["host_ms"] - row["samples"][0]["device_ms"])
    assert 0 <= row["first_ms"] <= row["load_ms"] and row["device_ms"] > 0 and row["host_ms"] > 0


@pytest.mark.parametrize("group", [1, 2])
def test_layered_staged_providers_load_every_layer_bit_exact_on_the_cpu(group):
    """The group-load providers (staged-gN) through the staging area on CPU tensors (the torch.cuda stream and
    event calls stubbed): layer i's call loads the group at its first layer and nothing at the others, and
    the whole pass is bit-exact."""
    import argparse

    import fake_gpu

    sys.path.insert(0, str(ROOT / "tools"))
    from benchmarks import layered

    args = argparse.Namespace(tokens=8192, page=64, extend=128, providers=["staged-g8"], beside="none", reps=7,
                              smoke=True)
    s = layered.Setup(args)
    with fake_gpu.stub_streams():
        transfers = s._staged(group)
        assert len(transfers) == s.layers
        assert s.exact(transfers)


def test_the_device_script_runs_only_commands_that_parse(bench, tmp_path):
    """Every tools/bench.py command tools/gpu_bench.sh would run (DRY=1 prints them) is accepted as written."""
    if not shutil.which("bash"):
        pytest.skip("no bash")
    env = dict(os.environ, DRY="1", OUT=str(tmp_path), STEPS="build tests layouts cta layered grid sglang")
    out = subprocess.run(["bash", str(ROOT / "tools" / "gpu_bench.sh")], env=env, capture_output=True, text=True,
                         cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    commands = [line.split("tools/bench.py", 1)[1].split() for line in out.stdout.splitlines()
                if "tools/bench.py" in line and not line.startswith("==")]
    assert {c[0] for c in commands} == {"layouts", "cta", "layered", "grid", "releases", "sglang-pool"}
    for argv in commands:
        bench._parser().parse_args(argv)
    assert "python3 -m pytest -q -m gpu" in out.stdout
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_layouts_runs_through_on_the_cpu_every_layout_bit_exact(bench, tmp_path, capsys):
    result = tmp_path / "layouts.jsonl"
    code = bench.main(["layouts", "--smoke", "--pages", "64", "--tokens", "16384", "--out", str(result)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    header, *rows = _lines(result)
    assert header["kind"] == "run" and header["bench"] == "layouts"
    assert {"command", "date", "torch", "commit"} <= set(header) and "layouts --smoke" in header["command"]
    cells = {(r["layout"], r["op"]) for r in rows}
    assert cells == {(layout, op) for layout in ("layer_first", "page_first", "page_first_direct")
                     for op in ("load", "backup")}
    assert sorted(r["provider"] for r in rows if r["layout"] == "page_first" and r["op"] == "load") == \
        ["auto", "contiguous", "direct", "kernel"]
    for r in rows:
        assert r["exact"] is (None if r["provider"] == "contiguous" else True), r
        assert r["alone_gbps"] > 0 and "beside_ratio" in r and "slowdown" in r, r
        assert ("first_layer_s" in r) == (r["op"] == "load" and r["provider"] != "contiguous"), r
    # The table at the end: one line per layout, page, tokens and op, one column per provider.
    table = printed[printed.index("layouts: ratio"):].splitlines()
    assert table[1] == "| layout | page | tokens | op | contiguous | kernel | direct | auto |"
    assert len([line for line in table if line.startswith("| page_first_direct | 64 | 64 | ")]) == 3  # load, backup
    assert "layouts, loads alone: ms to layer 0 / to the last layer" in table                     # and load times
    # `report` prints the same table again from the file.
    assert bench.main(["report", str(result)]) == 0
    again = capsys.readouterr().out
    assert all(line in again for line in table if line.startswith("|"))


def test_layouts_takes_a_provider_named_on_the_command_line_and_goes_on_past_one_that_fails(bench, tmp_path,
                                                                                            capsys):
    result = tmp_path / "layouts.jsonl"
    code = bench.main(["layouts", "--smoke", "--layouts", "page_first_direct", "--pages", "64", "--tokens", "64",
                       "--ops", "load", "--no-beside", "--providers", "direct", "copy2d=direct/cpu/2d",
                       "broken=no-such-backend", "--out", str(result)])
    assert code == 1  # the failing provider makes the run fail; its row says why
    rows = {r["provider"]: r for r in _lines(result)[1:]}
    assert rows["copy2d"]["exact"] and rows["copy2d"]["direct_mode"] == "2d" and rows["copy2d"]["io_backend"] == "direct"
    assert rows["broken"]["error"].startswith("ValueError: Unsupported IO backend")
    assert "beside_ratio" not in rows["direct"]
    assert "| page_first_direct | 64 | 64 | load |" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["nope", "=direct", "x=direct/gpu", "x=a/cpu/b/c"])
def test_a_bad_provider_name_is_refused(text):
    sys.path.insert(0, str(ROOT / "tools"))
    from benchmarks import layouts

    with pytest.raises(ValueError):
        layouts.parse_provider(text)


def test_cta_runs_through_on_the_cpu_with_the_layer_views_and_rows_the_kernel_gets(bench, tmp_path, capsys):
    result = tmp_path / "cta.jsonl"
    code = bench.main(["cta", "--smoke", "--layouts", "page_first_direct", "page_first", "layer_first",
                       "--pages", "64", "--tokens", "16384", "--out", str(result)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    rows = _lines(result)[1:]
    assert {r["provider"] for r in rows} == {"contiguous", "q1", "q2", "q4", "default"}
    assert all(r["exact"] for r in rows if r["provider"] != "contiguous")
    assert [r.get("quota") for r in rows if r["layout"] == "page_first" and r["op"] == "load"][1:] == [1, 2, 4, None]
    assert "| layout | page | tokens | op | contiguous | q1 | q2 | q4 | default |" in printed


def test_plan_cost_writes_a_row_per_stage(bench, tmp_path):
    result = tmp_path / "plan.jsonl"
    assert bench.main(["plan-cost", "--pages", "16", "--out", str(result)]) == 0
    stages = [r["stage"] for r in _lines(result)[1:]]
    assert stages[:2] == ["find_runs", "plan_runs (pages)"] and len(stages) == 8
    assert stages[-2:] == ["staged backup plan (8192 tokens, 4 chunks, K and V)", "staged backup, a plan per chunk (4 x 2048)"]


@pytest.mark.skipif(not shutil.which("cc"), reason="host-cost compiles a no-op launcher with cc")
def test_host_cost_writes_a_row_per_call(bench, tmp_path):
    result = tmp_path / "host.jsonl"
    assert bench.main(["host-cost", "--rounds", "1", "--calls", "5", "--out", str(result)]) == 0
    rows = _lines(result)[1:]
    assert len(rows) >= 8 and all(r["tree"] == "this tree" and r["us_per_call"] > 0 for r in rows)


@pytest.mark.skipif(not shutil.which("cc") or not shutil.which("git"), reason="host-cost --baseline needs cc and git")
def test_host_cost_times_a_baseline_revision_beside_this_tree(bench, tmp_path, capsys, monkeypatch):
    """--baseline REV times REV's package (exported by git archive, timed in a child process with this
    harness): one row per case and tree, and the temp export is gone afterwards."""
    import tempfile

    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("host-cost --baseline needs a git checkout")
    exports = tmp_path / "tmp"
    exports.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(exports))
    result = tmp_path / "host.jsonl"
    assert bench.main(["host-cost", "--baseline", "HEAD", "--rounds", "1", "--calls", "3", "--out", str(result)]) == 0
    rows = _lines(result)[1:]
    trees = {r["tree"] for r in rows}
    assert trees == {"HEAD", "this tree"}
    for tree in trees:
        assert len([r for r in rows if r["tree"] == tree]) >= 8
    assert "HEAD" in capsys.readouterr().out
    assert not list(exports.glob("hicache-host-cost-*"))  # (the no-op launcher's folder stays until exit)


def test_releases_runs_each_release_with_and_without_the_kernel(bench, tmp_path, capsys):
    for name in ("sglang-0.5.9", "standin-0.5.9", "sglang-0.5.10", "standin-0.5.10"):
        (tmp_path / name).mkdir()
    cells = tmp_path / "cells.py"
    cells.write_text(textwrap.dedent("""
        import json, os, sys
        assert sys.argv[1] == "construct"
        bad = os.environ["SGLANG_HICACHE_JIT_DISABLE"] == "1" and "sglang-0.5.10" in os.environ["PYTHONPATH"]
        print(json.dumps({"cell": "mla page_first", "ok": not bad, "error": "boom" if bad else ""}))
        print(json.dumps({"summary": {"cells": 1, "failed": int(bad)}}))
        sys.exit(int(bad))
    """))
    result = tmp_path / "releases.jsonl"
    code = bench.main(["releases", "--trees", str(tmp_path), "--cells", str(cells), "--mode", "construct",
                       "--logs", str(tmp_path / "logs"), "--out", str(result)])
    assert code == 1
    rows = {(r["release"], r["disable"]): r for r in _lines(result)[1:]}
    assert sorted(rows) == [("0.5.10", 0), ("0.5.10", 1), ("0.5.9", 0), ("0.5.9", 1)]
    assert rows["0.5.10", 1]["failed"] == [{"cell": "mla page_first", "error": "boom"}]
    assert rows["0.5.9", 1]["rc"] == 0 and rows["0.5.9", 1]["summary"] == {"cells": 1, "failed": 0}
    assert (tmp_path / "logs" / "cells-0.5.10-1.jsonl").exists()
    assert "sglang 0.5.10 DISABLE=1 rc=1: 1 cells, 1 failed" in capsys.readouterr().out


def test_grid_writes_the_cli_records_as_rows(bench, tmp_path, monkeypatch):
    import torch

    from sglang_hicache_jit.bench import modes

    record = dict(workload="mla-bf16", scope="one", direction="h2d", page_size=64, tokens=1024, provider="ceiling",
                  gbps=50.0, ratio=None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(modes.MODES, "transfer", lambda args, records: records.append(dict(record)))
    result = tmp_path / "grid.jsonl"
    assert bench.main(["grid", "-q", "--out", str(result)]) == 0
    header, row = _lines(result)
    assert header["bench"] == "grid" and row["bench"] == "grid" and row["workload"] == "mla-bf16"


def test_workloads_beside_counts_at_least_one_transfer_on_the_cpu_stand_in():
    sys.path.insert(0, str(ROOT / "tools"))
    from benchmarks.harness import CpuCuda

    from sglang_hicache_jit.bench import workloads

    calls = []
    got = workloads.beside(lambda: calls.append(1), lambda: sum(range(1000)), window_s=0.001, cuda=CpuCuda)
    assert got["calls"] == got["issued"] == len(calls) == 1
    assert got["seconds"] >= 0 and got["load_alone_s"] > 0 and got["slowdown"] > -1
