"""Runs jobs (commands) side by side under one deadline, so whatever finished comes back when time is up.

Each job runs in its own process session with its output in its own log file; a job past its own
timeout, or still running when the deadline comes, is stopped with its whole process group (SIGTERM,
then SIGKILL): an SGLang engine's scheduler and detokenizer processes go with it. A job is not started
when less than its expected duration is left before the deadline. Jobs at or past ``hold_after`` in the
list wait until ``hold_s`` seconds have passed or a job has ended, so the first ones can fill the JIT
caches the others reuse. Jobs of one GPU share the GPUs (small engines fit side by side); a job of several
GPUs (``gpus`` > 1) runs alone, and is not started where the machine has fewer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Job:
    name: str
    argv: list
    env: dict = field(default_factory=dict)
    timeout: float = 300.0
    expect: float = 60.0  # seconds it is expected to take; not started with less left
    gpus: int = 1  # > 1: spans that many GPUs, runs alone


@dataclass
class Outcome:
    name: str
    status: str  # "done", "failed", "timeout", "deadline", "not started"
    rc: int | None = None
    seconds: float = 0.0
    log: str = ""


def _stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _die_with_parent() -> None:
    """In the child, before it runs: Linux kills it if the runner dies (a runner killed by a timeout must not
    leave engines running; each sits in its own process group, which nothing else would stop)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the deadline and the timeouts still stop jobs
        pass


def run(jobs: list, *, parallel: int, deadline: float, log_dir: Path, hold_after: int = 0, hold_s: float = 0.0,
        gpus: int = 1, poll: float = 0.5, clock=time.monotonic, on_done=None) -> list:
    """Runs ``jobs`` in order, ``parallel`` at a time (and within ``gpus`` GPUs), until ``deadline`` (a
    ``clock()`` value). Returns one Outcome per job, in the jobs' order."""
    log_dir.mkdir(parents=True, exist_ok=True)
    start = clock()
    pending = list(enumerate(jobs))
    running: dict = {}  # index -> (proc, started, log file)
    outcomes: dict = {}
    while pending or running:
        now = clock()
        for index, (proc, started, log) in list(running.items()):
            job = jobs[index]
            rc = proc.poll()
            status = None
            if rc is not None:
                status = "done" if rc == 0 else "failed"
            elif now - started > job.timeout:
                status = "timeout"
            elif now >= deadline:
                status = "deadline"
            if status is None:
                continue
            if rc is None:
                _stop(proc)
                rc = proc.returncode
            log.close()
            outcomes[index] = Outcome(job.name, status, rc, round(clock() - started, 1), log.name)
            del running[index]
            if on_done is not None:
                on_done(outcomes[index])
        alone = any(jobs[i].gpus > 1 for i in running)
        while pending and len(running) < parallel and not alone:
            index, job = pending[0]
            if clock() + min(job.expect, job.timeout) > deadline:
                for i, skipped in pending:
                    outcomes[i] = Outcome(skipped.name, "not started")
                pending = []
                break
            if index >= hold_after and clock() - start < hold_s and running and not outcomes:
                break
            if job.gpus > gpus:
                pending.pop(0)
                outcomes[index] = Outcome(job.name, "not started", log=f"needs {job.gpus} GPUs, {gpus} here")
                continue
            if job.gpus > 1 and running:
                break
            pending.pop(0)
            log = open(log_dir / f"{job.name}.log", "w")
            proc = subprocess.Popen(job.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **job.env}, preexec_fn=_die_with_parent)
            running[index] = (proc, clock(), log)
            alone = job.gpus > 1
        if pending or running:
            time.sleep(poll)
    return [outcomes[i] for i in range(len(jobs))]
