"""The plugin registers all or nothing, once, and says what is true; its support table is read safely (issue 26).

No SGLang needed: SGLang's ``sglang.srt.plugins.hook_registry`` is stood in for by a registry that keeps
its hooks the way 0.5.11-0.5.23 do (``HookRegistry._hooks``: dotted path -> list of ``(HookType, hook,
source)``, applied later by ``apply_hooks()``), and the planner is given one decision per target, as on a
release where everything fits. test_sglang_integration.py repeats the refusal against the installed
SGLang's own registry.
"""

import enum
import errno
import json
import logging
import os
import stat
import sys
import threading
import types
from collections import defaultdict

import pytest

from sglang_hicache_jit import cli
from sglang_hicache_jit.integrations import sglang as plugin
from sglang_hicache_jit.integrations.sglang import plan as plan_module
from sglang_hicache_jit.integrations.sglang import support
from sglang_hicache_jit.integrations.sglang.plan import Decision
from sglang_hicache_jit.integrations.sglang.targets import TARGETS

REPLACES = sum(1 for t in TARGETS if t.kind == "REPLACE")


class HookType(enum.Enum):
    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"


def make_registry(refuse=None, table="_hooks"):
    """A HookRegistry stand-in; ``refuse``: a HookType it raises for; ``table``: where it keeps hooks."""

    class Registry:
        calls = []

        @classmethod
        def register(cls, target, hook, hook_type=HookType.AFTER, *, source=None):
            cls.calls.append(target)
            if hook_type is refuse:
                raise TypeError(f"this registry takes no {hook_type.name} hooks")
            getattr(cls, table)[target].append((hook_type, hook, source))

    setattr(Registry, table, defaultdict(list))
    Registry._patched = set()
    return Registry


@pytest.fixture
def sglang(monkeypatch):
    """A CUDA torch, SGLang 0.5.23 by its metadata, its registry module, and a plan where every target fits."""
    import importlib.metadata

    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(importlib.metadata, "version", _sglang_0_5_23(importlib.metadata.version))
    monkeypatch.delenv("SGLANG_HICACHE_JIT_SGLANG_PLUGIN", raising=False)
    module = types.ModuleType("sglang.srt.plugins.hook_registry")
    module.HookType = HookType
    module.HookRegistry = make_registry()
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", module)
    monkeypatch.setattr(plan_module, "plan", lambda facts: [Decision(t, t.paths[0], t.hooks[0]) for t in TARGETS])
    monkeypatch.setattr(plan_module, "LiveFacts", lambda: None)
    saved = dict(plugin.status)
    plugin.reload_for_tests()
    yield module
    plugin.reload_for_tests()
    plugin.status.update(saved)


def _sglang_0_5_23(real_version):
    return lambda name: "0.5.23" if name == "sglang" else real_version(name)


def registered(registry) -> int:
    return sum(len(entries) for entries in registry._hooks.values())


def test_every_hook_is_registered_when_nothing_fails(sglang, caplog):
    with caplog.at_level(logging.INFO, logger="sglang_hicache_jit.plugin"):
        plugin.register()
    assert registered(sglang.HookRegistry) == len(TARGETS) and plugin.status["registered"] is True
    assert len(plugin.status["patched"]) == len(TARGETS)
    assert "checked against sglang 0.5.23" in caplog.text


# ---- M1: a failure after the first hook said "not active" while the hooks stayed registered ------------------

def test_a_refused_hook_type_leaves_nothing_registered(sglang, caplog):
    sglang.HookRegistry = registry = make_registry(refuse=HookType.AROUND)
    plugin.register()
    assert len(registry.calls) == REPLACES + 1  # every REPLACE, then the first AROUND, refused
    assert registered(registry) == 0 and dict(registry._hooks) == {}
    assert plugin.status["registered"] is False and plugin.status["patched"] == []
    assert "plugin not active" in caplog.text and "SGLang runs unchanged" in caplog.text
    assert f"the {REPLACES} hooks registered before it were withdrawn" in caplog.text
    assert "registering MLA.load_to_device_per_layer failed (TypeError" in plugin.status["reason"]


