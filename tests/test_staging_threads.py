"""One staging area (transfer/staging.py PageStaging) shared by two threads on two streams, without a GPU.

The GPU test (tests/test_staging_gpu.py::test_two_threads_on_two_streams_share_one_staging_area_without_loss)
finds a lost backup only when the threads happen to interleave badly. Here the interleaving is forced: thread A
stops inside its first gather, with staging buffer 0 filled but not yet copied to the host, and does not go on
until thread B has either reached the area's serialization (the lock) or gathered into a buffer itself. So a
submission that is not serialized always shows, three ways:

* B gathers into a buffer that A has gathered into and not yet copied out (recorded by the gather and copy
  wrappers, as "entered while held");
* on the stand-in streams (vector clocks: an op on a stream, an event recorded on it, a wait on an event or a
  stream), two ops on one staging buffer from different streams, one of them a gather, are not ordered one
  before the other: on a GPU that is a race on the buffer;
* A's host slots end up holding B's device rows (on the CPU every op runs when submitted, so B's gather really
  overwrites A's staged rows before A's copy reads them).

The area runs on the CPU (``device="cpu"``: its copies go through direct.py's CPU path, its gathers through
staging.torch_gather); only the torch.cuda stream, event and capture queries staging.py makes are stubbed.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from sglang_hicache_jit.transfer import direct, staging

LAYERS, ROW, DEVICE_ROWS = 3, 8, 256
CHUNK_BLOCKS = 4  # host blocks per staging buffer: a 16-token backup is several chunks through both buffers
HANG_GUARD_S = 5.0  # only reached when the test is broken (a thread that never arrives), never on a pass


# ---------------------------------------------------------------------------
# Stand-in CUDA streams and events: per-thread current stream, and happens-before through vector clocks.

class FakeStream:
    def __init__(self, name: str):
        self.name = name
        self.clock: dict = {self: 0}

    def __repr__(self):
        return f"<stream {self.name}>"

    def tick(self) -> dict:
        """An op submitted on this stream: its position, and everything it is ordered after."""
        self.clock[self] = self.clock.get(self, 0) + 1
        return dict(self.clock)

    def _join(self, clock: dict) -> None:
        for stream, position in clock.items():
            self.clock[stream] = max(self.clock.get(stream, 0), position)

    def wait_event(self, event: FakeEvent) -> None:
        self._join(event.clock)  # an event never recorded waits for nothing, as on a GPU

    def wait_stream(self, other: FakeStream) -> None:
        self._join(other.clock)


class FakeEvent:
    def __init__(self, *args, **kwargs):
        self.clock: dict = {}

    def record(self, stream: FakeStream | None = None) -> None:
        self.clock = dict((stream or _current_stream()).clock)


_DEFAULT_STREAM = FakeStream("default")
_local = threading.local()


def _current_stream(device=None) -> FakeStream:
    return getattr(_local, "stream", _DEFAULT_STREAM)


@contextlib.contextmanager
def _use_stream(stream: FakeStream):
    saved = _current_stream()
    _local.stream = stream
    try:
        yield
    finally:
        _local.stream = saved


def _happens_before(first: dict, second: dict) -> bool:
    """Op ``first`` (the clock it was submitted with) is ordered before op ``second``."""
    stream = first["stream"]
    return first["clock"][stream] <= second["clock"].get(stream, 0)


@pytest.fixture
def fake_streams(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", _current_stream)
    monkeypatch.setattr(torch.cuda, "stream", _use_stream)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: FakeStream("side"))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)


# ---------------------------------------------------------------------------

def _device_layers() -> list:
    """Per layer, the device pool's rows; every element names its layer, row and column."""
    r = torch.arange(DEVICE_ROWS, dtype=torch.int32)[:, None]
    c = torch.arange(ROW, dtype=torch.int32)[None, :]
    return [(l * 1_000_000 + r * 100 + c).contiguous() for l in range(LAYERS)]


