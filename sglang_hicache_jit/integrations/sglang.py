"""SGLang plugin: makes SGLang's own HiCache host pools use this package.

Installed as the entry point ``hicache_jit`` in the group
``sglang.srt.plugins``; SGLang's ``load_plugins()`` calls ``register()`` in
every scheduler, engine and worker process, then applies the hooks. What it
registers, through SGLang's ``HookRegistry``:

* REPLACE of every transfer op the host pools import from
  ``sglang.kernels.ops.kvcache.hicache`` and ``sgl_kernel.kvcacheio``, with
  the routed versions in ``sglang_ops`` (the JIT kernel when the probe says
  ``ok``, the copy engines otherwise). SGLang propagates a replaced function
  to every module that imported it by name, the pool modules included;
* AROUND hooks on the pool methods that raise for some layout x io_backend x
  sharding cells (``sglang_pools``), and a narrower packed-rows guard;
* AFTER hooks that log, once per pool, which path it transfers through.

A target is patched only if it exists and its signature is the one this
package was written against (sglang 0.5.23); anything else is skipped and
logged, so another sglang version gets what still fits. Nothing here may
break SGLang's startup: every failure is logged and leaves SGLang as it was.
Turn it off with ``SGLANG_HICACHE_JIT_SGLANG_PLUGIN=0``, or leave
``hicache_jit`` out of SGLang's ``SGLANG_PLUGINS`` whitelist.
"""

from __future__ import annotations

import inspect
import logging
import pkgutil

from .. import settings

log = logging.getLogger("sglang_hicache_jit.plugin")

TESTED_SGLANG = "0.5.23"
_HICACHE = "sglang.kernels.ops.kvcache.hicache"
_KVCACHEIO = "sgl_kernel.kvcacheio"
_POOLS = "sglang.srt.mem_cache.pool_host"

# Pool methods: (target, hook in sglang_pools, hook type, the parameters the target had in
# sglang 0.5.23, or None where the hook passes everything through unchanged).
_LOAD = ["self", "device_pool", "host_indices", "device_indices", "layer_id", "io_backend", "is_draft"]
_BACKUP = ["self", "device_pool", "host_indices", "device_indices", "io_backend"]
_POOL_HOOKS = (
    (f"{_POOLS}.mla.MLATokenToKVPoolHost.load_to_device_per_layer", "load_to_device_per_layer", "AROUND", _LOAD),
    (f"{_POOLS}.mla.MLATokenToKVPoolHost.backup_from_device_all_layer", "backup_from_device_all_layer", "AROUND",
     _BACKUP),
    (f"{_POOLS}.mla.MLATokenToKVPoolHost._backup_from_device_per_layer", "mla_backup_from_device_per_layer",
     "AROUND", ["self", "host_indices", "device_indices", "layer_id", "io_backend", "is_draft"]),
    (f"{_POOLS}.mha.MHATokenToKVPoolHost.load_to_device_per_layer", "load_to_device_per_layer", "AROUND", _LOAD),
    (f"{_POOLS}.mha.MHATokenToKVPoolHost.backup_from_device_all_layer", "backup_from_device_all_layer", "AROUND",
     _BACKUP),
    (f"{_POOLS}.dsa.DSAIndexerPoolHost.load_to_device_per_layer", "dsa_load_to_device_per_layer", "AROUND", _LOAD),
    (f"{_POOLS}.dsa.DSAIndexerPoolHost.backup_from_device_all_layer", "dsa_backup_from_device_all_layer",
     "AROUND", _BACKUP),
    (f"{_POOLS}.dsa.DSAIndexerPoolHost._backup_from_device_per_layer", "dsa_backup_from_device_per_layer",
     "AROUND", ["self", "device_pool", "host_indices", "device_indices", "layer_id", "io_backend", "is_draft"]),
    (f"{_POOLS}.base.HostKVCache._require_packed_device_rows", "require_packed_device_rows", "AROUND",
     ["self", "kernel"]),
    (f"{_POOLS}.mla.MLATokenToKVPoolHost._initialize_transfer_views", "describe_pool", "AFTER", None),
    (f"{_POOLS}.mha.MHATokenToKVPoolHost._initialize_transfer_views", "describe_pool", "AFTER", None),
    (f"{_POOLS}.dsa.DSAIndexerPoolHost._init_write_back_staging_buffers", "describe_pool", "AFTER", None),
)

# What register() did in this process, for `sglang-hicache-jit info` and tests.
status: dict = {"registered": False, "patched": [], "skipped": [], "reason": ""}


