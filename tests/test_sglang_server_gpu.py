"""GPU: real SGLang servers with the plugin on and off (issue 29). Minutes per run, so only on request:

    SGLANG_SERVER_TESTS=1 python3 -m pytest -q -m gpu tests/test_sglang_server_gpu.py

with SGLang, sgl-kernel and their dependencies importable. On the offline GPU machine,
``bash tools/gpu_server.sh pytest`` installs the carry and runs this file (the smoke, in the call's time box;
``SGLANG_SERVER_MODES`` picks the modes, ``SGLANG_SERVER_BUDGET_S`` the engines' wall time,
``SGLANG_SERVER_OUT`` where the summaries go). Each test runs tools/sglang_server/main.py and requires its
verdict (``summary.py``): for every configuration every engine finished, the three modes identical in
token ids and logprobs, each negative control different on every host-hit request, host hits counted, the
package's ops moving the host-hit rows in every plugin engine's trace, no error line in any engine's log,
and the plugin's start and per-pool lines in every plugin run's log.

Asked for (``SGLANG_SERVER_TESTS=1``) and unable to run (no GPU, no SGLang), a test fails rather than
skips: a skipped server test shows nothing, and must not read as a pass where it was meant to run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.gpu


MODES = [m for m in os.environ.get("SGLANG_SERVER_MODES", "smoke,matrix").split(",") if m]


def _ready():
    if os.environ.get("SGLANG_SERVER_TESTS") != "1":
        pytest.skip("real SGLang servers take minutes: set SGLANG_SERVER_TESTS=1 (tools/gpu_server.sh pytest does it all)")
    try:
        import torch
    except ImportError as exc:
        pytest.fail(f"SGLANG_SERVER_TESTS=1 but torch does not import: {exc}")
    if not torch.cuda.is_available():
        pytest.fail("SGLANG_SERVER_TESTS=1 but no CUDA GPU is visible")
    try:
        import sglang.srt.entrypoints.engine  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"SGLANG_SERVER_TESTS=1 but SGLang does not import (python3 tools/sglang_carry.py --server "
                    f"0.5.17, then tools/gpu_server.sh): {exc}")
    from importlib.metadata import version

    return version("sglang")


@pytest.mark.parametrize("mode", MODES)
def test_real_servers_serve_the_same_bytes(tmp_path, mode):
    release = _ready()
    out = Path(os.environ.get("SGLANG_SERVER_OUT") or tmp_path / "out")
    budget = float(os.environ.get("SGLANG_SERVER_BUDGET_S", "900"))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "sglang_server" / "main.py"), mode, "--release",
                           release, "--out", str(out), "--work", str(tmp_path / "work"), "--budget-s", str(budget)],
                          capture_output=True, text=True, timeout=budget + 120)
    summary = out / f"{mode}-summary.json"
    assert summary.is_file(), f"main.py wrote no {summary.name} (rc {proc.returncode}):\n" + \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(summary.read_text())
    failing = [v for v in result["configurations"] if v["verdict"] != "pass"]
    assert result["configurations"], "no configuration finished: " + proc.stdout[-3000:]
    assert result["passed"], json.dumps(failing, indent=1)[:6000] + proc.stdout[-2000:]
