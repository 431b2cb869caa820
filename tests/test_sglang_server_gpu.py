"""GPU: real SGLang servers with the plugin on and off (issue 29). Minutes per run, so only on request:

    SGLANG_SERVER_TESTS=1 python3 -m pytest -q -m gpu tests/test_sglang_server_gpu.py

with SGLang, sgl-kernel and their dependencies importable (on the offline GPU machine, tools/gpu_server.sh
installs the carry and runs the same modes with a time box; this file is the pytest face of it). Each
test runs tools/sglang_server/main.py and requires its verdict: for every configuration the three
modes identical in token ids and logprobs, the negative control different, host hits counted, no
error line in any engine's log, and the plugin's start and per-pool lines in every plugin run's log.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.gpu


def _ready():
    if os.environ.get("SGLANG_SERVER_TESTS") != "1":
        pytest.skip("real SGLang servers take minutes: set SGLANG_SERVER_TESTS=1 (tools/gpu_server.sh does it all)")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        import sglang.srt.entrypoints.engine  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"needs a full SGLang install (python3 tools/sglang_carry.py --server 0.5.17): {exc}")
    from importlib.metadata import version

    return version("sglang")


@pytest.mark.parametrize("mode", ["smoke", "matrix"])
def test_real_servers_serve_the_same_bytes(tmp_path, mode):
    release = _ready()
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "sglang_server" / "main.py"), mode, "--release",
                           release, "--out", str(out), "--work", str(tmp_path / "work"),
                           "--budget-s", os.environ.get("SGLANG_SERVER_BUDGET_S", "900")],
                          capture_output=True, text=True, timeout=1200)
    summary = out / f"{mode}-summary.json"
    assert summary.is_file(), f"main.py wrote no {summary.name} (rc {proc.returncode}):\n" + \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(summary.read_text())
    failing = [v for v in result["configurations"] if v["verdict"] != "pass"]
    assert result["configurations"], "no configuration finished: " + proc.stdout[-3000:]
    assert result["passed"], json.dumps(failing, indent=1)[:6000] + proc.stdout[-2000:]
