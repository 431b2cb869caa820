#!/usr/bin/env python3
"""Records SGLang releases from their wheels, for the plugin's tests and support table.

For each sglang release (``pip download --no-deps sglang==X``) it reads, with
``ast`` and without importing anything from the wheel:

* the parameters of every upstream function or method the plugin's target
  table names (``integrations/sglang/targets.py``), at every home listed;
* the attributes each pool class on those paths defines (its methods and
  every ``self.<name>`` it or its bases assign) and what each hooked method
  reads from its ``device_pool`` argument;
* the sglang-kernel version it pins, whether it has ``sglang.srt.plugins``,
  and the sha256 of the wheels the tests may download.

For each pinned sglang-kernel (``--kernels``; 300-600 MB a wheel, so only
when its record is missing) it records the signatures in
``sgl_kernel/kvcacheio.py``, from which the tests generate their stand-in.

Writes ``tests/sglang_data/sglang-<X>.json`` and
``tests/sglang_data/sglang-kernel-<Y>.json``, then, from every recorded
release, ``sglang_hicache_jit/integrations/sglang/support.json`` and the
support table in ``docs/sglang.md``, through the same planner the plugin runs.

    python3 tools/sglang_releases.py                  # every release in RELEASES
    python3 tools/sglang_releases.py 0.5.24 --kernels # add a release and its sglang-kernel
    python3 tools/sglang_releases.py --tables-only    # rewrite support.json and the docs table

A wheel that cannot be read as one (not a zip, no METADATA, a module that does not parse or nests too
deeply, classes that inherit from each other, a member larger than ``MAX_MEMBER_BYTES``) ends the run
with one line, ``error: <wheel>: <the problem>``, and exit status 1; nothing is written (records are
written only once every wheel of the run was read).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from sglang_hicache_jit.integrations.sglang import matching  # noqa: E402
from sglang_hicache_jit.integrations.sglang.plan import RecordedFacts, plan  # noqa: E402
from sglang_hicache_jit.integrations.sglang.targets import TARGETS  # noqa: E402
from release_kit import sha256, version_key  # noqa: E402

DATA = ROOT / "tests" / "sglang_data"
SUPPORT = ROOT / "sglang_hicache_jit" / "integrations" / "sglang" / "support.json"
DOC = ROOT / "docs" / "sglang.md"
RELEASES = ("0.5.10", "0.5.10.post1", "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14",
            "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22",
            "0.5.23")
# The Pythons whose wheels the tests download: CI (3.11) and the GPU machine (3.12).
PYTHONS = ("3.11", "3.12")
# The largest wheel member read (sglang's largest module is about 0.5 MB): bounds what a malformed wheel
# (a zip bomb, a size field that lies) can make this tool decompress into memory.
MAX_MEMBER_BYTES = 64 << 20
# Names whose value on a CUDA build a default may test (``16 if _is_hip else 32``).
CUDA_FLAGS = {"_is_hip": False, "_is_cuda": True, "_is_npu": False, "_is_xpu": False, "_is_mps": False,
              "_is_musa": False, "_is_cpu": False}


# ---------------------------------------------------------------------------
# Downloads.

def download(spec: str, dest: Path, python: str) -> Path:
    """``pip download --no-deps`` of one requirement's wheel for a CPython version into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", "--platform=manylinux2014_x86_64",
                    *[f"--platform=manylinux_2_{n}_x86_64" for n in (17, 28, 34)], "--platform=any",
                    "-d", str(dest), spec], check=True)
    name, version = spec.split("==")
    tags = (f"-cp{python.replace('.', '')}-", "-abi3-", "-py3-none-")
    wheels = [w for w in dest.glob(f"{name.replace('-', '_')}-{version}-*.whl") if any(t in w.name for t in tags)]
    if len(wheels) != 1:
        raise SystemExit(f"expected one wheel of {spec} for Python {python} in {dest}, found {[w.name for w in wheels]}")
    return wheels[0]


# ---------------------------------------------------------------------------
# Reading a wheel's Python without importing it.

class MalformedWheel(Exception):
    """A wheel this tool cannot read; the message names the wheel and the problem."""

    def __init__(self, wheel, problem: str):
        self.wheel, self.problem = str(wheel), problem
        super().__init__(f"{self.wheel}: {problem}")


