"""What the plugin does on each SGLang release, and whether SGLang will run it here.

``support.json`` (beside this file) holds one row per release:
what the plugin patches there, what that release does not have, and what
does not fit. ``tools/sglang_releases.py`` writes it from the releases
recorded in ``tests/sglang_data/`` with the same planner ``register()``
runs, and a test keeps the two in step. This module imports neither SGLang
nor torch: ``sglang-hicache-jit info`` reports from it.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from importlib import resources

# The first release with sglang.srt.plugins (load_plugins, HookRegistry).
FIRST_WITH_PLUGINS = "0.5.11"


@lru_cache(maxsize=1)
def _rows() -> dict:
    text = resources.files(__package__).joinpath("support.json").read_text(encoding="utf-8")
    return json.loads(text)["releases"]


def release_row(version: str | None) -> dict | None:
    """The recorded row of an SGLang release, or None for a release not recorded."""
    return _rows().get(version) if version else None


def _plugins_whitelist() -> set | None:
    """SGLANG_PLUGINS as SGLang reads it: unset or empty allows every plugin; otherwise the
    names between commas, blanks dropped (so ' ' or ',' allow none)."""
    raw = os.environ.get("SGLANG_PLUGINS", "")
    if not raw:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _has_plugin_mechanism() -> bool | None:
    """Whether the installed SGLang has sglang.srt.plugins, found without importing SGLang (None: no SGLang)."""
    from importlib.util import find_spec

    try:
        spec = find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return any(os.path.isfile(os.path.join(root, "srt", "plugins", "hook_registry.py"))
               for root in spec.submodule_search_locations)


def describe() -> dict:
    """What SGLang would do with this plugin here, without importing SGLang (for `info`)."""
    from importlib.metadata import PackageNotFoundError, entry_points, version

    from ... import settings

    try:
        sglang_version = version("sglang")
    except PackageNotFoundError:
        sglang_version = None
    ours = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.value == f"{__package__}:register"]
    name = ours[0].name if ours else None
    whitelist = _plugins_whitelist()
    try:
        switch, switch_error = settings.sglang_plugin_enabled(), None
    except ValueError as exc:  # a value the setting does not take: the plugin logs it and stays off
        switch, switch_error = None, getattr(exc, "reason", str(exc))
    loads_plugins = _has_plugin_mechanism() if sglang_version else None
    row = release_row(sglang_version)
    described = {"sglang": sglang_version, "entry_point": name, "switch": switch, "error": switch_error,
                 "sglang_plugins": sorted(whitelist) if whitelist is not None else None,
                 "loads_plugins": loads_plugins, "release": row, "active": False}
    # A bad switch is the user's own first problem, so it is reported before anything about the install.
    if switch_error:
        line = f"not active, SGLang runs unchanged: {switch_error}"
    elif not name:
        line = "not registered (install the package with pip; PYTHONPATH alone registers no entry point)"
    elif not sglang_version:
        line = f"registered as {name!r}; SGLang is not installed here"
    elif not loads_plugins:
        line = (f"inactive: SGLang {sglang_version} cannot load plugins (sglang.srt.plugins arrived in "
                f"{FIRST_WITH_PLUGINS}), so its host pools keep their own kernels; upgrade SGLang to "
                f"{FIRST_WITH_PLUGINS} or later (0.5.16+ for the layer-sharded pools this package fixes)")
    elif not switch:
        line = f"off ({settings.SGLANG_PLUGIN}=0); SGLang {sglang_version} runs unchanged"
    elif whitelist is not None and name not in whitelist:
        shown = os.environ.get("SGLANG_PLUGINS", "")
        line = (f"skipped: SGLANG_PLUGINS={shown!r} does not name {name!r}; SGLang {sglang_version} runs "
                "unchanged")
    else:
        described["active"] = True
        line = f"active: SGLang {sglang_version} loads {name!r} in each of its processes; " + summary(row)
    described["line"] = line
    return described


def summary(row: dict | None) -> str:
    """One sentence on what the plugin does on a recorded release."""
    if row is None:
        return ("this release was not recorded (see docs/sglang.md): the plugin patches what fits its "
                "signatures and logs the rest")
    ops = sum(1 for name in row["patched"] if name.startswith(("hicache.", "kvcacheio.")))
    methods = len(row["patched"]) - ops
    text = f"routes {ops} ops and {methods} pool methods"
    if row["skipped"]:
        text += f"; {len(row['skipped'])} do not fit ({', '.join(sorted(row['skipped']))})"
    return text + f"; {row['note']}" if row.get("note") else text