def _params(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _resolve(target: str):
    module, _, attr = target.rpartition(".")
    return getattr(pkgutil.resolve_name(module), attr)


def _op_targets(ops_module) -> list[tuple[str, object]]:
    """(target, replacement) for every op whose upstream signature matches ours."""
    pairs = [(f"{_HICACHE}.{name}", getattr(ops_module, name)) for name in ops_module.HICACHE_OPS]
    pairs += [(f"{_KVCACHEIO}.{name}", getattr(ops_module, name)) for name in ops_module.KVCACHEIO_OPS]
    chosen = []
    for target, replacement in pairs:
        try:
            original = _resolve(target)
        except Exception as exc:
            status["skipped"].append((target, f"not importable: {type(exc).__name__}: {exc}"))
            continue
        if _params(original) != _params(replacement):
            status["skipped"].append((target, "signature differs from sglang " + TESTED_SGLANG))
            continue
        chosen.append((target, replacement))
    return chosen


def _pool_targets(pools_module) -> list[tuple[str, object, str]]:
    chosen = []
    for target, hook_name, hook_type, expected in _POOL_HOOKS:
        try:
            original = _resolve(target)
        except Exception as exc:
            status["skipped"].append((target, f"not importable: {type(exc).__name__}: {exc}"))
            continue
        if expected is not None and [name for name, _, _ in _params(original)] != expected:
            status["skipped"].append((target, "signature differs from sglang " + TESTED_SGLANG))
            continue
        chosen.append((target, getattr(pools_module, hook_name), hook_type))
    return chosen


def register() -> None:
    """Entry point for sglang.srt.plugins. Never raises."""
    try:
        _register()
    except Exception as exc:  # a plugin must never stop SGLang from starting
        status["reason"] = f"{type(exc).__name__}: {exc}"
        log.warning("sglang-hicache-jit: plugin not active (%s); SGLang runs unchanged", status["reason"])


def _register() -> None:
    if status["registered"]:
        return
    if not settings.sglang_plugin_enabled():
        status["reason"] = f"{settings.SGLANG_PLUGIN}=0"
        log.info("sglang-hicache-jit: plugin off (%s); SGLang runs unchanged", status["reason"])
        return
    import torch

    if torch.version.cuda is None or getattr(torch.version, "hip", None):
        # The kernels and the copy-engine path are CUDA's: on ROCm, XPU or NPU builds of torch
        # SGLang keeps its own transfers.
        status["reason"] = "torch is not a CUDA build (this package's transfers are CUDA-only)"
        log.info("sglang-hicache-jit: plugin not applied: %s; SGLang runs unchanged", status["reason"])
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        sglang_version = version("sglang")
    except PackageNotFoundError:
        sglang_version = "unknown"
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import sglang_ops, sglang_pools

    targets = [(t, r, "REPLACE") for t, r in _op_targets(sglang_ops)] + _pool_targets(sglang_pools)
    for target, hook, hook_type in targets:
        HookRegistry.register(target, hook, getattr(HookType, hook_type))
        status["patched"].append(target)
    status["registered"] = True
    note = "" if sglang_version == TESTED_SGLANG else f" (written for sglang {TESTED_SGLANG})"
    log.info("sglang-hicache-jit: sglang %s%s: routing %d HiCache ops and %d pool methods through this package; "
             "skipped %d%s. Kernel or copy engines is decided per row size when a pool is built.", sglang_version,
             note, sum(1 for t in status["patched"] if not t.startswith(_POOLS)),
             sum(1 for t in status["patched"] if t.startswith(_POOLS)), len(status["skipped"]),
             "".join(f"\n  skipped {t}: {why}" for t, why in status["skipped"]))


def describe() -> dict:
    """What SGLang would do with this plugin here, without importing SGLang (for `info`)."""
    import os
    from importlib.metadata import PackageNotFoundError, entry_points, version

    try:
        sglang_version = version("sglang")
    except PackageNotFoundError:
        sglang_version = None
    ours = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.value == f"{__name__}:register"]
    name = ours[0].name if ours else None
    whitelist = [n.strip() for n in os.environ.get("SGLANG_PLUGINS", "").split(",") if n.strip()]
    enabled = settings.sglang_plugin_enabled()
    allowed = not whitelist or name in whitelist
    return {"sglang": sglang_version, "tested_with": TESTED_SGLANG, "entry_point": name,
            "switch": enabled, "sglang_plugins": whitelist or None,
            "active": bool(sglang_version and name and enabled and allowed)}


def reload_for_tests() -> None:
    """Forgets what register() did (the hooks themselves stay applied)."""
    status.update(registered=False, patched=[], skipped=[], reason="")
