"""A second SGLang plugin, for the server tests only: weights that matter, a negative control, a trace.

``install(dest)`` writes a distribution (``sglang-server-harness``, entry point ``server_harness`` in
SGLang's ``sglang.srt.plugins`` group) into ``dest``; with ``dest`` and this folder's parent on
PYTHONPATH, SGLang's own ``load_plugins()`` runs ``register`` in each of its processes, beside
(or without) this package's plugin. It registers through SGLang's ``HookRegistry``:

* REPLACE of ``initialize_dummy_weights`` with ``weights.fill`` (``--load-format dummy`` then gives a
  model whose output depends on its prompt);
* with ``HICACHE_SERVER_CORRUPT=zero``, an AROUND hook on the MLA and MHA host pools'
  ``load_to_device_per_layer`` that zeroes, on the device, every row the pool has just loaded back from
  the host: the negative control, whose outputs must differ;
* with ``HICACHE_SERVER_STAGING_SIDE_STREAM=1``, the package's staged backups gather on a side stream
  (``staging.GATHER_ON_SIDE_STREAM``), for the A/B of where the gather runs;
* with ``HICACHE_SERVER_LOAD_QUOTA=<n>`` and/or ``HICACHE_SERVER_LOAD_METHOD=<method>`` (e.g. plain,
  resident), the package's one-layer copies take n CTAs and that copy method where the caller names none
  (SGLang names none), for the A/B of the loads' CTA budget and copy method;
* with ``HICACHE_SERVER_TRACE=<file>``, one JSON line per host pool built (its class, layout and row
  size, and what this package's plugin patched) and per load-back of each layer: the tokens the pool
  was asked to load, and ``ops``, the tokens each of this package's ops moved inside that call. So a
  run shows that load-back happened, and that the package (not sgl-kernel or SGLang's JIT kernel)
  moved the rows: the judge (``summary.py``) compares the ops' tokens with the host-hit tokens.
  Each all-layer backup gets a line too (``backup``: tokens and ops), and each load and backup a ``span``
  line: its GPU time on the stream it ran on, from CUDA events read without waiting (``Spans``). Each
  extend batch's forward pass gets a ``timeline`` line: its GPU time, and for a pass that consumes a
  load, the time from SGLang starting that load to the pass's start and end (``Timeline``).

How the ops are counted: once the first host pool is built (SGLang has applied every plugin's hooks
by then), every function of ``sglang_hicache_jit.integrations.sglang.ops`` bound by name in a loaded
``sglang``/``sgl_kernel`` module (where SGLang's REPLACE put it, in the pool modules among others) is
wrapped by a counter, under the same name. A call made while a pool's ``load_to_device_per_layer``
runs on the same thread adds its destination index count to that load's ``ops``.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import threading
import time
from pathlib import Path

NAME = "sglang-server-harness"
ENTRY = "server_harness"
_WEIGHTS = "sglang.srt.model_loader.weight_utils.initialize_dummy_weights"
_POOLS = ("sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost",
          "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost")
_START_LOADING = "sglang.srt.managers.cache_controller.HiCacheController.start_loading"
_FORWARD = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"
_lock = threading.Lock()  # the trace file
_span_lock = threading.Lock()  # Spans' state (never held while tracing)


def install(dest: Path) -> Path:
    """Writes the distribution's metadata into ``dest`` (put ``dest`` and ``tools/`` on PYTHONPATH)."""
    info = Path(dest) / "sglang_server_harness-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {NAME}\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{ENTRY} = sglang_server.harness_plugin:register\n")
    return Path(dest)


def trace(record: dict) -> None:
    path = os.environ.get("HICACHE_SERVER_TRACE")
    if not path:
        return
    record = dict(record, pid=os.getpid())
    with _lock, open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def dummy_weights(model, low: float = -1e-3, high: float = 1e-3, seed: int = 1234) -> None:
    """Replaces SGLang's initialize_dummy_weights (same parameters; the range is ours, see weights.py)."""
    from sglang_server.weights import fill

    trace({"event": "weights", "filled": fill(model, seed=seed)})


