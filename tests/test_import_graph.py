"""The package's layout holds (docs/layout.md): read from the sources with ast, nothing imported.

* no import cycle among the package's modules;
* arrows point one way: errors, settings and safeio import none of the subpackages; buildcache/ never imports transfer/, integrations/ or bench/; transfer/ never
  imports integrations/ or bench/ (an alias module counts as the module it stands for);
* a module over 500 lines says why at its top (a "Why one long module:" line in its docstring);
* the top-level alias modules are the modules they name.

Each rule is a function over plain data, so the small tests at the end show it can fail.
"""

import ast
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "sglang_hicache_jit"
# Top-level names users import, each a module that puts the real one into sys.modules.
ALIASES = {f"{PACKAGE}.ops": f"{PACKAGE}.transfer.ops", f"{PACKAGE}.probe": f"{PACKAGE}.transfer.probe",
           f"{PACKAGE}.host_pool": f"{PACKAGE}.transfer.host_pool",
           f"{PACKAGE}.compat": f"{PACKAGE}.integrations.compat"}
# The cross-cutting modules everything may use; they use nothing above them.
BASE = {f"{PACKAGE}.errors", f"{PACKAGE}.settings", f"{PACKAGE}.safeio"}
# (importer, imported): a module under the first never imports one under any of the second.
FORBIDDEN = [("base", ("buildcache", "transfer", "integrations", "bench")),
             ("buildcache", ("transfer", "integrations", "bench")), ("transfer", ("integrations", "bench"))]
MAX_LINES = 500
LONG_REASON = "Why one long module:"


def package_modules() -> dict[str, Path]:
    modules = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports anywhere in its source (lazy imports in functions too)."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # 'from X import y' imports the module X.y when there is one, else a name of X.
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        else:
            continue
        for target in targets:
            # Importing a.b.c runs the __init__ of a and a.b first; the packages that hold this module
            # are initialized before it runs, so an arrow to them closes no cycle and is left out.
            while target:
                if target in known and target != name and not name.startswith(target + "."):
                    found.add(target)
                target = target.rpartition(".")[0]
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state = {}  # module -> 1 while on the DFS stack, 2 when done

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, stack)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [])
            if cycle:
                return cycle
    return None


def _part(module: str) -> str | None:
    module = ALIASES.get(module, module)
    if module in BASE:
        return "base"
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else None  # top-level modules belong to no subpackage


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for importer, imported in sorted(graph.items()):
        for target in sorted(imported):
            for low, high in FORBIDDEN:
                if _part(importer) == low and _part(target) in high:
                    bad.append(f"{importer} imports {target}")
    return bad


def long_without_reason(sources: dict[str, str]) -> list[str]:
    bad = []
    for name, text in sorted(sources.items()):
        lines = text.count("\n")
        if lines > MAX_LINES and LONG_REASON not in (ast.get_docstring(ast.parse(text)) or ""):
            bad.append(f"{name} ({lines} lines)")
    return bad


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_arrows_point_one_way():
    assert layer_violations(import_graph()) == []


def test_long_modules_say_why():
    sources = {name: path.read_text() for name, path in package_modules().items()}
    assert long_without_reason(sources) == [], f"add a '{LONG_REASON}' line to their docstrings, or split them"


@pytest.mark.parametrize("alias, target", sorted(ALIASES.items()))
def test_alias_modules_are_the_modules_they_name(alias, target):
    # In the source: the alias imports its target and nothing else from the package.
    path = package_modules()[alias]
    assert _imports(alias, path, set(package_modules())) == {target, *(_parents(target) - _parents(alias))}
    # And when imported: one module object under both names.
    assert importlib.import_module(alias) is importlib.import_module(target) is sys.modules[alias]


def _parents(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


# The rules above can fail: each meets a case it must refuse.

def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_layer_rule_refuses_an_arrow_back_up():
    graph = {f"{PACKAGE}.buildcache.loader": {f"{PACKAGE}.ops"},  # through the alias
             f"{PACKAGE}.transfer.ops": {f"{PACKAGE}.bench.demo"},
             f"{PACKAGE}.integrations.compat": {f"{PACKAGE}.transfer.ops"},  # allowed
             f"{PACKAGE}.settings": {f"{PACKAGE}.buildcache.arch"}}
    assert layer_violations(graph) == [f"{PACKAGE}.buildcache.loader imports {PACKAGE}.ops",
                                       f"{PACKAGE}.settings imports {PACKAGE}.buildcache.arch",
                                       f"{PACKAGE}.transfer.ops imports {PACKAGE}.bench.demo"]


def test_size_rule_refuses_a_long_module_without_a_reason():
    body = "x = 1\n" * (MAX_LINES + 1)
    assert long_without_reason({"m": '"""Short."""\n' + body}) == [f"m ({MAX_LINES + 2} lines)"]
    assert long_without_reason({"m": f'"""Short.\n\n{LONG_REASON} one thing.\n"""\n' + body}) == []


def test_the_graph_sees_relative_and_lazy_imports(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from .. import b\ndef f():\n    from .c import x\n")
    known = {"p", "p.b", "p.sub", "p.sub.a", "p.sub.c"}
    assert _imports("p.sub.a", pkg / "sub" / "a.py", known) == {"p.b", "p.sub.c"}
    (pkg / "c.py").write_text("import p.sub.a\n")  # another module's import runs p.sub's __init__ first
    assert _imports("p.c", pkg / "c.py", known | {"p.c"}) == {"p.sub", "p.sub.a"}
