"""The plugin's decisions for every recorded SGLang release, from the records (no SGLang imported).

tests/sglang_data/ holds what tools/sglang_releases.py read from each release
wheel and from the sglang-kernel wheel it pins; the planner that register()
runs decides from those facts here, so these tests state the support matrix
and check it release by release. test_sglang_releases.py then checks, on each
release's real code, that the live plugin decides the same.
"""

import logging
import ast
import inspect
import sys
import textwrap
from pathlib import Path

import pytest

import release_kit
from sglang_hicache_jit.integrations.sglang import matching, pools
from sglang_hicache_jit.integrations.sglang import ops as routed
from sglang_hicache_jit.integrations.sglang.plan import RecordedFacts, plan
from sglang_hicache_jit.integrations.sglang.targets import TARGETS

ROOT = Path(__file__).resolve().parent.parent
RELEASES = release_kit.recorded()
WITH_PLUGINS = [v for v in RELEASES if release_kit.record(v)["plugins"]]
SEED_RELEASES = [v for v in RELEASES if release_kit.version_key(v) >= release_kit.version_key("0.5.16")]


def decisions(version: str) -> dict:
    rec = release_kit.record(version)
    return {d.target.name: d for d in plan(RecordedFacts(rec, release_kit.kernel_record(rec["sglang_kernel"])))}


def _tool():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import sglang_releases
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return sglang_releases


def test_every_release_from_0_5_10_to_0_5_23_is_recorded_with_its_kernel():
    for minor in range(10, 24):
        assert f"0.5.{minor}" in RELEASES
    for version in RELEASES:
        rec = release_kit.record(version)
        assert rec["sglang"] == version and rec["wheels"]
        assert release_kit.kernel_record(rec["sglang_kernel"]) is not None, rec["sglang_kernel"]
        recorded = set(rec["targets"])
        for target in TARGETS:
            for path in target.paths:
                if not path.startswith("sgl_kernel."):
                    assert path in recorded, f"{version} lacks {path}: run tools/sglang_releases.py {version}"


def test_support_table_and_docs_are_written_from_the_records():
    tool = _tool()
    releases, kernels = tool.load_records()
    rows = tool.support_rows(releases, kernels)
    import json

    assert json.loads(tool.SUPPORT.read_text())["releases"] == rows, "run tools/sglang_releases.py --tables-only"
    assert tool.support_markdown(rows) in tool.DOC.read_text(), "run tools/sglang_releases.py --tables-only"


def test_plugins_arrive_in_0_5_11():
    assert [v for v in RELEASES if not release_kit.record(v)["plugins"]] == ["0.5.10", "0.5.10.post1"]


@pytest.mark.parametrize("version", WITH_PLUGINS)
def test_nothing_present_is_left_unfitted(version):
    skipped = {name: d.why for name, d in decisions(version).items() if d.path is not None and not d.patched}
    assert skipped == {}


@pytest.mark.parametrize("version", SEED_RELEASES)
def test_the_seed_path_is_covered_from_0_5_16(version):
    """The seed's error lives in MLATokenToKVPoolHost._backup_from_device_per_layer (0.5.16+): the predicate,
    the one-layer op and that method are hooked in every release that has them."""
    d = decisions(version)
    for name in ("hicache.can_use_hicache_jit_kernel", "hicache.transfer_hicache_one_layer_mla",
                 "MLA._backup_from_device_per_layer", "MLA.backup_from_device_all_layer",
                 "DSA._backup_from_device_per_layer", "kvcacheio.transfer_kv_per_layer_mla",
                 "kvcacheio.transfer_kv_per_layer_mla_pf_lf"):
        assert d[name].patched, (name, d[name].why)


@pytest.mark.parametrize("version, module", [("0.5.14", "sglang.jit_kernel.hicache"),
                                             ("0.5.16", "sglang.jit_kernel.hicache"),
                                             ("0.5.17", "sglang.kernels.ops.kvcache.hicache"),
                                             ("0.5.23", "sglang.kernels.ops.kvcache.hicache")])
def test_the_predicate_is_found_where_each_release_keeps_it(version, module):
    assert decisions(version)["hicache.can_use_hicache_jit_kernel"].path == f"{module}.can_use_hicache_jit_kernel"


@pytest.mark.parametrize("version, mla, dsa", [
    ("0.5.16", "mla_backup_from_device_per_layer_0516", "dsa_backup_from_device_per_layer_0516"),
    ("0.5.18", "mla_backup_from_device_per_layer_0516", "dsa_backup_from_device_per_layer_0516"),
    ("0.5.19", "mla_backup_from_device_per_layer_0516", "dsa_backup_from_device_per_layer_0516"),
    ("0.5.21", "mla_backup_from_device_per_layer_0516", "dsa_backup_from_device_per_layer_0516"),
    ("0.5.22", "mla_backup_from_device_per_layer_0522", "dsa_backup_from_device_per_layer"),
    ("0.5.23", "mla_backup_from_device_per_layer", "dsa_backup_from_device_per_layer")])
