"""Follows a compile child: all its output goes to the build log, its progress to the logger.

A cold build takes tens of seconds on a small machine. So that the person
waiting sees it move, each ninja step (``[i/N] ...``) is logged at INFO as it
finishes, and a heartbeat (what is being built, seconds so far, steps done)
follows whenever nothing was said for ``HEARTBEAT_SECONDS``. The build log
still receives every byte the child wrote, in order.

ninja prints a step when it finishes, not when it starts, when its output is
not a terminal: so the heartbeat names the last finished step, not the running one.
"""

from __future__ import annotations

import logging
import re
import subprocess
import threading
import time
from typing import BinaryIO

log = logging.getLogger("sglang_hicache_jit")

HEARTBEAT_SECONDS = 5.0
_STEP = re.compile(rb"^\[(\d+)/(\d+)\]\s*(.*)")
_OUTPUT = re.compile(rb"\s-o\s+(\S+)")


def describe_step(line: bytes) -> str | None:
    """'[2/3] nvcc ... -c x.cu -o x.cuda.o' -> '[2/3] x.cuda.o'; None for other lines."""
    match = _STEP.match(line.strip())
    if match is None:
        return None
    done, total, command = match.groups()
    outputs = _OUTPUT.findall(command)
    target = outputs[-1].rsplit(b"/", 1)[-1] if outputs else command[:60]
    return f"[{int(done)}/{int(total)}] {target.decode(errors='replace')}"


def follow(proc: subprocess.Popen, *, log_file: BinaryIO, what: str, heartbeat: float = HEARTBEAT_SECONDS) -> int:
    """Copies the output of ``proc`` (started with stdout=PIPE, stderr=STDOUT) into ``log_file`` while
    logging its steps and a heartbeat, until it exits; returns its exit code. ``what`` names the work in
    messages ('hicache_transfer for sm90'). If this thread is interrupted, the exception propagates at
    once: stopping the child (and its process group) is the caller's business."""
    started = time.monotonic()
    state = {"last_said": started, "step": None}
    lock = threading.Lock()

    def pump() -> None:
        for line in proc.stdout:
            log_file.write(line)
            log_file.flush()
            step = describe_step(line)
            if step is not None:
                with lock:
                    state["step"], state["last_said"] = step, time.monotonic()
                log.info("compiling %s: %s", what, step)

    reader = threading.Thread(target=pump, name="build-output", daemon=True)
    reader.start()
    while True:
        with lock:
            due = state["last_said"] + heartbeat
        try:
            code = proc.wait(timeout=max(0.05, due - time.monotonic()))
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        with lock:
            if now < state["last_said"] + heartbeat:
                continue  # a step was logged meanwhile
            state["last_said"] = now
            step = state["step"]
        log.info("compiling %s: %.0f s so far, %s", what, now - started,
                 f"last step done {step}" if step else "no step finished yet")
    reader.join(timeout=10)  # the rest of the output, after the child exited
    if not reader.is_alive():  # else a leftover grandchild still holds the pipe; closing would block on it
        proc.stdout.close()
    return code