def _host_rows(host: torch.Tensor, page: int, slot: int, layer: int) -> torch.Tensor:
    return host[slot, layer] if page == 1 else host[slot // page, layer, slot % page]


@pytest.mark.parametrize("side_stream", [False, True], ids=["caller-stream", "side-stream"])
@pytest.mark.parametrize("page", [1, 4], ids=["page_first", "page_first_direct"])
def test_a_second_thread_waits_for_the_first_ones_staged_backup(fake_streams, monkeypatch, page, side_stream):
    monkeypatch.setattr(staging, "GATHER_ON_SIDE_STREAM", side_stream)
    layers = _device_layers()
    tokens = 4 * CHUNK_BLOCKS * page  # four chunks each: both buffers filled twice per backup
    slots = 2 * tokens
    shape = (slots, LAYERS, ROW) if page == 1 else (slots // page, LAYERS, page, ROW)
    host = torch.zeros(shape, dtype=torch.int32)
    block_bytes = LAYERS * page * ROW * host.element_size()
    area = staging.PageStaging([host], budget_bytes=2 * CHUNK_BLOCKS * block_bytes, device="cpu",
                               device_rows=DEVICE_ROWS, gather=staging.torch_gather([layers]), page_size=page)
    assert area.chunk_blocks == CHUNK_BLOCKS

    jobs = {"A": (torch.arange(0, tokens), torch.arange(10, 10 + tokens)),  # distinct host slots and device rows
            "B": (torch.arange(tokens, 2 * tokens), torch.arange(128, 128 + tokens))}
    streams = {name: FakeStream(name) for name in jobs}

    guard = threading.Lock()  # the instrumentation's own bookkeeping, not the area's
    ops: list[dict] = []  # every gather and copy, in submission order
    holder = {0: None, 1: None}  # which thread's staged rows a buffer holds until that thread copies them out
    last_gathered: dict = {}
    entered_while_held: list[str] = []
    a_gathered, b_arrived = threading.Event(), threading.Event()
    contention: list[bool] = []

    def log(kind: str, buffer: int) -> None:
        stream = _current_stream()
        ops.append({"kind": kind, "buffer": buffer, "who": _local.name, "stream": stream, "clock": stream.tick()})

    real_gather = area.gather

    def gather(b, views, rows, device_indices):
        real_gather(b, views, rows, device_indices)
        with guard:
            log("gather", b)
            if holder[b] not in (None, _local.name):
                entered_while_held.append(f"{_local.name} gathered into buffer {b} holding {holder[b]}'s rows")
            holder[b], last_gathered[_local.name] = _local.name, b
            first_of_a = _local.name == "A" and not a_gathered.is_set()
        if first_of_a:  # buffer 0 holds A's rows, not yet copied out: let B in and see what it does
            a_gathered.set()
            assert b_arrived.wait(HANG_GUARD_S), ("B reached neither the staging area's lock nor a gather: the "
                                                  "area's serialization changed, so this test must follow it")
        elif _local.name == "B":
            b_arrived.set()

    area.gather = gather
    real_run = direct.CopyPlan.run

    def run(self, pairs, *args, **kwargs):
        result = real_run(self, pairs, *args, **kwargs)
        if pairs is area.pairs:
            with guard:
                b = last_gathered[_local.name]
                log("copy", b)
                if holder[b] == _local.name:
                    holder[b] = None
        return result

    monkeypatch.setattr(direct.CopyPlan, "run", run)

    class ProbeLock:
        """The area's lock, telling when B comes to it (and whether A holds it then)."""

        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            if _local.name == "B":
                free = self.lock.acquire(blocking=False)
                contention.append(not free)
                b_arrived.set()
                if free:
                    return self
            self.lock.acquire()
            return self

        def __exit__(self, *exc):
            self.lock.release()

    area._lock = ProbeLock(area._lock)

    errors: list[BaseException] = []

    def worker(name: str) -> None:
        _local.name = name
        try:
            if name == "B":
                assert a_gathered.wait(HANG_GUARD_S), "A never gathered"
            host_indices, device_indices = jobs[name]
            with _use_stream(streams[name]):
                assert area.backup(host_indices, device_indices) is True
        except BaseException as exc:  # noqa: BLE001 (surfaced in the main thread)
            errors.append(exc)
            a_gathered.set()
            b_arrived.set()

    threads = [threading.Thread(target=worker, args=(name,), daemon=True) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * HANG_GUARD_S)
    assert not any(t.is_alive() for t in threads), "a backup thread hung"
    assert not errors, errors

    # B really came while A was mid-backup: it found the lock held (the interleaving was forced).
    assert contention == [True] or entered_while_held, contention
    assert not entered_while_held, entered_while_held
    races = [(x, y) for i, x in enumerate(ops) for y in ops[i + 1:]
             if x["buffer"] == y["buffer"] and x["stream"] is not y["stream"] and "gather" in (x["kind"], y["kind"])
             and not (_happens_before(x, y) or _happens_before(y, x))]
    assert not races, [f"{x['who']} {x['kind']} on {x['stream']} / {y['who']} {y['kind']} on {y['stream']}, "
                       f"buffer {x['buffer']}" for x, y in races[:4]]
    for name, (host_indices, device_indices) in jobs.items():
        for l in range(LAYERS):
            for slot, row in zip(host_indices.tolist(), device_indices.tolist()):
                assert torch.equal(_host_rows(host, page, slot, l), layers[l][row]), \
                    f"{name}'s host slot {slot} layer {l} does not hold device row {row}"