def test_hooks_that_cannot_be_withdrawn_are_named_and_never_called_inactive(sglang, caplog):
    """A registry that keeps its hooks elsewhere: they stay, and the log says so at ERROR, naming each."""
    sglang.HookRegistry = registry = make_registry(refuse=HookType.AROUND, table="_elsewhere")
    plugin.register()
    assert sum(len(v) for v in registry._elsewhere.values()) == REPLACES
    assert "plugin not active" not in caplog.text and "SGLang runs unchanged" not in caplog.text
    error, = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "PARTLY active" in error.getMessage() and f"{REPLACES} hooks registered before it" in error.getMessage()
    assert len(plugin.status["patched"]) == REPLACES and plugin.status["registered"] is False
    assert all(f"\n  {line}" in error.getMessage() for line in plugin.status["patched"])


def test_a_hook_type_sglang_lacks_registers_nothing(sglang, caplog):
    sglang.HookType = enum.Enum("HookType", {"REPLACE": "replace", "AFTER": "after"})
    plugin.register()
    assert sglang.HookRegistry.calls == [] and plugin.status["patched"] == []
    assert "HookType has no AROUND" in plugin.status["reason"] and "plugin not active" in caplog.text


def test_a_damaged_support_table_registers_nothing(sglang, tmp_path, monkeypatch, caplog):
    table = tmp_path / "support.json"
    table.write_text('{"releases": {"0.5.23": ')
    monkeypatch.setattr(support, "SUPPORT_JSON", table)
    plugin.register()
    assert sglang.HookRegistry.calls == [] and plugin.status["patched"] == []
    assert str(table) in plugin.status["reason"] and "is not valid JSON" in plugin.status["reason"]
    assert "plugin not active" in caplog.text


# ---- M2: a second register() (a second dist-info advertising the entry point) wrapped targets twice ----------

@pytest.mark.parametrize("first", ["refused", "succeeded", "off"])
def test_a_second_register_does_nothing(sglang, monkeypatch, first):
    if first == "refused":
        sglang.HookRegistry = make_registry(refuse=HookType.AROUND)
    if first == "off":
        monkeypatch.setenv("SGLANG_HICACHE_JIT_SGLANG_PLUGIN", "0")
    plugin.register()
    calls, hooks, status = len(sglang.HookRegistry.calls), registered(sglang.HookRegistry), dict(plugin.status)
    monkeypatch.delenv("SGLANG_HICACHE_JIT_SGLANG_PLUGIN", raising=False)
    plugin.register()
    assert len(sglang.HookRegistry.calls) == calls and registered(sglang.HookRegistry) == hooks
    assert plugin.status == status


# ---- G1 and info: the support table is read as a file someone may have replaced --------------------------------

def _fifo(path):
    os.mkfifo(path)


def _outside(path):
    return path.parent.parent / "outside.json"


def _release(text):
    row = {"sglang": "0.5.23", "sglang_kernel": "0.4.10", "plugins": True, "patched": ["MLA.describe"],
           "absent": [], "skipped": {}}
    row.update(text)
    return json.dumps({"releases": {"0.5.23": row}})


DAMAGED = {
    "invalid JSON": (lambda p: p.write_text('{"releases": [1, 2'), "is not valid JSON"),
    "not UTF-8": (lambda p: p.write_bytes(b'{"releases": {"\xff\xfe": 1}}'), "is not UTF-8 text (byte 15 is 0xff)"),
    "releases a list": (lambda p: p.write_text('{"releases": []}'), "a JSON object with a 'releases' object"),
    "patched a string": (lambda p: p.write_text(_release({"patched": "MLA.describe"})), "patched is str, not a list"),
    "plugins a string": (lambda p: p.write_text(_release({"plugins": "yes"})), "plugins is str, not true or false"),
    "a row for another release": (lambda p: p.write_text(_release({"sglang": "0.5.11"})), "describes sglang '0.5.11'"),
    "a name that is no target": (lambda p: p.write_text(_release({"patched": ["os.system"]})), "not a target name"),
    "a target twice": (lambda p: p.write_text(_release({"absent": ["MLA.describe"]})), "lists a target twice"),
    "nested too deeply": (lambda p: p.write_text("[" * 200_000), "nested too deeply"),
    "too large": (lambda p: p.write_bytes(b" " * (support.MAX_TABLE_BYTES + 1)), "is larger than"),
    "a FIFO": (_fifo, "is not a regular file"),
    "a directory": (lambda p: p.mkdir(), "is not a regular file"),
    "missing": (lambda p: None, "is missing"),
    "a symlink out of the package": (lambda p: (_outside(p).write_text(_release({})), p.symlink_to(_outside(p))),
                                     "is a symbolic link to"),
    "writable by everyone": (lambda p: (p.write_text(_release({})), p.chmod(0o666)), "is writable by every user"),
}