def device_rows(pool, device_pool, layer_id: int, is_draft: bool = False) -> list:
    """The device tensors a host pool's load of ``layer_id`` writes, in every release family."""
    if hasattr(pool, "_buffer_index_by_layer") and hasattr(pool, "device_kv_buffers"):  # MLA 0.5.23
        return [pool.device_kv_buffers[pool._buffer_index_by_layer[layer_id]]]
    if hasattr(pool, "device_k_buffers"):  # MHA 0.5.23
        return [pool.device_k_buffers[layer_id], pool.device_v_buffers[layer_id]]
    if getattr(pool, "device_kv_buffers", None) is not None:  # MLA 0.5.22
        return [pool.device_kv_buffers[layer_id]]
    layer = 0 if is_draft else layer_id - getattr(device_pool, "start_layer", 0)
    if hasattr(device_pool, "kv_buffer"):
        return [device_pool.kv_buffer[layer]]
    return [device_pool.k_buffer[layer], device_pool.v_buffer[layer]]


PACKAGE_OPS = "sglang_hicache_jit.integrations.sglang.ops"  # the module of the ops the package's plugin routes
_DESTINATION = ("dst_indices", "indices_dst")  # the names the ops give their destination indices
_load = threading.local()  # .ops: {op: tokens} of the load running on this thread, else absent
_wrapped: dict = {}  # bound function (a package op or SGLang's wrapper of one) -> its counting wrapper


def _destination(op) -> tuple:
    """(name, position or None) of ``op``'s destination index parameter; (None, None) if it has none. Found once
    per op: binding every call's arguments to the signature cost about 6 us a call (a load's 32 calls: 0.2 ms
    of the scheduler's time, in the plugin's engines only, where the counter runs)."""
    for position, (name, parameter) in enumerate(inspect.signature(op).parameters.items()):
        if name in _DESTINATION:
            positional = parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
            return name, position if positional else None
    return None, None


def _tokens(destination: tuple, args: tuple, kwargs: dict) -> int:
    """The destination index count of one call, as passed (by keyword or by position)."""
    name, position = destination
    value = kwargs.get(name) if name is not None else None
    if value is None and position is not None and position < len(args):
        value = args[position]
    return int(value.numel()) if hasattr(value, "numel") else 0


def package_op(value):
    """The package op that ``value`` is or calls: SGLang's REPLACE binds a wrapper made with
    ``functools.wraps(upstream)`` (so it bears upstream's name and module) that calls the hook it holds in
    its closure. None for anything else."""
    if not inspect.isfunction(value) or getattr(value, "__wrapped_by_harness__", False):
        return None
    if value.__module__ == PACKAGE_OPS:
        return value
    for cell in value.__closure__ or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if inspect.isfunction(inner) and inner.__module__ == PACKAGE_OPS:
            return inner
    return None


def counted(bound, op):
    """``bound`` (a package op, or SGLang's wrapper that calls ``op``), counting the tokens ``op`` moves inside
    a traced load under ``op``'s name. One wrapper per bound function, so every module gets the same."""
    if bound in _wrapped:
        return _wrapped[bound]
    destination = _destination(op)

    @functools.wraps(bound)
    def wrapper(*args, **kwargs):
        ops = getattr(_load, "ops", None)
        if ops is not None:
            ops[op.__name__] = ops.get(op.__name__, 0) + _tokens(destination, args, kwargs)
        return bound(*args, **kwargs)

    wrapper.__wrapped_by_harness__ = True
    _wrapped[bound] = wrapper
    return wrapper


def count_package_ops() -> int:
    """Wraps every package op bound by name in a loaded sglang or sgl_kernel module; returns how many names."""
    names = 0
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "sglang" or module_name.startswith(("sglang.", "sgl_kernel"))):
            continue
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for name, value in list(namespace.items()):
            # Functions only: a module may hold lazy proxies (0.5.23's sglang/__init__.py) whose attribute
            # lookup imports what they stand for, e.g. the engine, which needs uvloop.
            if not inspect.isfunction(value):
                continue
            if getattr(value, "__wrapped_by_harness__", False):
                names += 1
                continue
            op = package_op(value)
            if op is not None:
                namespace[name] = counted(value, op)
                names += 1
    return names


