"""Which hook goes where in the installed SGLang: the decision, from facts.

``plan(facts)`` walks the table in ``targets.py``: for each row it takes the
first home the release has, then the first candidate hook that fits it
(``matching.py``). The facts come from the imported release (``LiveFacts``,
what ``register()`` uses) or from a release recorded from its wheels
(``RecordedFacts``, what the tests and the support table use), so both reach
the same decisions by the same code.
"""

from __future__ import annotations

import ast
import inspect
import pkgutil
import textwrap
from dataclasses import dataclass

from . import matching
from .targets import TARGETS, Target


@dataclass(frozen=True)
class Decision:
    target: Target
    path: str | None = None  # where the release keeps it; None: nowhere
    hook: object = None  # what is registered there; None: nothing fits
    why: str = ""  # why nothing is registered

    @property
    def patched(self) -> bool:
        return self.hook is not None


def plan(facts) -> list:
    """One Decision per row of the target table."""
    decisions = []
    for target in TARGETS:
        absent = [facts.missing(path) for path in target.paths]
        if all(absent):
            decisions.append(Decision(target, why=f"not in this release ({absent[0]})"))
            continue
        path = target.paths[absent.index(None)]
        reasons = []
        for hook in target.hooks:
            why = _misfit(target.kind, hook, path, facts)
            if why is None:
                decisions.append(Decision(target, path, hook))
                break
            reasons.append(why if len(target.hooks) == 1 else f"{hook.__name__}: {why}")
        else:
            decisions.append(Decision(target, path, why="; ".join(reasons)))
    return decisions


def _misfit(kind: str, hook, path: str, facts) -> str | None:
    if kind == "REPLACE":
        return matching.replacement_mismatch(facts.params(path), matching.params_of(hook))
    if kind == "AROUND":
        owner = path.rpartition(".")[0]
        return matching.hook_mismatch(hook, facts.params(path), facts.class_attributes(owner),
                                      lambda param: facts.reads(path, param))
    return None  # AFTER hooks read only what they find (getattr), so the method's existence is enough


class LiveFacts:
    """Facts read from the SGLang (and sgl-kernel) this process imports."""

    def __init__(self):
        self._trees: dict = {}

    def missing(self, path: str) -> str | None:
        try:
            pkgutil.resolve_name(path)
        except Exception as exc:  # ImportError, AttributeError, or whatever a module raises on import
            return f"{type(exc).__name__}: {exc}"
        return None

    def params(self, path: str) -> tuple:
        return matching.params_of(pkgutil.resolve_name(path))

    def class_attributes(self, path: str) -> frozenset:
        cls = pkgutil.resolve_name(path)
        names = set(dir(cls))
        for klass in cls.__mro__[:-1]:
            node = self._class_node(klass)
            if node is not None:
                names |= matching.assigned_attributes(node)
        return frozenset(names)

    def reads(self, path: str, param: str) -> frozenset:
        try:
            source = textwrap.dedent(inspect.getsource(pkgutil.resolve_name(path)))
        except (OSError, TypeError):  # no source: nothing can be shown to be read
            return frozenset()
        return frozenset(matching.attribute_reads(ast.parse(source), param))

    def _class_node(self, klass) -> ast.ClassDef | None:
        """The class's definition in its module's source (parsed once per file), or None without source."""
        try:
            filename = inspect.getsourcefile(klass)
        except TypeError:  # a builtin
            return None
        if filename not in self._trees:
            try:
                with open(filename, encoding="utf-8") as f:
                    self._trees[filename] = ast.parse(f.read())
            except (OSError, SyntaxError, ValueError, TypeError):
                self._trees[filename] = None
        tree = self._trees[filename]
        if tree is None:
            return None
        return next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == klass.__name__),
                    None)


class RecordedFacts:
    """Facts of one release as ``tools/sglang_releases.py`` recorded them from its wheels.

    ``release``: the release's record; ``kernel``: the record of the sglang-kernel it pins (its
    ``kvcacheio`` functions), or None when that package is left out.
    """

    def __init__(self, release: dict, kernel: dict | None):
        self.release = release
        self._functions = dict(release["targets"])
        for name, params in (kernel or {}).get("kvcacheio", {}).items():
            self._functions[f"sgl_kernel.kvcacheio.{name}"] = params

    def missing(self, path: str) -> str | None:
        if self._functions.get(path) is not None:
            return None
        if path.startswith("sgl_kernel."):
            return "sgl_kernel.kvcacheio has no such function"
        return f"not in sglang {self.release['sglang']}"

    def params(self, path: str) -> tuple:
        return tuple(tuple(p) for p in self._functions[path])

    def class_attributes(self, path: str) -> frozenset:
        return frozenset(self.release["classes"][path])

    def reads(self, path: str, param: str) -> frozenset:
        return frozenset(self.release["reads"].get(path, {}).get(param, ()))