def test_each_release_gets_its_family_of_per_layer_hooks(version, mla, dsa):
    d = decisions(version)
    assert d["MLA._backup_from_device_per_layer"].hook.__name__ == mla
    assert d["DSA._backup_from_device_per_layer"].hook.__name__ == dsa


def test_dsa_hooks_follow_the_class_to_pool_host_in_0_5_19():
    assert decisions("0.5.18")["DSA._backup_from_device_per_layer"].path.startswith(
        "sglang.srt.mem_cache.memory_pool_host.")
    assert decisions("0.5.19")["DSA._backup_from_device_per_layer"].path.startswith(
        "sglang.srt.mem_cache.pool_host.dsa.")


@pytest.mark.parametrize("kernel", sorted({release_kit.record(v)["sglang_kernel"] for v in RELEASES}))
def test_routed_kvcacheio_ops_take_every_call_of_each_pinned_sglang_kernel(kernel):
    functions = release_kit.kernel_record(kernel)["kvcacheio"]
    for name in routed.KVCACHEIO_OPS:
        theirs = tuple(tuple(p) for p in functions[name])
        assert matching.replacement_mismatch(theirs, matching.params_of(getattr(routed, name))) is None, name


def test_block_quota_none_of_sglang_kernel_0_4_7_is_a_tuning_knob():
    old = release_kit.kernel_record("0.4.6.post1")["kvcacheio"]["transfer_kv_per_layer_mla"]
    new = release_kit.kernel_record("0.4.10")["kvcacheio"]["transfer_kv_per_layer_mla"]
    assert ("block_quota", "POSITIONAL_OR_KEYWORD", "2") in map(tuple, old)
    assert ("block_quota", "POSITIONAL_OR_KEYWORD", "None") in map(tuple, new)


# ---------------------------------------------------------------------------
# The checks themselves can say no.

P, K = "POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY"


@pytest.mark.parametrize("original, ours, fits", [
    ((("a", P, None), ("b", P, "2")), (("a", P, None), ("b", P, "2")), True),
    ((("a", P, None), ("block_quota", P, "2")), (("a", P, None), ("block_quota", P, "None")), True),  # a knob
    ((("a", P, None), ("b", P, "2")), (("a", P, None), ("b", P, "None")), False),  # a real default differs
    ((("a", P, None), ("b", P, None)), (("b", P, None), ("a", P, None)), False),  # order
    ((("a", P, None),), (("a", P, None), ("page_size", K, "None")), True),  # ours has more, with a default
    ((("a", P, None),), (("a", P, None), ("c", K, None)), False),  # ours needs more
    ((("a", P, None), ("x", K, None)), (("a", P, None),), False),  # theirs has more
    ((("a", P, None), ("x", K, None)), (("a", P, None), ("x", P, None)), False),  # kind
])
def test_replacement_mismatch(original, ours, fits):
    assert (matching.replacement_mismatch(original, ours) is None) is fits


class FakeFacts:
    def __init__(self, params: dict, attributes=frozenset(), reads=None):
        self._params, self._attributes, self._reads = params, attributes, reads or {}

    def missing(self, path):
        return None if path in self._params else "absent"

    def params(self, path):
        return self._params[path]

    def class_attributes(self, path):
        return self._attributes

    def reads(self, path, param):
        return frozenset(self._reads.get(param, ()))


MLA_PER_LAYER = "sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost._backup_from_device_per_layer"
NEW = (("self", P, None), ("host_indices", P, None), ("device_indices", P, None), ("layer_id", P, None),
       ("io_backend", P, None), ("is_draft", K, "False"))
WITH_POOL = NEW[:1] + (("device_pool", P, None),) + NEW[1:]


def _decide(params, attributes, reads=None):
    facts = FakeFacts({MLA_PER_LAYER: params}, frozenset(attributes), reads)
    return next(d for d in plan(facts) if d.target.name == "MLA._backup_from_device_per_layer")


def test_hooks_are_chosen_by_what_the_pool_has():
    base = set(pools._MLA_POOL) | {"_host_layer_index"}
    newest = base | {"_host_layer_by_controller", "device_kv_buffers", "_buffer_index_by_layer"}
    assert _decide(NEW, newest).hook is pools.mla_backup_from_device_per_layer
    assert _decide(NEW, base | {"device_kv_buffers"}).hook is pools.mla_backup_from_device_per_layer_0522
    old = _decide(WITH_POOL, base, {"device_pool": {"kv_buffer"}})
    assert old.hook is pools.mla_backup_from_device_per_layer_0516