class Spans:
    """GPU time of the pools' transfers on the stream they run on, without waiting for the GPU: a CUDA event
    is recorded before and after, and each pair is read (one ``span`` trace line) once the GPU has passed
    its second event, at a later hook call or at ``flush``. A load's span runs from its first layer's
    start to its last layer's end; a backup's is the one call. Both include what the stream waits for
    (SGLang's write stream first waits for the compute stream). Each span also carries ``host_ms``: the
    time the calling thread (SGLang's scheduler) spent inside the pool's calls, summed over a load's
    layers, which shows a transfer that blocks the scheduler (a device sync, a pageable copy) where the
    GPU span alone cannot."""

    def __init__(self):
        self.pending = []  # [what, start event, end event]
        self.open_loads = {}  # id(pool) -> [start event, tokens, host seconds so far]

    @staticmethod
    def event():
        """A timing event recorded now on the current stream (None without a GPU)."""
        try:
            import torch
            if not torch.cuda.is_available():
                return None
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        except Exception:  # noqa: BLE001 - timing is an extra; never break a transfer
            return None

    def end(self, what: dict, start) -> None:
        if start is None:
            return
        end = self.event()
        if end is not None:
            self.pending.append((what, start, end))

    def flush(self, wait: bool) -> None:
        """Traces the spans whose end the GPU has passed (every one, waiting for it, with ``wait``)."""
        _drain(self, wait, lambda what, start, end: dict(what, event="span", ms=round(start.elapsed_time(end), 4)))


def _drain(owner, wait: bool, make) -> None:
    """Traces ``make(*item)`` for each item of ``owner.pending`` (a tuple whose last member is its end event)
    that the GPU has passed (every one, waiting for it, with ``wait``), and keeps the others pending."""
    done = []
    with _span_lock:
        keep = []
        for item in owner.pending:
            try:
                if not wait and not item[-1].query():
                    keep.append(item)
                    continue
                item[-1].synchronize()
                done.append(make(*item))
            except Exception:  # noqa: BLE001 - timing is an extra
                continue
        owner.pending = keep
    for record in done:
        trace(record)


_spans = Spans()


def _counting(call):
    """Runs ``call()`` with this thread's op counts; returns (its result, {op: tokens})."""
    outer = getattr(_load, "ops", None)
    _load.ops = {}
    try:
        return call(), _load.ops
    finally:
        _load.ops = outer


def load_hook(original, self, device_pool, host_indices, device_indices, layer_id, io_backend, **kwargs):
    layers = getattr(self, "layer_num", None)
    if int(layer_id) == 0:  # a load's first layer (SGLang's controller loads layers 0..layer_num-1 in order)
        with _span_lock:
            _spans.open_loads[id(self)] = [Spans.event(), int(device_indices.numel()), 0.0]
    began = time.perf_counter()
    result, ops = _counting(lambda: original(self, device_pool, host_indices, device_indices, layer_id, io_backend,
                                             **kwargs))
    host_s = time.perf_counter() - began
    with _span_lock:
        begun = _spans.open_loads.get(id(self))
        if begun is not None:
            begun[2] += host_s
            if layers is not None and int(layer_id) == layers - 1:
                del _spans.open_loads[id(self)]
                _spans.end({"of": "load", "pool": type(self).__name__, "tokens": begun[1], "layers": layers,
                            "io_backend": io_backend, "host_ms": round(begun[2] * 1e3, 4)}, begun[0])
    _spans.flush(wait=False)
    trace({"event": "load", "pool": type(self).__name__, "layer": int(layer_id), "tokens": int(device_indices.numel()),
           "io_backend": io_backend, "ops": ops, "corrupt": os.environ.get("HICACHE_SERVER_CORRUPT", "")})
    if os.environ.get("HICACHE_SERVER_CORRUPT") == "zero":
        for rows in device_rows(self, device_pool, layer_id, kwargs.get("is_draft", False)):
            rows.index_fill_(0, device_indices.to(rows.device).long(), 0)
    return result


