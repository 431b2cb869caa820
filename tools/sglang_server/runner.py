"""Runs jobs (commands) side by side under one deadline, so whatever finished comes back when time is up.

Each job runs in its own process session with its output in its own log file; a job past its own
timeout, or still running when the deadline comes, is stopped with every process it started (SIGTERM,
then SIGKILL): an SGLang engine's scheduler and detokenizer processes go with it. So are the processes a
job leaves behind when it ends by itself. A job's processes are its process group, and every process
that descends from it or carries its token in its environment (``HICACHE_RUNNER_JOB``, which children
inherit): a child that calls setsid() leaves the group, and once its parent exits it leaves the parent
links too, but not its environment. The runner is the child subreaper while it runs
(PR_SET_CHILD_SUBREAPER), so such orphans are reparented to it, not to init, and it reaps what it kills.
A job is not started when less than its expected duration is left before the deadline. Jobs at or past
``hold_after`` in the list wait until ``hold_s`` seconds have passed or a job has ended, so the first ones
can fill the JIT caches the others reuse. Jobs of one GPU share the GPUs (small engines fit side by side);
a job of several GPUs (``gpus`` > 1) runs alone, and is not started where the machine has fewer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
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


TOKEN = "HICACHE_RUNNER_JOB"
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37


def _processes() -> dict:
    """{pid: (ppid, state, start time)} of every process, from /proc ({} where there is none)."""
    table = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            table[int(name)] = (int(fields[1]), fields[0].decode(), int(fields[19]))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return table


def _token_of(pid: int) -> str | None:
    """The runner's job token in a process's environment (as it was at exec), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return None
    key = TOKEN.encode() + b"="
    for item in environ.split(b"\0"):
        if item.startswith(key):
            return item[len(key):].decode(errors="replace")
    return None


class Tracker:
    """Which processes belong to which job: by token (read once per process) and by parent links, remembered
    across polls, so a descendant stays a member after its parent is gone."""

    def __init__(self):
        self.tokens: dict = {}  # (pid, start) -> token or None
        self.members: dict = {}  # token -> {(pid, start)}

    def poll(self, roots: dict) -> None:
        """``roots``: {token: pid of the job's first process, or None once it has been reaped (its pid may be
        another process's by then)} of the jobs to follow."""
        table = _processes()
        children: dict = {}
        for pid, (ppid, state, start) in table.items():
            children.setdefault(ppid, []).append(pid)
            key = (pid, start)
            if key not in self.tokens and state != "Z":
                self.tokens[key] = _token_of(pid)
        for token, root in roots.items():
            known = self.members.setdefault(token, set())
            known |= {key for key, found in self.tokens.items() if found == token and key[0] in table
                      and table[key[0]][2] == key[1]}
            stack = [pid for pid, start in known if pid in table and table[pid][2] == start]
            stack += [root] if root is not None else []
            while stack:
                pid = stack.pop()
                for child in children.get(pid, ()):
                    key = (child, table[child][2])
                    if key not in known:
                        known.add(key)
                        stack.append(child)
        alive = {(pid, info[2]) for pid, info in table.items()}
        self.tokens = {key: token for key, token in self.tokens.items() if key in alive}

    def alive(self, token: str) -> list:
        """The job's processes still running (zombies are gone), never this one."""
        table = _processes()
        return [pid for pid, start in self.members.get(token, ()) if pid != os.getpid() and pid in table
                and table[pid][2] == start and table[pid][1] not in ("Z", "X")]


def _signal(pid: int, sig, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(pids) -> None:
    """Collects the exit status of the killed processes that are this runner's children (orphans it adopted)."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not ours (init reaps it), or already collected
            pass


def _stop(proc: subprocess.Popen, token: str, tracker: Tracker, grace: float = 5.0) -> None:
    """Stops the job: its process group and every process the tracker counts as the job's (the first process
    too, when it is still running), SIGTERM then SIGKILL; returns once they are gone or were sent SIGKILL."""
    killed = set()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        tracker.poll({token: proc.pid if proc.poll() is None else None})
        members = tracker.alive(token)
        if proc.poll() is None or members:
            _signal(proc.pid, sig, group=True)
        for pid in members:
            _signal(pid, sig)
        killed |= set(members)
        end = time.monotonic() + grace
        while time.monotonic() < end:
            if proc.poll() is not None and not tracker.alive(token):
                _reap(killed)
                return
            _reap(killed)
            time.sleep(0.05)
    proc.wait()
    _reap(killed)


def _subreaper(on: bool) -> bool:
    """Makes this process the child subreaper (or not); returns what it was. False where prctl is missing."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        before = ctypes.c_int(0)
        libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(before), 0, 0, 0)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)
        return bool(before.value)
    except (OSError, AttributeError):
        return False


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
    was_subreaper = _subreaper(True)
    try:
        return _run(jobs, parallel=parallel, deadline=deadline, log_dir=log_dir, hold_after=hold_after,
                    hold_s=hold_s, gpus=gpus, poll=poll, clock=clock, on_done=on_done)
    finally:
        _subreaper(was_subreaper)


def _run(jobs, *, parallel, deadline, log_dir, hold_after, hold_s, gpus, poll, clock, on_done) -> list:
    start = clock()
    pending = list(enumerate(jobs))
    running: dict = {}  # index -> (proc, started, log file, token)
    outcomes: dict = {}
    tracker = Tracker()
    prefix = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    while pending or running:
        now = clock()
        tracker.poll({token: proc.pid for proc, _, _, token in running.values()})
        for index, (proc, started, log, token) in list(running.items()):
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
            _stop(proc, token, tracker)  # a finished job's leftovers too
            rc = proc.returncode if rc is None else rc
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
            token = f"{prefix}-{index}"
            proc = subprocess.Popen(job.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **job.env, TOKEN: token}, preexec_fn=_die_with_parent)
            running[index] = (proc, clock(), log, token)
            alone = job.gpus > 1
        if pending or running:
            time.sleep(poll)
    return [outcomes[i] for i in range(len(jobs))]