@pytest.mark.parametrize("params, attributes, reads, why", [
    (NEW, set(pools._MLA_POOL), None, "the pool has no"),  # a 0.5.22-shaped method without its attributes
    (WITH_POOL, set(pools._MLA_POOL) | {"_host_layer_index"}, {"device_pool": {"k_buffer"}}, "does not read"),
    (NEW[:-1] + (("is_draft", K, "True"),), set(pools._MLA_POOL) | {"_host_layer_index", "device_kv_buffers"},
     None, "defaults to True"),
    (NEW + (("stream", K, "None"),), set(pools._MLA_POOL) | {"_host_layer_index", "device_kv_buffers"}, None,
     "unknown to the hook"),
    (NEW[:-1], set(pools._MLA_POOL) | {"_host_layer_index", "device_kv_buffers", "_buffer_index_by_layer"}, None,
     "a later release family"),
])
def test_a_hook_whose_needs_the_release_lacks_is_skipped(params, attributes, reads, why):
    d = _decide(params, attributes, reads)
    assert not d.patched and why in d.why, d.why


def test_an_op_with_another_signature_is_skipped():
    path = "sglang.kernels.ops.kvcache.hicache.transfer_hicache_one_layer_mla"
    facts = FakeFacts({path: (("cache_dst", P, None), ("indices_dst", P, None), ("cache_src", P, None),
                              ("indices_src", P, None), ("element_dim", K, "None"), ("stride", K, None))})
    d = next(d for d in plan(facts) if d.target.name == "hicache.transfer_hicache_one_layer_mla")
    assert d.path == path and not d.patched and "'stride' is unknown here" in d.why


# ---------------------------------------------------------------------------
# The hooks' declared needs are what their code uses.

def _function(fn) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


def _used(fn, name: str, seen=None) -> set:
    """Attributes ``fn`` reads from its parameter ``name``, following calls in pools.py that pass it on."""
    seen = seen if seen is not None else set()
    if fn in seen:
        return set()
    seen.add(fn)
    node = _function(fn)
    used = matching.attribute_reads(node, name)
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
        helper = getattr(pools, call.func.id, None)
        if not inspect.isfunction(helper):
            continue
        params = [p.arg for p in _function(helper).args.args]
        for i, arg in enumerate(call.args):
            if isinstance(arg, ast.Name) and arg.id == name and i < len(params):
                used |= _used(helper, params[i], seen)
    return used


def _kwargs_read(fn) -> set:
    return {call.args[0].value for call in ast.walk(_function(fn))
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "get"
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "kwargs"}


AROUND_HOOKS = sorted({h for t in TARGETS if t.kind == "AROUND" for h in t.hooks}, key=lambda h: h.__name__)


@pytest.mark.parametrize("hook", AROUND_HOOKS, ids=lambda h: h.__name__)
def test_declared_needs_match_the_hook_code(hook):
    need = hook.needs
    assert _used(hook, "self") == set(need.attributes)
    params = [p[0] for p in matching.hook_params(hook)]
    for param in params[1:]:
        assert _used(hook, param) == set(need.reads.get(param, ())), param
    assert _kwargs_read(hook) <= set(need.kwargs)


# ---- issue 35: a hook on a pool instance without `layout` raised AttributeError -------------------------------

def _call_with_sentinels(hook, pool, original):
    """Calls ``hook`` as SGLang's AROUND would, with a sentinel per parameter (io_backend a real one)."""
    params = [p[0] for p in matching.hook_params(hook)][1:]  # after self
    args = tuple("direct" if name == "io_backend" else 7 if name == "layer_id" else object() for name in params)
    return args, hook(original, pool, *args)


LACKING = [pytest.param(hook, present, id=f"{hook.__name__}-{'+'.join(present) or 'nothing'}")
           for hook in AROUND_HOOKS for present in ((), ("layout",)) if not set(hook.needs.attributes) <= set(present)]


@pytest.mark.parametrize("hook, present", LACKING)
def test_a_pool_without_what_a_hook_reads_runs_its_own_method(hook, present, caplog):
    """A pool subclass that never sets `layout` (or another attribute the hook reads): the hook cannot tell
    the cell, so SGLang's own method runs with the call as it came, and one WARNING per class says why."""
    pool = type("CustomHostPool", (), {name: "page_first" for name in present})()
    calls = []

    def original(self, *args, **kwargs):
        calls.append((self, args, kwargs))
        return "upstream"

    with caplog.at_level(logging.WARNING, logger=pools.log.name):
        for _ in range(2):
            args, result = _call_with_sentinels(hook, pool, original)
            assert result == "upstream" and calls[-1] == (pool, args, {})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "CustomHostPool has no " in warnings[0] and "SGLang's own code" in warnings[0]