def backup_hook(original, self, device_pool, host_indices, device_indices, io_backend, **kwargs):
    """Each all-layer backup: its tokens, the package's ops inside it, and its span on the stream."""
    start = Spans.event()
    began = time.perf_counter()
    result, ops = _counting(lambda: original(self, device_pool, host_indices, device_indices, io_backend, **kwargs))
    host_ms = round((time.perf_counter() - began) * 1e3, 4)
    tokens = int(device_indices.numel())
    with _span_lock:
        _spans.end({"of": "backup", "pool": type(self).__name__, "tokens": tokens, "io_backend": io_backend,
                    "host_ms": host_ms}, start)
    _spans.flush(wait=False)
    trace({"event": "backup", "pool": type(self).__name__, "tokens": tokens, "io_backend": io_backend, "ops": ops})
    return result


class Timeline:
    """Where a host hit's time goes: the GPU time from SGLang's controller starting a load to the forward pass
    that consumes it, and that pass's own time, beside the device hits' passes. So a host hit slower than
    its loads explain (issue 36) shows whether the time goes before the pass (the scheduler, the streams'
    order), inside it (waiting for layers, or kernels slowed beside the loads) or neither.

    ``start_loading_hook`` (AROUND ``HiCacheController.start_loading``) records an event on the scheduler's
    current stream as the load starts, and the scheduler's time in the call; ``forward_hook`` (AROUND
    ``TpModelWorker.forward_batch_generation``) records events before and after an extend batch's forward
    call on the current stream. A pass whose batch consumes a load (``hicache_consumer_index``, the id
    start_loading returned) is paired with it. Each pass gets one ``timeline`` trace line once the GPU has
    passed its end (read without waiting, as Spans): ``forward_ms`` (the pass, call to end), and for a pass
    with a load ``to_forward_ms`` (load start to the pass's start), ``to_end_ms`` (load start to the pass's
    end), ``host_to_forward_ms`` (scheduler's time, load start to the forward call) and
    ``start_loading_host_ms``. Decode batches are left out (they are many, and no load feeds them)."""

    def __init__(self):
        self.loads = {}  # producer id -> (event, perf_counter at start, host ms of start_loading)
        self.pending = []  # [(record, load event or None, forward start event, forward end event)]

    def flush(self, wait: bool) -> None:
        _drain(self, wait, self._record)

    @staticmethod
    def _record(what: dict, load, start, end) -> dict:
        record = dict(what, event="timeline", forward_ms=round(start.elapsed_time(end), 4))
        if load is not None:
            record.update(to_forward_ms=round(load.elapsed_time(start), 4), to_end_ms=round(load.elapsed_time(end), 4))
        return record


_timeline = Timeline()


def start_loading_hook(original, self, *args, **kwargs):
    event, began = Spans.event(), time.perf_counter()
    producer = original(self, *args, **kwargs)
    if isinstance(producer, int) and producer >= 0 and event is not None:
        with _span_lock:
            if len(_timeline.loads) > 64:  # a load no pass consumed (e.g. an aborted request): never grows
                _timeline.loads.clear()
            _timeline.loads[producer] = (event, began, round((time.perf_counter() - began) * 1e3, 4))
    return producer