@pytest.fixture
def table(tmp_path, monkeypatch):
    package = tmp_path / "package"
    package.mkdir()
    path = package / "support.json"
    monkeypatch.setattr(support, "SUPPORT_JSON", path)
    return path


def _in_time(fn, table, seconds=20):
    """fn()'s value, or the exception it raised; it must end within ``seconds`` (reading a FIFO used to block
    SGLang's load_plugins() and info forever)."""
    result = {}

    def run():
        try:
            result["value"] = fn()
        except Exception as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(table, os.O_WRONLY | os.O_NONBLOCK))  # free the reader blocked on the FIFO
        pytest.fail(f"{fn.__name__}() hangs on {table}")
    return result


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_damaged_support_table_is_one_clear_error(table, damage):
    make, problem = DAMAGED[damage]
    make(table)
    error = _in_time(lambda: support.release_row("0.5.23"), table).get("error")
    assert isinstance(error, support.SupportTableError), error
    message = str(error)
    assert message.startswith(str(table)) and problem in message and "reinstall sglang-hicache-jit" in message


@pytest.mark.parametrize("damage", ["invalid JSON", "not UTF-8", "patched a string", "a FIFO"])
def test_info_names_the_damaged_table_and_never_tracebacks(table, damage, monkeypatch, capsys):
    import importlib.metadata

    DAMAGED[damage][0](table)
    monkeypatch.setattr(importlib.metadata, "version", _sglang_0_5_23(importlib.metadata.version))
    described = _in_time(support.describe, table)["value"]
    assert described["active"] is False and described["release"] is None
    assert described["line"].startswith(f"not active, SGLang runs unchanged: {table} ")
    assert DAMAGED[damage][1] in described["line"] and described["support_table"] in described["line"]
    code = cli.main(["info"])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err
    assert f"SGLang plugin not active, SGLang runs unchanged: {table} " in out


def test_a_support_table_of_a_foreign_owner_is_refused(table):
    if os.geteuid() != 0:
        pytest.skip("making a file of another user needs root")
    table.write_text(_release({}))
    os.chown(table, 4242, 4242)
    with pytest.raises(support.SupportTableError, match="is owned by uid 4242: neither root"):
        support.release_row("0.5.23")


def test_the_owner_of_the_package_directory_may_own_the_table(table):
    if os.geteuid() != 0:
        pytest.skip("making a file of another user needs root")
    table.write_text(_release({}))
    os.chown(table, 4242, 4242)
    os.chown(table.parent, 4242, 4242)
    assert support.release_row("0.5.23")["patched"] == ["MLA.describe"]


def test_a_symlink_inside_the_package_and_a_sound_table_are_read(table):
    (table.parent / "real.json").write_text(_release({}))
    table.symlink_to("real.json")
    assert support.release_row("0.5.23")["patched"] == ["MLA.describe"]
    assert support.release_row("0.5.99") is None


def test_the_shipped_table_passes_its_own_checks():
    rows = support.load_table(support.SUPPORT_JSON)
    assert "0.5.23" in rows and stat.S_ISREG(os.lstat(support.SUPPORT_JSON).st_mode)


def test_a_table_that_cannot_be_opened_names_the_reason(table, monkeypatch):
    table.write_text(_release({}))

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(table))

    monkeypatch.setattr(support.safeio, "read_regular", denied)
    with pytest.raises(support.SupportTableError, match=r"cannot be read \(Permission denied\)"):
        support.release_row("0.5.23")


# ---- issue 35: a bad setting raised later inside SGLang's backup thread; Ctrl-C left hooks behind --------------

BAD_SETTINGS = [("SGLANG_HICACHE_JIT_STAGING", "\u0663"), ("SGLANG_HICACHE_JIT_STAGING", "\uff15\uff11\uff12M"),
                ("SGLANG_HICACHE_JIT_STAGING", "lots"), ("SGLANG_HICACHE_JIT_METHOD", "fastest"),
                ("SGLANG_HICACHE_JIT_RESIDENT_BLOCKS", "0"), ("SGLANG_HICACHE_JIT_RESIDENT_IDLE_US", "-5"),
                ("SGLANG_HICACHE_BLOCK_QUOTA", "0"),
                ("SGLANG_HICACHE_JIT_LOCK_TIMEOUT", "nan"), ("SGLANG_HICACHE_JIT_CACHE_MAX_SIZE", "big"),
                ("SGLANG_HICACHE_JIT_BUILD_JOBS", "all"), ("SGLANG_HICACHE_JIT_ARCH", "sm_999"),
                ("SGLANG_HICACHE_JIT_CACHE_DIR", "/proc/hicache"), ("SGLANG_HICACHE_JIT_TRUSTED_OWNERS", "nobody-here-x")]