class Wheel:
    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.zip = zipfile.ZipFile(path)
            self.names = set(self.zip.namelist())
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as exc:
            raise MalformedWheel(path, f"is not a readable zip archive ({type(exc).__name__}: {exc})") from None
        self._trees: dict = {}

    def read(self, member: str) -> bytes:
        """A member's bytes, at most MAX_MEMBER_BYTES of them whatever its header says."""
        try:
            with self.zip.open(member) as f:
                data = f.read(MAX_MEMBER_BYTES + 1)
        except KeyError:
            raise MalformedWheel(self.path, f"has no {member}") from None
        except Exception as exc:  # BadZipFile (a CRC that fails), zlib.error, an unknown compression, EOFError
            raise MalformedWheel(self.path, f"{member} cannot be read ({type(exc).__name__}: {exc})") from None
        if len(data) > MAX_MEMBER_BYTES:
            raise MalformedWheel(self.path, f"{member} is larger than {MAX_MEMBER_BYTES} bytes")
        return data

    def text(self, member: str) -> str:
        data = self.read(member)
        try:
            return data.decode()
        except UnicodeDecodeError as exc:
            raise MalformedWheel(self.path, f"{member} is not UTF-8 (byte {exc.start})") from None

    def parse(self, member: str) -> ast.Module:
        """A Python member's syntax tree, or MalformedWheel saying why not."""
        source = self.text(member)
        try:
            return ast.parse(source, filename=member)
        except SyntaxError as exc:
            raise MalformedWheel(self.path, f"{member} does not parse as Python (line {exc.lineno}: {exc.msg})") \
                from None
        except (ValueError, RecursionError, MemoryError) as exc:  # null bytes; nesting too deep for the parser
            raise MalformedWheel(self.path, f"{member} does not parse as Python ({type(exc).__name__}: "
                                            f"{exc or 'too deeply nested'})") from None

    def metadata(self) -> str:
        name = next((n for n in sorted(self.names) if n.endswith(".dist-info/METADATA")), None)
        if name is None:
            raise MalformedWheel(self.path, "has no *.dist-info/METADATA (not a wheel)")
        return self.text(name)

    def module_file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if candidate in self.names:
                return candidate
        return None

    def tree(self, module: str):
        if module not in self._trees:
            path = self.module_file(module)
            self._trees[module] = self.parse(path) if path else None
        return self._trees[module]

    def split(self, dotted: str):
        """(module, [attribute, ...]) for the longest module prefix this wheel has."""
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            module = ".".join(parts[:i])
            if self.module_file(module):
                return module, parts[i:]
        return None, parts

    def lookup(self, module: str, name: str, depth: int = 0):
        """(module, node) where a module-level name is defined, following ``from X import``."""
        tree = self.tree(module)
        if tree is None or depth > 10:
            return None
        found = None
        for node in tree.body:  # the last binding at module level wins, as at run time
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                found = (module, node)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        found = ("import", node.module, alias.name)
        if found and found[0] == "import":
            _, source, original = found
            if self.module_file(source):
                return self.lookup(source, original, depth + 1)
            sub = f"{source}.{original}"  # `from pkg import submodule`
            return (sub, None) if self.module_file(sub) else None
        return found

    def class_mro(self, module: str, node: ast.ClassDef, _below: tuple = ()) -> list:
        """C3 linearization over the classes this wheel defines (outside bases end the chain)."""
        here = (module, node.name)
        if here in _below:  # Python refuses such classes at import; without this check, a RecursionError
            chain = " -> ".join(f"{m}.{n}" for m, n in (*_below[_below.index(here):], here))
            raise MalformedWheel(self.path, f"classes inherit from each other ({chain})")
        bases = []
        for base in node.bases:
            ref = self.resolve_expr(module, base)
            if ref and isinstance(ref[1], ast.ClassDef):
                bases.append(ref)
        sequences = [self.class_mro(*b, (*_below, here)) for b in bases] + [bases]
        result = [(module, node)]
        while any(sequences):
            for seq in sequences:
                if not seq:
                    continue
                head = seq[0]
                if not any(head in s[1:] for s in sequences if s):
                    break
            else:
                raise MalformedWheel(self.path, f"class {node.name} in {module} has no consistent method order")
            result.append(head)
            sequences = [s[1:] if s and s[0] == head else s for s in sequences]
        return result

    def resolve_expr(self, module: str, expr: ast.expr):
        if isinstance(expr, ast.Name):
            return self.lookup(module, expr.id)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            return None  # a base named through a module attribute (abc.ABC): outside the wheel
        return None

    def find(self, dotted: str):
        """The AST node (and, for a method, its class) of a dotted name, or None."""
        module, attrs = self.split(dotted)
        if module is None or not attrs:
            return None
        ref = self.lookup(module, attrs[0])
        if ref is None or ref[1] is None:
            return None
        if len(attrs) == 1:
            return ref[1], None, ref
        if len(attrs) != 2 or not isinstance(ref[1], ast.ClassDef):
            return None
        for owner in self.class_mro(*ref):
            for node in owner[1].body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == attrs[1]:
                    return node, ref, owner
        return None