def forward_hook(original, self, batch=None, *args, **kwargs):
    mode = getattr(batch, "forward_mode", None)
    try:
        extend = bool(mode is not None and mode.is_extend())
    except Exception:  # noqa: BLE001 - a release without is_extend: nothing traced
        extend = False
    if not extend:
        return original(self, batch, *args, **kwargs)
    consumer = getattr(batch, "hicache_consumer_index", -1)
    with _span_lock:
        load = _timeline.loads.pop(consumer, None) if isinstance(consumer, int) and consumer >= 0 else None
    called = time.perf_counter()
    start = Spans.event()
    result = original(self, batch, *args, **kwargs)
    end = Spans.event()
    if start is not None and end is not None:
        what = {"of": "forward", "load": load is not None,
                "extend_tokens": int(getattr(batch, "extend_num_tokens", 0) or 0),
                "prefix_tokens": int(sum(getattr(batch, "prefix_lens", None) or [])),
                "requests": len(getattr(batch, "reqs", None) or [])}
        if load is not None:
            what.update(host_to_forward_ms=round((called - load[1]) * 1e3, 4), start_loading_host_ms=load[2])
        with _span_lock:
            _timeline.pending.append((what, None if load is None else load[0], start, end))
    _timeline.flush(wait=False)
    return result


def pool_built(result, self, *args, **kwargs):
    """AFTER the pool's __init__: what was built, and what this package's plugin did in this process."""
    try:
        from sglang_hicache_jit.integrations.sglang import status
        plugin = {"registered": status["registered"], "patched": len(status["patched"]),
                  "skipped": [name for name, _ in status["skipped"]], "reason": status["reason"]}
    except Exception as exc:  # the package may be absent: a plugin-off control still traces its pools
        plugin = {"error": f"{type(exc).__name__}: {exc}"}
    with _lock:  # SGLang has applied every hook by now: the package's ops sit where the pools call them
        wrapped = count_package_ops()
    trace({"event": "pool", "pool": type(self).__name__, "layout": getattr(self, "layout", None),
           "size": getattr(self, "size", None), "plugin": plugin, "package_op_names": wrapped})
    return result


def _default_one_layer_options(*, quota: int | None = None, method: str | None = None) -> None:
    """The package's one-layer copies (SGLang's per-layer loads) take ``quota`` CTAs and copy ``method``
    where the caller names none (SGLang never does; upstream's own kernel then takes 2 CTAs, this package's
    host-to-GPU default is 4 CTAs of bulk copies): the A/B of those choices, for the loads alone."""
    from sglang_hicache_jit.transfer import ops

    for name in ("transfer_one_layer", "transfer_one_layer_mla"):
        op = getattr(ops, name)

        @functools.wraps(op)
        def with_options(*args, _op=op, _quota=quota, _method=method, block_quota=None, method=None, **kwargs):
            return _op(*args, block_quota=_quota if block_quota is None else block_quota,
                       method=_method if method is None else method, **kwargs)

        setattr(ops, name, with_options)


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if os.environ.get("HICACHE_SERVER_STAGING_SIDE_STREAM") == "1":  # mode plugin-sidestream; no pool built yet
        from sglang_hicache_jit.transfer import staging

        staging.GATHER_ON_SIDE_STREAM = True
    load_quota = os.environ.get("HICACHE_SERVER_LOAD_QUOTA")  # mode plugin-loadquota2: upstream's CTA budget
    load_method = os.environ.get("HICACHE_SERVER_LOAD_METHOD")  # modes plugin-plain, plugin-resident
    if load_quota or load_method:
        _default_one_layer_options(quota=int(load_quota) if load_quota else None, method=load_method or None)

    HookRegistry.register(_WEIGHTS, dummy_weights, HookType.REPLACE)
    for pool in _POOLS:
        HookRegistry.register(f"{pool}.load_to_device_per_layer", load_hook, HookType.AROUND)
        HookRegistry.register(f"{pool}.backup_from_device_all_layer", backup_hook, HookType.AROUND)
        HookRegistry.register(f"{pool}.__init__", pool_built, HookType.AFTER)
    HookRegistry.register(_START_LOADING, start_loading_hook, HookType.AROUND)
    HookRegistry.register(_FORWARD, forward_hook, HookType.AROUND)
    trace({"event": "registered", "corrupt": os.environ.get("HICACHE_SERVER_CORRUPT", "")})
    import atexit

    atexit.register(lambda: _spans.flush(wait=True))
    atexit.register(lambda: _timeline.flush(wait=True))
