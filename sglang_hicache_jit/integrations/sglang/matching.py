"""Does a hook fit the SGLang release that is installed? Checks over plain facts.

A release is described by *facts*: the parameters of each upstream function
or method the plugin could hook, the attributes each pool class defines, and
the attributes each method reads from one of its parameters (``device_pool``).
``LiveFacts`` (in ``plan.py``) reads them from the imported SGLang; the
tests and ``tools/sglang_releases.py`` read the same facts from the release
wheels. The checks below see only those facts, so the running plugin and the
recorded support table cannot disagree about what fits.

Parameters are ``(name, kind, default)`` tuples: ``kind`` is the name of an
``inspect.Parameter`` kind, ``default`` the ``repr`` of the default value, or
None when there is none.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field

Param = tuple  # (name: str, kind: str, default: str | None)

POSITIONAL = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")

# Launch knobs of upstream's kernels (CTAs, warps, vector width). The routed
# ops take them under the same names but resolve their own default when the
# caller leaves one out, so upstream's default value for these does not have
# to match: 2 in sgl-kernel 0.4.1-0.4.6 and None (resolved at call time) in
# 0.4.7+ both mean "the default".
TUNING_KNOBS = frozenset({"unroll", "block_quota", "num_warps_per_block"})


def params_of(fn) -> tuple:
    """The parameters of a live function, as facts."""
    return tuple((p.name, p.kind.name, None if p.default is p.empty else repr(p.default))
                 for p in inspect.signature(fn).parameters.values())


def replacement_mismatch(original: tuple, replacement: tuple) -> str | None:
    """Why ``replacement`` cannot take every call that ``original`` takes, with the same meaning; None if it can.

    Every parameter of the original must be there under the same name and
    kind (positional ones at the same place) with the same default, except
    for tuning knobs; parameters only the replacement has need a default,
    so a caller of the original never has to pass them.
    """
    ours = {p[0]: p for p in replacement}
    ours_positional = [p[0] for p in replacement if p[1] in POSITIONAL]
    theirs_positional = [p[0] for p in original if p[1] in POSITIONAL]
    if ours_positional[:len(theirs_positional)] != theirs_positional:
        return f"positional parameters {theirs_positional}, ours {ours_positional}"
    for name, kind, default in original:
        if name not in ours:
            return f"parameter {name!r} is unknown here"
        _, our_kind, our_default = ours[name]
        if our_kind != kind:
            return f"parameter {name!r} is {kind}, ours {our_kind}"
        if default is not None and name not in TUNING_KNOBS and our_default != default:
            return f"parameter {name!r} defaults to {default}, ours to {our_default}"
        if default is not None and our_default is None:
            return f"parameter {name!r} has a default there, none here"
    theirs = {p[0] for p in original}
    for name, kind, default in replacement:
        if name not in theirs and default is None and kind not in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            return f"our parameter {name!r} has no default and is not passed by this release"
    return None


@dataclass(frozen=True)
class Needs:
    """What a pool hook uses of the method it wraps, beyond the parameters in its own signature.

    ``kwargs``: keyword-only parameters it reads or passes on, with the default it assumes;
    ``attributes``: attributes of ``self`` it touches; ``reads``: attributes it reads from a
    parameter, which the wrapped method itself must read from that parameter (so they exist
    whatever the caller passes); ``absent``: attributes whose presence marks a later release
    family that this hook must not be used for.
    """

    kwargs: dict = field(default_factory=dict)
    attributes: frozenset = frozenset()
    reads: dict = field(default_factory=dict)
    absent: frozenset = frozenset()


def needs(*, kwargs=None, attributes=(), reads=None, absent=()):
    """Declares a hook's Needs (a test checks the declaration against the hook's code)."""
    def mark(fn):
        fn.needs = Needs(dict(kwargs or {}), frozenset(attributes), {k: frozenset(v) for k, v in (reads or {}).items()},
                         frozenset(absent))
        return fn
    return mark


def hook_params(hook) -> list:
    """The parameters a hook takes for the wrapped method: its own, less ``original`` and ``**kwargs``."""
    params = [p for p in params_of(hook) if p[1] != "VAR_KEYWORD"]
    if not params or params[0][0] != "original":
        raise TypeError(f"{hook.__qualname__}: a pool hook's first parameter is 'original'")
    return params[1:]


def hook_mismatch(hook, target: tuple, attributes: frozenset, reads) -> str | None:
    """Why ``hook`` cannot wrap a method with parameters ``target`` on a class that
    defines ``attributes``; None if it can. ``reads(param)`` gives the attributes the
    method reads from one of its parameters."""
    need: Needs = hook.needs
    ours = [p[0] for p in hook_params(hook)]
    theirs_positional = [p[0] for p in target if p[1] in POSITIONAL]
    if theirs_positional != ours:
        return f"parameters {theirs_positional}, the hook takes {ours}"
    for name, kind, default in target:
        if kind == "KEYWORD_ONLY":
            if name not in need.kwargs:
                return f"keyword parameter {name!r} is unknown to the hook"
            if default != repr(need.kwargs[name]):
                return f"keyword parameter {name!r} defaults to {default}, the hook assumes {need.kwargs[name]!r}"
        elif kind in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            return f"the method takes {'*args' if kind == 'VAR_POSITIONAL' else '**kwargs'}"
    missing = sorted(need.attributes - attributes)
    if missing:
        return f"the pool has no {', '.join(missing)}"
    present = sorted(need.absent & attributes)
    if present:
        return f"the pool has {', '.join(present)} (a later release family)"
    for param, names in need.reads.items():
        unread = sorted(names - reads(param))
        if unread:
            return f"the method does not read {param}.{', '.join(unread)}"
    return None


# ---------------------------------------------------------------------------
# Facts from source code (the same functions serve the live plugin and the tool
# that reads release wheels, so both see the same attributes).

def assigned_attributes(cls: ast.ClassDef) -> set:
    """Names a class body defines, and every ``self.<name>`` its methods assign."""
    names = set()
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(stmt.name)
            args = stmt.args.posonlyargs + stmt.args.args
            if args:
                names |= _stores_on(stmt, args[0].arg)
        elif isinstance(stmt, ast.ClassDef):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for target in targets:
                for node in ast.walk(target):
                    if isinstance(node, ast.Name):
                        names.add(node.id)
    return names


def _stores_on(fn: ast.AST, name: str) -> set:
    return {node.attr for node in ast.walk(fn)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id == name}


def attribute_reads(fn: ast.AST, name: str) -> set:
    """Attributes that code reads from the variable ``name`` (``name.x``, in any context but a store)."""
    return {node.attr for node in ast.walk(fn)
            if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id == name}
