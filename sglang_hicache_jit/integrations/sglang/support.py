"""What the plugin does on each SGLang release, and whether SGLang will run it here.

``support.json`` (beside this file) holds one row per release:
what the plugin patches there, what that release does not have, and what
does not fit. ``tools/sglang_releases.py`` writes it from the releases
recorded in ``tests/sglang_data/`` with the same planner ``register()``
runs, and a test keeps the two in step. This module imports neither SGLang
nor torch: ``sglang-hicache-jit info`` reports from it.

The table is read as any file that someone may have replaced is read
(``safeio``): a regular file (a FIFO used to hang SGLang's ``load_plugins()``
and ``info``), or a symlink that stays inside this package; owned by root,
this user or whoever owns the package directory, and not writable by every
user; at most ``MAX_TABLE_BYTES``; UTF-8 JSON of the shape the tool writes.
Anything else is a ``SupportTableError`` naming the file and the problem:
``register()`` then registers nothing, and ``info`` says why.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from ... import safeio

# The first release with sglang.srt.plugins (load_plugins, HookRegistry).
FIRST_WITH_PLUGINS = "0.5.11"
SUPPORT_JSON = Path(__file__).with_name("support.json")
# The table is about 25 KB for 18 releases; a megabyte is decades of releases, and bounds what a
# planted file can make every SGLang process read.
MAX_TABLE_BYTES = 1 << 20
_ROW_KEYS = {"sglang": str, "sglang_kernel": (str, type(None)), "plugins": bool, "patched": list, "absent": list,
             "skipped": dict}
# How the target table names a target (targets.py): a family, a dot, a Python name.
_TARGET_NAME = r"(hicache|kvcacheio|MLA|MHA|DSA|HostKVCache)\.[A-Za-z_][A-Za-z0-9_]*"
_FIX = "reinstall sglang-hicache-jit (pip install --force-reinstall --no-deps sglang-hicache-jit)"


class SupportTableError(ValueError):
    """support.json cannot be used; ``path`` and ``problem`` say which file and why."""

    def __init__(self, path, problem: str):
        self.path, self.problem = str(path), problem
        super().__init__(f"{self.path} {problem}; {_FIX}")


_tables: dict = {}  # path -> rows, for each table read and checked cleanly (a damaged one is read again)


def _rows() -> dict:
    path = SUPPORT_JSON
    rows = _tables.get(path)
    if rows is None:
        rows = _tables[path] = load_table(path)
    return rows


def release_row(version: str | None) -> dict | None:
    """The recorded row of an SGLang release, or None for a release not recorded.
    Raises SupportTableError when support.json cannot be used."""
    return _rows().get(version) if version else None


def load_table(path) -> dict:
    """The release rows of the support table at ``path``, read and checked (see the module docstring)."""
    path = Path(path)
    try:
        data = safeio.read_regular(_inside_package(path), MAX_TABLE_BYTES, check=lambda st: _check_owner(st, path))
    except FileNotFoundError:
        raise SupportTableError(path, "is missing") from None
    except (safeio.NotRegularFile, safeio.TooLarge) as exc:
        raise SupportTableError(path, exc.strerror) from None
    except OSError as exc:
        raise SupportTableError(path, f"cannot be read ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SupportTableError(path, f"is not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x})") from None
    try:
        table = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SupportTableError(path, f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") \
            from None
    except RecursionError:
        raise SupportTableError(path, "is not valid JSON (nested too deeply)") from None
    problem = _shape_problem(table)
    if problem:
        raise SupportTableError(path, f"does not hold the table tools/sglang_releases.py writes: {problem}")
    return table["releases"]


def _inside_package(path: Path) -> Path:
    """``path``, or where its symlink leads when that stays inside the directory holding ``path``."""
    try:
        is_link = stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return path  # absent or unreadable: the read reports it
    if not is_link:
        return path
    home = os.path.realpath(path.parent)
    real = os.path.realpath(path)
    if os.path.commonpath([home, real]) != home:
        raise safeio.NotRegularFile(0, f"is a symbolic link to {real}, outside the package", str(path))
    return Path(real)


def _check_owner(st: os.stat_result, path: Path) -> None:
    owners = {0, os.geteuid()}
    try:
        owners.add(os.stat(path.parent).st_uid)  # whoever installed the package
    except OSError:
        pass
    if st.st_uid not in owners:
        raise SupportTableError(path, f"is owned by uid {st.st_uid}: neither root, this user (uid {os.geteuid()}) "
                                      "nor the owner of the package directory, who installed it")
    if st.st_mode & stat.S_IWOTH:
        raise SupportTableError(path, f"is writable by every user (mode {stat.S_IMODE(st.st_mode):04o})")


def _shape_problem(table) -> str | None:
    """What is wrong with the shape of a decoded table, or None."""
    if not isinstance(table, dict) or not isinstance(table.get("releases"), dict):
        return "a JSON object with a 'releases' object"
    for version, row in table["releases"].items():
        where = f"releases[{version!r}]"
        if not isinstance(row, dict):
            return f"{where} is {type(row).__name__}, not an object"
        for key, kind in _ROW_KEYS.items():
            if not isinstance(row.get(key), kind):
                return f"{where}.{key} is {type(row.get(key)).__name__}, not {_kind_name(kind)}"
        if row["sglang"] != version:
            return f"{where} describes sglang {row['sglang']!r}"
        if "note" in row and not isinstance(row["note"], str):
            return f"{where}.note is {type(row['note']).__name__}, not a string"
        names = {"patched": row["patched"], "absent": row["absent"], "skipped": list(row["skipped"])}
        for key, listed in names.items():
            odd = next((n for n in listed if not isinstance(n, str) or not re.fullmatch(_TARGET_NAME, n)), None)
            if odd is not None:
                return f"{where}.{key} names {odd!r}, which is not a target name"
        if any(not isinstance(why, str) for why in row["skipped"].values()):
            return f"{where}.skipped gives a reason that is not a string"
        every = names["patched"] + names["absent"] + names["skipped"]
        if len(set(every)) != len(every):
            return f"{where} lists a target twice (patched, absent and skipped exclude each other)"
        if not row["plugins"] and row["patched"]:
            return f"{where} patches targets in a release that cannot load plugins"
    return None


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {str: "a string", bool: "true or false", list: "a list", dict: "an object", type(None): "null"}
    return " or ".join(names[k] for k in kinds)


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


def bad_settings() -> str | None:
    """Why this package's settings stop the plugin here, or None: every setting the plugin's paths read
    later (the staging budget in SGLang's backup thread, the copy method and resident kernel at the first
    copy, the cache, arch and lock settings at the first build) is read now, so that a bad one is refused
    when the plugin registers, not raised inside SGLang once it serves."""
    from ... import settings
    from ...buildcache.arch import named_archs

    problems = [r["error"] for r in settings.effective() if r["error"] and r["variable"] != settings.SGLANG_PLUGIN]
    try:
        named_archs()
    except ValueError as exc:  # BadSettingError: an arch variable that names no arch
        problems.append(str(exc))
    return "; ".join(problems) or None


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
    if switch:  # with the switch off register() reads nothing else
        switch_error = bad_settings()
    loads_plugins = _has_plugin_mechanism() if sglang_version else None
    try:  # read whether SGLang is here or not: a damaged table is a damaged install either way
        rows, table_error = _rows(), None
    except SupportTableError as exc:
        rows, table_error = {}, str(exc)
    row = rows.get(sglang_version) if sglang_version else None
    described = {"sglang": sglang_version, "entry_point": name, "switch": switch, "error": switch_error,
                 "sglang_plugins": sorted(whitelist) if whitelist is not None else None,
                 "loads_plugins": loads_plugins, "release": row, "support_table": table_error, "active": False}
    # A bad switch or setting is the user's own first problem, so it is reported before anything about the
    # install (register() refuses to register anything then).
    if switch_error:
        line = f"not active, SGLang runs unchanged: {switch_error}"
    elif table_error:  # register() refuses to register anything then
        line = f"not active, SGLang runs unchanged: {table_error}"
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