def _default(node: ast.expr) -> str:
    """The repr of a default value as a CUDA build evaluates it."""
    if isinstance(node, ast.IfExp) and isinstance(node.test, ast.Name) and node.test.id in CUDA_FLAGS:
        return _default(node.body if CUDA_FLAGS[node.test.id] else node.orelse)
    try:
        return repr(ast.literal_eval(node))
    except ValueError:
        return f"<{ast.unparse(node)}>"  # never equal to a live repr: a target with it does not fit


def params(fn: ast.FunctionDef) -> list:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = [(p.arg, "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD",
            None if d is None else _default(d)) for i, (p, d) in enumerate(zip(positional, defaults))]
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", None))
    out += [(p.arg, "KEYWORD_ONLY", None if d is None else _default(d)) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", None))
    return out


# ---------------------------------------------------------------------------
# Records.

def record_release(version: str, cache: Path) -> dict:
    wheels = {}
    for python in PYTHONS:
        wheel = download(f"sglang=={version}", cache / "sglang", python)
        wheels[wheel.name] = sha256(wheel)
    return record_wheel(wheel, version, wheels)


def record_wheel(path: Path, version: str, wheels: dict) -> dict:
    """The record of sglang ``version`` read from its wheel at ``path`` (``wheels``: name -> sha256)."""
    try:
        return _record_wheel(Wheel(path), version, wheels)
    except RecursionError:  # a default or a class chain nested beyond what ast's walkers take
        raise MalformedWheel(path, "nests deeper than Python's recursion limit allows to read it") from None


def _record_wheel(wheel: Wheel, version: str, wheels: dict) -> dict:
    meta = wheel.metadata()
    pin = re.search(r"^Requires-Dist: sglang-kernel==(\S+)", meta, re.M)
    torch_pin = re.search(r"^Requires-Dist: torch==(\S+)", meta, re.M)
    flashinfer_pin = re.search(r"^Requires-Dist: flashinfer[_-]python(?:\[[^]]*\])?==([^\s;]+)", meta, re.M)
    targets, classes, reads = {}, {}, {}
    for target in TARGETS:
        for path in target.paths:
            if path.startswith("sgl_kernel."):
                continue
            found = wheel.find(path)
            targets[path] = params(found[0]) if found else None
            if found and found[1] is not None:  # a method: its class's attributes and what it reads
                owner = path.rpartition(".")[0]
                names = set()
                for module, node in wheel.class_mro(*found[1]):
                    names |= matching.assigned_attributes(node)
                classes[owner] = sorted(names)
                device_pool = sorted(matching.attribute_reads(found[0], "device_pool"))
                if device_pool:
                    reads[path] = {"device_pool": device_pool}
    return {"sglang": version, "sglang_kernel": pin.group(1) if pin else None,
            "torch": torch_pin.group(1) if torch_pin else None,
            "flashinfer": flashinfer_pin.group(1) if flashinfer_pin else None,
            "plugins": "sglang/srt/plugins/hook_registry.py" in wheel.names,
            "wheels": dict(sorted(wheels.items())), "targets": targets, "classes": classes, "reads": reads}


def record_kernel(version: str, cache: Path) -> dict:
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # a wheel of hundreds of MB: not kept
        return record_kernel_wheel(download(f"sglang-kernel=={version}", Path(tmp), "3.12"), version)


def record_kernel_wheel(path: Path, version: str) -> dict:
    """The record of sglang-kernel ``version`` read from its wheel at ``path``: its kvcacheio signatures."""
    try:
        tree = Wheel(path).parse("sgl_kernel/kvcacheio.py")
        functions = {node.name: params(node) for node in tree.body
                     if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}
    except RecursionError:
        raise MalformedWheel(path, "nests deeper than Python's recursion limit allows to read it") from None
    return {"sglang_kernel": version, "kvcacheio": functions}


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")


def load_records() -> tuple[dict, dict]:
    releases = {json.loads(p.read_text())["sglang"]: json.loads(p.read_text()) for p in DATA.glob("sglang-0*.json")}
    kernels = {json.loads(p.read_text())["sglang_kernel"]: json.loads(p.read_text())
               for p in DATA.glob("sglang-kernel-*.json")}
    return releases, kernels


# ---------------------------------------------------------------------------
# The support table.

def support_rows(releases: dict, kernels: dict) -> dict:
    rows = {}
    for version in sorted(releases, key=version_key):
        release = releases[version]
        kernel = kernels.get(release["sglang_kernel"])
        row = {"sglang": version, "sglang_kernel": release["sglang_kernel"], "plugins": release["plugins"],
               "patched": [], "absent": [], "skipped": {}}
        if release["plugins"]:
            for d in plan(RecordedFacts(release, kernel)):
                if d.patched:
                    row["patched"].append(d.target.name)
                elif d.path is None:
                    row["absent"].append(d.target.name)
                else:
                    row["skipped"][d.target.name] = d.why
        else:
            row["note"] = "this release cannot load plugins (no sglang.srt.plugins)"
        if kernel is None:
            row["note"] = f"sglang-kernel {release['sglang_kernel']} not recorded: kvcacheio ops left out"
        rows[version] = row
    return rows


MARK_BEGIN = "<!-- support table: written by tools/sglang_releases.py; do not edit -->"
MARK_END = "<!-- end of support table -->"


def support_markdown(rows: dict) -> str:
    names = [t.name for t in TARGETS]
    groups = [("hicache ops", [n for n in names if n.startswith("hicache.")]),
              ("kvcacheio ops", [n for n in names if n.startswith("kvcacheio.")]),
              ("MLA pool", [n for n in names if n.startswith("MLA.")]),
              ("MHA pool", [n for n in names if n.startswith("MHA.")]),
              ("DSA indexer pool", [n for n in names if n.startswith("DSA.")]),
              ("base pool", [n for n in names if n.startswith("HostKVCache.")])]
    lines = [MARK_BEGIN, "", "| release | sglang-kernel | " + " | ".join(g for g, _ in groups) + " | not fitting |",
             "|---|---|" + "---|" * len(groups) + "---|"]
    for version, row in rows.items():
        if not row["plugins"]:
            lines.append(f"| {version} | {row['sglang_kernel']} | " + " | ".join("–" for _ in groups)
                         + " | cannot load plugins |")
            continue
        cells = []
        for _, members in groups:
            patched = sum(1 for n in members if n in row["patched"])
            present = sum(1 for n in members if n not in row["absent"])
            cells.append(f"{patched}/{present}" if present else "–")
        skipped = "; ".join(f"`{n}`" for n in sorted(row["skipped"])) or "none"
        lines.append(f"| {version} | {row['sglang_kernel']} | " + " | ".join(cells) + f" | {skipped} |")
    lines += ["", MARK_END]
    return "\n".join(lines)


def write_tables() -> None:
    releases, kernels = load_records()
    rows = support_rows(releases, kernels)
    write_json(SUPPORT, {"written_by": "tools/sglang_releases.py", "releases": rows})
    text = DOC.read_text()
    begin, end = text.find(MARK_BEGIN), text.find(MARK_END)
    if begin < 0 or end < 0:
        raise SystemExit(f"{DOC} has no support table markers ({MARK_BEGIN!r} ... {MARK_END!r})")
    DOC.write_text(text[:begin] + support_markdown(rows) + text[end + len(MARK_END):])
    print(f"wrote {SUPPORT.relative_to(ROOT)} and the table in {DOC.relative_to(ROOT)} ({len(rows)} releases)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("releases", nargs="*", help=f"sglang versions (default: {RELEASES[0]}..{RELEASES[-1]})")
    parser.add_argument("--kernels", action="store_true", help="also record each pinned sglang-kernel not yet recorded")
    parser.add_argument("--tables-only", action="store_true", help="only rewrite support.json and the docs table")
    parser.add_argument("--cache", type=Path, default=Path(os.path.expanduser("~/.cache/sglang-hicache-jit-tools")),
                        help="where downloaded sglang wheels are kept")
    args = parser.parse_args(argv)
    try:
        records = {} if args.tables_only else read_releases(args.releases or RELEASES, args.kernels, args.cache)
    except MalformedWheel as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    DATA.mkdir(parents=True, exist_ok=True)
    for name, data in records.items():  # only once every wheel was read: a malformed one leaves no half update
        write_json(DATA / name, data)
    write_tables()
    return 0


def read_releases(versions, kernels: bool, cache: Path) -> dict:
    """File name in tests/sglang_data -> record, for each release (and, with ``kernels``, each pinned
    sglang-kernel not yet recorded)."""
    records = {}
    for version in versions:
        release = record_release(version, cache)
        records[f"sglang-{version}.json"] = release
        print(f"sglang {version}: sglang-kernel {release['sglang_kernel']}, "
              f"{sum(v is not None for v in release['targets'].values())} target names present")
        pin = release["sglang_kernel"]
        name = f"sglang-kernel-{pin}.json"
        if kernels and pin and not (DATA / name).exists() and name not in records:
            records[name] = record_kernel(pin, cache)
            print(f"sglang-kernel {pin}: recorded")
    return records


if __name__ == "__main__":
    sys.exit(main())
