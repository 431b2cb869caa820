"""What every workload of tools/bench.py shares besides the setup in sglang_hicache_jit/bench/workloads.py:
the result file (JSON lines: one header, then one line per row), the facts of the machine in the header,
and the CPU stand-in for ``torch.cuda`` that --smoke runs on.

A result file::

    {"kind": "run", "bench": "layouts", "command": "tools/bench.py layouts ...", "date": "...",
     "gpu": "NVIDIA H200", "driver": "580.159.04", "torch": "2.11.0+cu130", "cuda": "13.0", ...}
    {"kind": "row", "bench": "layouts", "layout": "page_first", ...}
    ...

``bench`` names the workload of tools/bench.py (rows may carry a ``workload`` of their own: the CLI's
model shapes, mla-bf16 and the others). Each line is written and flushed as soon as it is known, so a run stopped by ``timeout`` keeps its rows.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def _run(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def facts(*, gpu: bool, command: str | None = None) -> dict:
    """The header's facts: date, command, versions, and with ``gpu`` the GPU and its driver."""
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command or shlex.join(sys.argv),
            "python": platform.python_version(), "host_cpus": os.cpu_count(),
            "commit": _run(["git", "rev-parse", "--short", "HEAD"]),
            "dirty": bool(_run(["git", "status", "--porcelain", "--untracked-files=no"]))}
    try:
        import torch
    except ImportError:
        return info
    info.update(torch=torch.__version__, cuda=torch.version.cuda)
    if gpu and torch.cuda.is_available():
        try:
            info["gpu"] = torch.cuda.get_device_name()
            info["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
        except RuntimeError as exc:  # a GPU torch cannot reach: the workload will say so itself
            info["gpu"] = f"unavailable: {exc}"
        info["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return info


class Results:
    """Rows of one workload run: printed by the workload, written here as JSON lines (``path``, or
    nowhere), and kept in ``rows``."""

    def __init__(self, path: str | None, workload: str, *, gpu: bool, command: str | None = None,
                 args: dict | None = None):
        self.rows: list[dict] = []
        self.workload = workload
        self._file = None
        self.header = {"kind": "run", "bench": workload, **facts(gpu=gpu, command=command), "args": args or {}}
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")
            self._write(self.header)

    def _write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, default=str) + "\n")
            self._file.flush()

    def row(self, **fields) -> dict:
        record = {"kind": "row", "bench": self.workload, **fields}
        self.rows.append(record)
        self._write(record)
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read(path: str) -> tuple[list[dict], list[dict]]:
    """(headers, rows) of a result file; several runs may be appended to one file."""
    headers, rows = [], []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            (headers if record.get("kind") == "run" else rows).append(record)
    return headers, rows


# --------------------------------------------------------------------------------------------------------
# --smoke: the torch.cuda calls the timers make, answered on the CPU. Work runs at once on the host, so an
# event's time is the host clock when it was recorded; rates measured this way mean nothing, but every
# line of a workload runs and its bit-exact checks hold.

class CpuEvent:
    def __init__(self, enable_timing: bool = False):
        self.t = None

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "CpuEvent") -> float:
        return (end.t - self.t) * 1e3


class CpuStream:
    cuda_stream = 0

    def __init__(self, priority: int = 0):
        self.priority = priority

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


class CpuCuda:
    """Stands in for ``torch.cuda`` in the benchmark timers (workloads.time_call, workloads.beside)."""

    Event = CpuEvent
    Stream = CpuStream

    @staticmethod
    def synchronize() -> None:
        pass

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext(stream)

    @staticmethod
    def empty_cache() -> None:
        pass
