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

All or nothing: everything that can fail (the switch, every other setting
the plugin's paths read later, torch, the support table, the plan, SGLang's
hook types) is read and checked before the first hook is registered. A bad
setting (``SGLANG_HICACHE_JIT_STAGING=٣``) is refused here, as a bad switch
is: the plugin stays off and says why at WARNING, and SGLang runs unchanged.
Raising would not stop the server: SGLang's ``load_plugins()`` (0.5.11-0.5.23)
catches an Exception from ``register()``, logs it and serves on, so a raise
would only add a traceback to a server that starts anyway. Should SGLang's registry still refuse a hook, or a
KeyboardInterrupt arrive while the hooks are registered, the hooks
registered so far are taken out of its table again (``HookRegistry`` has
no unregister; its ``_hooks`` maps a dotted path to a list of entries that
hold the hook), so SGLang runs unchanged; where that cannot be done the log
says at ERROR which hooks stay. ``status`` and the log line always tell the
true state.
``register()`` runs once per process: a second call (SGLang calls each
entry point it finds, and two installed copies of this package advertise
it twice) does nothing, whatever the first one did.
"""

from __future__ import annotations

import logging

from ... import settings
from ...errors import BadSettingError
from . import announce
from .support import bad_settings, describe, release_row

__all__ = ["register", "describe", "release_row", "status"]

log = logging.getLogger("sglang_hicache_jit.plugin")

# What register() did in this process, for `sglang-hicache-jit info` and tests: the targets
# patched ("name -> upstream path"), and (name, why) for those skipped or absent. "patched" lists
# exactly the hooks in SGLang's registry, also after a failure.
status: dict = {"registered": False, "sglang": None, "patched": [], "skipped": [], "absent": [], "reason": ""}
_ran = False  # register() ran in this process (a second call does nothing)


def register() -> None:
    """Entry point for sglang.srt.plugins; runs once per process. Never raises an Exception (a bad setting
    or an install problem leaves the plugin off, logged at WARNING); a KeyboardInterrupt or SystemExit goes
    on after every hook it registered has been taken back."""
    global _ran
    if _ran:
        log.debug("sglang-hicache-jit: register() already ran in this process; nothing to do")
        return
    _ran = True
    try:
        prepared = _prepare()
    except Exception as exc:  # a plugin must never stop SGLang from starting; nothing is registered yet
        status["reason"] = f"{type(exc).__name__}: {exc}"
        log.warning("sglang-hicache-jit: plugin not active (%s); SGLang runs unchanged", status["reason"])
        return
    except BaseException as exc:  # Ctrl-C, SystemExit: nothing is registered yet, and the process stops
        status["reason"] = f"interrupted ({type(exc).__name__}) before any hook was registered"
        raise
    if prepared is not None:
        _register_all(*prepared)


def _prepare():
    """Everything register() needs, read and checked before anything is registered: (registry, hooks,
    decisions, release row), or None when the plugin stands aside (logged here)."""
    if not settings.sglang_plugin_enabled():
        status["reason"] = f"{settings.SGLANG_PLUGIN}=0"
        log.info("sglang-hicache-jit: plugin off (%s); SGLang runs unchanged", status["reason"])
        return None
    problem = bad_settings()
    if problem is not None:  # refused now, not raised later inside SGLang's backup thread or layer loop
        raise BadSettingError(problem)
    import torch

    if torch.version.cuda is None or getattr(torch.version, "hip", None):
        # The kernels and the copy-engine path are CUDA's: on ROCm, XPU or NPU builds of torch
        # SGLang keeps its own transfers.
        status["reason"] = "torch is not a CUDA build (this package's transfers are CUDA-only)"
        log.info("sglang-hicache-jit: plugin not applied: %s; SGLang runs unchanged", status["reason"])
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        status["sglang"] = version("sglang")
    except PackageNotFoundError:
        status["sglang"] = "unknown"
    row = release_row(status["sglang"])  # a damaged support.json raises here, before any hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .plan import LiveFacts, plan

    decisions = plan(LiveFacts())
    hooks = []
    for decision in decisions:
        if decision.patched:
            kind = getattr(HookType, decision.target.kind, None)
            if kind is None:
                raise LookupError(f"this SGLang's HookType has no {decision.target.kind} (needed for "
                                  f"{decision.target.name})")
            hooks.append((decision, kind))
    return HookRegistry, hooks, decisions, row


def _register_all(registry, hooks, decisions, row) -> None:
    done, current = [], None
    try:
        for decision, kind in hooks:
            current = decision
            registry.register(decision.path, decision.hook, kind)
            done.append(decision)
            current = None
        patched = [f"{d.target.name} -> {d.path}" for d in decisions if d.patched]
        absent = [(d.target.name, d.why) for d in decisions if not d.patched and d.path is None]
        skipped = [(d.target.name, d.why) for d in decisions if not d.patched and d.path is not None]
        # One update: an interrupt lands before it (everything is withdrawn below) or after it (all true).
        status.update(patched=patched, absent=absent, skipped=skipped, registered=True)
    except BaseException as exc:
        # SGLang's registry refused one, or Ctrl-C (KeyboardInterrupt is no Exception) came in the middle:
        # take back what the registry took, the hook being registered included, then say what stays.
        interrupted = not isinstance(exc, Exception)
        if interrupted:
            failed = f"interrupted ({type(exc).__name__}) while registering its hooks"
        elif current is not None:
            failed = f"registering {current.target.name} failed ({type(exc).__name__}: {exc})"
        else:
            failed = f"recording its hooks failed ({type(exc).__name__}: {exc})"
        # A registry that raised did not take the hook; one interrupted may have (then it is in the table).
        stuck = _withdraw(registry, done, current if interrupted else None)
        status.update(registered=False, patched=[f"{d.target.name} -> {d.path}" for d in stuck], absent=[],
                      skipped=[], reason=failed)
        if not stuck:
            withdrawn = f"; the {len(done)} hooks registered before it were withdrawn" if done else ""
            log.warning("sglang-hicache-jit: plugin not active (%s%s); SGLang runs unchanged", failed, withdrawn)
        else:
            log.error("sglang-hicache-jit: plugin PARTLY active: %s, and %d hooks registered before it could not "
                      "be withdrawn, so SGLang applies them:%s", failed, len(stuck),
                      "".join(f"\n  {name}" for name in status["patched"]))
        if interrupted:
            raise
        return
    _log_summary(decisions, row)


def _withdraw(registry, done: list, maybe=None) -> list:
    """Takes the hooks of ``done`` out of SGLang's registry table, and ``maybe``'s (a hook whose register()
    call was interrupted: in the table or not); returns those it could not."""
    table = getattr(registry, "_hooks", None)
    applied = getattr(registry, "_patched", ())
    stuck = []
    pending = [maybe] if maybe is not None and all(maybe is not d for d in done) else []
    for decision in reversed(done + pending):
        try:
            entries = table.get(decision.path) if isinstance(table, dict) else None
            ours = [i for i, entry in enumerate(entries or ())
                    if isinstance(entry, tuple) and any(part is decision.hook for part in entry)]
            if decision is maybe and not ours and isinstance(table, dict):
                continue  # its register() never got to add it
            if not ours or decision.path in applied:  # not where 0.5.11-0.5.23 keep it, or applied already
                stuck.append(decision)
                continue
            del entries[ours[-1]]
            if not entries:  # an empty list would still make apply_hooks() visit the target
                del table[decision.path]
        except Exception:  # a registry of another shape: this hook stays, and the log says so
            stuck.append(decision)
    return stuck[::-1]


def _log_summary(decisions, row) -> None:
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
    """Forgets what register() did, so it runs again (the hooks themselves stay registered and applied)."""
    global _ran
    _ran = False
    status.update(registered=False, sglang=None, patched=[], skipped=[], absent=[], reason="")
