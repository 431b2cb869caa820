"""SGLang plugin: makes SGLang's own HiCache host pools use this package.

Installed as the entry point ``hicache_jit`` in the group
``sglang.srt.plugins``; SGLang's ``load_plugins()`` (sglang 0.5.11 and later)
calls ``register()`` in every scheduler, engine and worker process, then
applies the hooks. What it registers, through SGLang's ``HookRegistry``:

* REPLACE of every transfer op the host pools import from SGLang's hicache
  ops module and from ``sgl_kernel.kvcacheio``, with the routed versions in
  ``ops`` (the JIT kernel when the probe says ``ok``, the copy engines
  otherwise). SGLang propagates a replaced function to every module that
  imported it by name, the pool modules included;
* AROUND hooks on the pool methods that raise for some layout x io_backend x
  sharding cells (``pools``), and a narrower packed-rows guard;
* AFTER hooks that log, once per pool, which path it transfers through.

``targets.py`` lists every name, where each release keeps it, and the hooks
per release family; ``plan.py`` picks what fits the installed release from
its signatures and pool classes (``matching.py``). Whatever does not fit is
skipped and logged, so another release gets what still fits, and nothing
here may break SGLang's startup: every failure is logged and leaves SGLang
as it was. Turn it off with ``SGLANG_HICACHE_JIT_SGLANG_PLUGIN=0``, or leave
``hicache_jit`` out of SGLang's ``SGLANG_PLUGINS`` whitelist.
"""

from __future__ import annotations

import logging

from ... import settings
from . import announce
from .support import describe, release_row

__all__ = ["register", "describe", "release_row", "status"]

log = logging.getLogger("sglang_hicache_jit.plugin")

# What register() did in this process, for `sglang-hicache-jit info` and tests: the targets
# patched ("name -> upstream path"), and (name, why) for those skipped or absent.
status: dict = {"registered": False, "sglang": None, "patched": [], "skipped": [], "absent": [], "reason": ""}


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
        status["sglang"] = version("sglang")
    except PackageNotFoundError:
        status["sglang"] = "unknown"
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .plan import LiveFacts, plan

    decisions = plan(LiveFacts())
    for decision in decisions:
        if decision.patched:
            HookRegistry.register(decision.path, decision.hook, getattr(HookType, decision.target.kind))
            status["patched"].append(f"{decision.target.name} -> {decision.path}")
        elif decision.path is None:
            status["absent"].append((decision.target.name, decision.why))
        else:
            status["skipped"].append((decision.target.name, decision.why))
    status["registered"] = True
    _log_summary(decisions)


def _log_summary(decisions) -> None:
    row = release_row(status["sglang"])
    checked = (f"checked against sglang {row['sglang']}" if row is not None
               else "not among the releases this package was checked against; patching what fits")
    ops = sum(1 for d in decisions if d.patched and d.target.kind == "REPLACE")
    methods = sum(1 for d in decisions if d.patched and d.target.kind != "REPLACE")
    # Logged once logging is configured: SGLang loads plugins before it configures logging (announce.py).
    announce.start_line(
        log, "sglang-hicache-jit: sglang %s (%s): routing %d HiCache ops and %d pool methods through this package; "
        "%d not in this release; skipped %d%s. Kernel or copy engines is decided per row size when a pool "
        "is built.", status["sglang"], checked, ops, methods, len(status["absent"]), len(status["skipped"]),
        "".join(f"\n  skipped {name}: {why}" for name, why in status["skipped"]))
    for name, why in status["absent"]:
        log.debug("sglang-hicache-jit: %s %s", name, why)


def reload_for_tests() -> None:
    """Forgets what register() did (the hooks themselves stay applied)."""
    status.update(registered=False, sglang=None, patched=[], skipped=[], absent=[], reason="")
