"""tools/soak_direct.py (issue 26): its --smoke run on the CPU, that its checks catch a wrong copy, and that its
watchdog reports a hang; on a GPU, a short real soak."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "soak_direct.py"


@pytest.fixture(scope="module")
def soak():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import soak_direct
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return soak_direct


def test_a_smoke_run_covers_every_layout_both_ways_and_holds(soak, tmp_path, capsys):
    out = tmp_path / "soak.json"
    code = soak.main(["--smoke", "--device", "cpu", "--seconds", "0.5", "--threads", "2", "--out", str(out)])
    document = json.loads(out.read_text())
    assert code == 0 and document["ok"] and document["finished"], document["failures"]
    assert document["failed"] == 0 and document["hang"] is None and document["threads"] == 2
    assert document["calls"] > 20 and document["copies"] >= document["calls"] and document["bytes"] > 0
    assert set(document["layouts"]) == {f"{d} {layout}" for d in ("h2d", "d2h") for layout in soak.LAYOUTS}
    assert document["modes"] == {"torch": document["calls"]} and document["machine"]["device"] == "cpu"
    assert document["totals"] == {"copies": document["copies"], "bytes": document["bytes"], "errors": 0}
    assert document["ragged_calls"] > 0 and set(document["rows"]) <= {str(r) for r in soak.ROW_BYTES}
    assert {132, 256, 512, 576, 656, 1152, 2048, 4096} == set(soak.ROW_BYTES) == set(document["row_bytes"])
    assert "every check held" in capsys.readouterr().out


def _corrupt(soak, monkeypatch, how):
    real = soak.direct.copy_runs

    def wrong(pairs, runs, *, mode="auto"):
        if how == "dropped" and len(runs) > 1:  # the last run is never copied
            runs = soak.direct.Runs(runs.dst_start[:-1], runs.src_start[:-1], runs.length[:-1])
        ran = real(pairs, runs, mode=mode)
        if how == "stray":  # one more byte written, in the destination's last row
            pairs.dst[0].tensor[-1, 0] ^= 0x5A
        return ran

    monkeypatch.setattr(soak.direct, "copy_runs", wrong)


@pytest.mark.parametrize("how", ["dropped", "stray"])
def test_a_wrong_copy_is_caught_and_fails_the_run(soak, tmp_path, monkeypatch, capsys, how):
    _corrupt(soak, monkeypatch, how)
    out = tmp_path / "soak.json"
    code = soak.main(["--smoke", "--device", "cpu", "--seconds", "0.3", "--threads", "1", "--audit-every", "1",
                      "--out", str(out)])
    document = json.loads(out.read_text())
    assert code == soak.EXIT_FAILED and not document["ok"] and document["failed"] > 0
    assert document["totals"]["errors"] == document["failed"]
    problems = " ".join(f["problem"] for f in document["failures"])
    assert "rows differ from the source" in problems or "outside the addressed rows" in problems
    assert "FAILED" in capsys.readouterr().err


def test_a_write_outside_the_destination_is_caught(soak, monkeypatch):
    regions = []
    real_region = soak.Region.__init__

    def keep(self, *args, **kwargs):
        real_region(self, *args, **kwargs)
        regions.append(self)

    monkeypatch.setattr(soak.Region, "__init__", keep)
    real = soak.direct.copy_runs

    def past_the_end(pairs, runs, *, mode="auto"):
        ran = real(pairs, runs, mode=mode)
        for region in regions:
            region.buffer[-1] = 0  # the last guard byte of every buffer
        return ran

    monkeypatch.setattr(soak.direct, "copy_runs", past_the_end)
    args = soak.parse(["--smoke", "--device", "cpu", "--seconds", "0.2", "--threads", "1"])
    document = soak.run(args)
    assert not document["ok"] and "a guard byte around the destination changed" in document["failures"][0]["problem"]


def test_the_watchdog_reports_a_hang_and_exits(tmp_path):
    out = tmp_path / "soak.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(TOOL), "--smoke", "--device", "cpu", "--seconds", "60", "--threads",
                           "2", "--hang-seconds", "1", "--simulate-hang", "3", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert time.monotonic() - started < 50  # well before --seconds: the hang ended it
    assert "HANG: thread 0 made no progress" in proc.stderr and "in call 3" in proc.stderr
    document = json.loads(out.read_text())
    assert document["hang"]["thread"] == 0 and document["hang"]["call"] == 3 and document["finished"] is False
    assert document["ok"] is False and "--simulate-hang" in document["hang"]["what"]


@pytest.mark.parametrize("argv, words", [(["--threads", "0"], "--threads must be at least 1"),
                                         (["--seconds", "-1"], "--seconds must be above 0"),
                                         (["--row-bytes", "132,x"], "not a comma-separated list"),
                                         (["--row-bytes", "0"], "at least 1 byte"),
                                         (["--max-pages", "0"], "--max-pages must be at least 1")])
def test_bad_options_are_one_clear_error(soak, capsys, argv, words):
    with pytest.raises(SystemExit) as exit_:
        soak.parse(["--smoke", *argv])
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_an_out_path_that_is_a_directory_is_refused(soak, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        soak.parse(["--smoke", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and "is a directory" in capsys.readouterr().err


def test_a_row_bytes_list_limits_the_rows(soak, tmp_path):
    out = tmp_path / "soak.json"
    assert soak.main(["--smoke", "--device", "cpu", "--seconds", "0.5", "--threads", "1", "--row-bytes", "132,656",
                      "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    assert set(document["rows"]) <= {"132", "656"} and document["row_bytes"] == [132, 656]


def test_without_a_gpu_only_the_smoke_runs(soak):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="--smoke checks its logic on the CPU"):
        soak.run(soak.parse(["--seconds", "1"]))


@pytest.mark.gpu
def test_a_short_soak_on_the_gpu_holds(soak, tmp_path):
    """Twenty seconds with small buffers: the GPU path of the tool itself (the standing soak runs minutes)."""
    out = tmp_path / "soak.json"
    code = soak.main(["--seconds", "20", "--threads", "2", "--host-mib", "256", "--device-mib", "256",
                      "--mode", "mixed", "--out", str(out)])
    document = json.loads(out.read_text())
    assert code == 0 and document["ok"], document["failures"]
    assert set(document["modes"]) <= {"batch", "2d"} and document["calls"] > 10 and document["errors"] == 0
    assert set(document["rows"]) <= {str(r) for r in soak.ROW_BYTES}
    assert document["machine"]["gpu"] and document["machine"]["runtime"]