@pytest.mark.parametrize("variable, value", BAD_SETTINGS, ids=[f"{n.split('HICACHE_')[1]}={v!r}" for n, v in BAD_SETTINGS])
def test_a_bad_setting_is_refused_when_the_plugin_registers(sglang, monkeypatch, caplog, variable, value):
    """Refused means: no hook reaches SGLang's registry (so nothing of this package runs later, in its backup
    thread or layer loop), the WARNING names the variable, and status and info say so. register() does not
    raise, because SGLang's load_plugins() would log the traceback and serve on anyway."""
    monkeypatch.setenv(variable, value)
    plugin.register()
    assert sglang.HookRegistry.calls == [] and registered(sglang.HookRegistry) == 0
    assert plugin.status["registered"] is False and plugin.status["patched"] == []
    assert variable in plugin.status["reason"] and plugin.status["reason"].startswith("BadSettingError")
    warning, = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "plugin not active" in warning.getMessage() and variable in warning.getMessage()
    described = support.describe()
    assert described["active"] is False and variable in described["error"]
    assert described["line"].startswith("not active, SGLang runs unchanged: ") and variable in described["line"]


def test_a_bad_setting_does_not_matter_with_the_plugin_off(sglang, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_JIT_STAGING", "\u0663")
    monkeypatch.setenv("SGLANG_HICACHE_JIT_SGLANG_PLUGIN", "0")
    plugin.register()
    assert plugin.status["reason"] == "SGLANG_HICACHE_JIT_SGLANG_PLUGIN=0"
    assert support.describe()["error"] is None


def _interrupting_registry(at: int, after_adding: bool):
    """A registry stand-in whose ``at``-th register() call ends in KeyboardInterrupt (Ctrl-C), before or after
    it added the hook to its table."""
    registry = make_registry()
    plain = registry.register.__func__

    def register(cls, target, hook, hook_type=HookType.AFTER, *, source=None):
        if len(cls.calls) + 1 == at:
            if after_adding:
                plain(cls, target, hook, hook_type, source=source)
            raise KeyboardInterrupt
        plain(cls, target, hook, hook_type, source=source)

    registry.register = classmethod(register)
    return registry


@pytest.mark.parametrize("at", [1, 2, REPLACES + 1, len(TARGETS)])
@pytest.mark.parametrize("after_adding", [False, True], ids=["before-adding", "after-adding"])
def test_ctrl_c_while_registering_leaves_no_hook_and_a_true_status(sglang, caplog, at, after_adding):
    sglang.HookRegistry = registry = _interrupting_registry(at, after_adding)
    with pytest.raises(KeyboardInterrupt):
        plugin.register()
    assert dict(registry._hooks) == {}, "hooks stayed in SGLang's table"
    assert plugin.status["registered"] is False and plugin.status["patched"] == []
    assert "interrupted (KeyboardInterrupt)" in plugin.status["reason"]
    assert "plugin not active" in caplog.text


class _ListInterruptedOnSecondPass(list):
    """The planner's decisions; iterating them a second time (while register() records what it did) is
    where the KeyboardInterrupt lands."""

    passes = 0

    def __iter__(self):
        type(self).passes += 1
        if type(self).passes == 2:
            raise KeyboardInterrupt
        return super().__iter__()


def test_ctrl_c_after_the_last_hook_still_takes_every_hook_back(sglang, monkeypatch):
    decisions = _ListInterruptedOnSecondPass(Decision(t, t.paths[0], t.hooks[0]) for t in TARGETS)
    monkeypatch.setattr(plan_module, "plan", lambda facts: decisions)
    with pytest.raises(KeyboardInterrupt):
        plugin.register()
    assert len(sglang.HookRegistry.calls) == len(TARGETS) and registered(sglang.HookRegistry) == 0
    assert plugin.status["registered"] is False and plugin.status["patched"] == []


def test_ctrl_c_before_the_first_hook_says_so(sglang, monkeypatch):
    def interrupted(facts):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan_module, "plan", interrupted)
    with pytest.raises(KeyboardInterrupt):
        plugin.register()
    assert sglang.HookRegistry.calls == [] and plugin.status["registered"] is False
    assert "interrupted (KeyboardInterrupt) before any hook" in plugin.status["reason"]
