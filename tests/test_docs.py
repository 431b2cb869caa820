"""The docs stand alone: every relative link resolves inside the repository, and nothing cites a design
file the repository does not contain."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = DOCS + sorted((ROOT / "sglang_hicache_jit").rglob("*.py")) + sorted((ROOT / "tools").glob("*"))
# Files allowed to cite DESIGN.md for now (the last test insists each still does). None left.
PENDING: set = set()
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = [target for target in _LINK.findall(doc.read_text())
              if "://" not in target and not (doc.parent / target).exists()]
    assert not broken, f"{doc.name} links to missing files: {broken}"


def test_no_citation_of_files_outside_the_repository():
    citing = [str(p.relative_to(ROOT)) for p in SOURCES
              if p.is_file() and "DESIGN.md" in p.read_text(errors="replace")]
    assert set(citing) <= PENDING, f"these cite DESIGN.md, which is not in the repository: {citing}"


def test_pending_exceptions_are_still_needed():
    stale = [name for name in PENDING if "DESIGN.md" not in (ROOT / name).read_text()]
    assert not stale, f"{stale} no longer cite DESIGN.md: remove them from PENDING"


# ---- docs/cli.md against the command itself --------------------------------------------------------------

CLI_MD = ROOT / "docs" / "cli.md"
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z])(?![\w-])")


def _sections(text: str) -> dict:
    """'## name' -> its text (up to the next '## ')."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _code(text: str) -> str:
    """What the text shows as code: fenced blocks and `spans`, where flags and keys are written."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```[a-z]*\n.*?^```", "", text, flags=re.MULTILINE | re.DOTALL))
    return "\n".join(blocks + spans)


def _help(capsys, *argv) -> str:
    from sglang_hicache_jit.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return capsys.readouterr().out


def _key_paths(value, prefix=()) -> set:
    """Every dict key of a JSON value as a path; list items share the path '[]'; "..." keys and items
    (the docs' placeholders) are left out."""
    paths = set()
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "...":
                continue
            paths.add(prefix + (key,))
            paths |= _key_paths(item, prefix + (key,))
    elif isinstance(value, list):
        for item in value:
            if item != "...":
                paths |= _key_paths(item, prefix + ("[]",))
    return paths


def _null_parents(value, prefix=()) -> set:
    """Paths whose value is null (or an empty list) in the real output: what is documented under them cannot
    be seen here."""
    found = set()
    if value is None or value == []:
        found.add(prefix)
    elif isinstance(value, dict):
        for key, item in value.items():
            found |= _null_parents(item, prefix + (key,))
    elif isinstance(value, list):
        for item in value:
            found |= _null_parents(item, prefix + ("[]",))
    return found


def test_every_info_json_key_in_cli_md_is_in_the_output_and_the_other_way(tmp_path, monkeypatch, capsys):
    import json

    from fleet_helpers import fake_entry
    from sglang_hicache_jit.buildcache.cache import BuildCache
    from sglang_hicache_jit.cli import main

    # A prebuilt layer and a cache with an entry each, so the entries' keys are in the output too.
    fake_entry(BuildCache(tmp_path / "layer"))
    fake_entry(BuildCache(tmp_path / "cache"))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_PREBUILT_DIRS", str(tmp_path / "layer"))
    monkeypatch.setenv("SGLANG_HICACHE_JIT_ARCH", "9.0")
    assert main(["info", "--json"]) == 0
    real = json.loads(capsys.readouterr().out)
    (block,) = re.findall(r"^`--json`:\n\n```json\n(.*?)^```", _sections(CLI_MD.read_text())["info"],
                          flags=re.MULTILINE | re.DOTALL)
    documented = _key_paths(json.loads(block))
    seen = _key_paths(real)
    hidden = _null_parents(real)  # e.g. sglang_plugin.release without SGLang, cuda_toolkit without nvcc
    if ("sglang_plugin", "release") in hidden:  # no SGLang here: its keys are a support table row's keys
        from sglang_hicache_jit.integrations.sglang import support

        seen |= {("sglang_plugin", "release", key) for key in support._ROW_KEYS}  # ("note" is optional)
    missing = sorted(".".join(p) for p in documented - seen if not any(p[:len(h)] == h for h in hidden))
    assert not missing, f"docs/cli.md documents info --json keys that the command does not print: {missing}"
    undocumented = sorted(".".join(p) for p in seen - documented)
    assert not undocumented, f"info --json prints keys that docs/cli.md does not show: {undocumented}"


def test_every_flag_cli_md_names_is_in_the_commands_help(capsys):
    sections = _sections(CLI_MD.read_text())
    commands = {"prewarm", "check", "info", "clean", "bench", "demo", "export", "import", "prune", "doctor"}
    common = set(_FLAG.findall(_help(capsys)))  # -q/-v and --version, taken before or after the command
    checked = 0
    for title, text in sections.items():
        names = [name for name in re.split(r"\s*/\s*", title) if name in commands]
        if not names:
            continue
        offered = set(common)
        for name in names:
            offered |= set(_FLAG.findall(_help(capsys, name)))
        named = set(_FLAG.findall(_code(text)))
        assert named, f"no flag found in the {title!r} section"
        assert named <= offered, f"docs/cli.md, {title}: {sorted(named - offered)} not in `{names[0]} --help`"
        checked += 1
    assert checked == 9, checked


def test_every_bench_provider_in_cli_md_is_taken_and_in_bench_help(capsys):
    from sglang_hicache_jit.bench.providers import check_provider

    text = _sections(CLI_MD.read_text())["bench"]
    rows = re.findall(r"^\| (`.+?) \|", text, flags=re.MULTILINE)
    names = [n for row in rows for n in re.findall(r"`([a-z][a-z0-9-]*[A-Z]?)`", row)]
    assert {"jit-resident", "direct", "direct-2d", "upstream", "torch-index"} <= set(names), names
    help_text = " ".join(_help(capsys, "bench").split())
    for name in names:
        concrete = re.sub(r"(?<=-[qrwa])[NRWA]$", "4", name)  # jit-qN -> jit-q4
        check_provider(concrete)  # raises for a name the benchmark does not take
        family, *parts = concrete.split("-")
        assert family in help_text, (name, help_text)
        for part in parts:
            word = part.rstrip("0123456789")
            if len(word) > 1:  # method and variant words: resident, plain, bulk, 2d, reg, tma
                assert f"-{part}" in help_text or f"-{word}" in help_text or f"|{word}" in help_text, (name, help_text)


def test_the_warm_load_target_is_one_number_in_the_bench_the_docs_and_the_test():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_loader", ROOT / "tools" / "benchmarks" / "loader.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    target = f"{bench.WARM_TARGET_MS:g} ms"
    source = (ROOT / "tools" / "benchmarks" / "loader.py").read_text()
    assert "target < 5 ms" not in source and source.count("target < {WARM_TARGET_MS} ms") == 2
    warm_path = (ROOT / "tests" / "test_warm_path.py").read_text()
    assert f"under {target} on a 2-core machine" in warm_path
    benchmarks = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert f"Target: **under {target}** median" in benchmarks
