import pytest

from sglang_hicache_jit.buildcache.arch import Arch, archs_tag, parse_arch, parse_arch_list, resolve_archs
from sglang_hicache_jit.errors import NoArchError


@pytest.mark.parametrize("text,expected", [
    ("9.0", Arch(9, 0)),
    ("sm_90", Arch(9, 0)),
    ("90", Arch(9, 0)),
    ("9.0a", Arch(9, 0, "a")),
    ("10.0+PTX", Arch(10, 0, "", True)),
    ("compute_86", Arch(8, 6)),
    (" 12.0 ", Arch(12, 0)),
])
def test_parse_arch(text, expected):
    assert parse_arch(text) == expected


@pytest.mark.parametrize("bad", ["", "nine", "9", "9.0b", "sm90x", "9.0.1"])
def test_parse_arch_rejects_with_the_expected_form(bad):
    with pytest.raises(ValueError, match="arch|empty"):
        parse_arch_list(bad)


def test_arch_list_is_sorted_and_deduplicated():
    archs = parse_arch_list("10.0;8.0 9.0,9.0")
    assert [str(a) for a in archs] == ["8.0", "9.0", "10.0"]
    assert archs_tag(archs) == "sm80-sm90-sm100"


def test_nvcc_flags_embed_sass_and_optionally_ptx():
    assert Arch(9, 0).nvcc_flags() == ["-gencode=arch=compute_90,code=sm_90"]
    assert Arch(9, 0, "a", True).nvcc_flags() == [
        "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90a,code=compute_90a"]


def test_runs_on_follows_binary_compatibility():
    assert Arch(8, 0).runs_on((8, 6))
    assert not Arch(8, 6).runs_on((8, 0))
    assert not Arch(8, 0).runs_on((9, 0))  # machine code does not cross major versions
    assert Arch(9, 0, "a").runs_on((9, 0))
    assert not Arch(10, 0, "a").runs_on((10, 3))


def test_resolution_order(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    monkeypatch.setenv("SGLANG_HICACHE_JIT_ARCH", "9.0;10.0")
    assert resolve_archs("12.0") == ((Arch(12, 0),), "argument")
    assert resolve_archs() == ((Arch(9, 0), Arch(10, 0)), "SGLANG_HICACHE_JIT_ARCH")
    monkeypatch.delenv("SGLANG_HICACHE_JIT_ARCH")
    assert resolve_archs() == ((Arch(8, 0),), "TORCH_CUDA_ARCH_LIST")


def test_bad_environment_arch_names_the_variable(monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_JIT_ARCH", "hoppper")  # torch's names ('Hopper') are accepted
    with pytest.raises(ValueError, match="SGLANG_HICACHE_JIT_ARCH"):
        resolve_archs()


def test_no_gpu_and_no_arch_says_how_to_name_one(monkeypatch):
    monkeypatch.delenv("SGLANG_HICACHE_JIT_ARCH", raising=False)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr("sglang_hicache_jit.buildcache.arch.current_gpu_capability", lambda device=None: None)
    with pytest.raises(NoArchError, match="--arch 9.0") as info:
        resolve_archs()
    assert info.value.code == "no_arch"


def test_fast_paths_parse_as_the_patterns_do():
    """parse_arch reads plain 'M.m' without its regex, and parse_arch_list skips the split when there is
    nothing to split: both must give what the patterns give, for any input."""
    import random
    import re

    from sglang_hicache_jit.buildcache import arch

    pattern = re.compile(arch._ARCH_PATTERN, re.IGNORECASE)

    def by_pattern(text):
        match = pattern.match(text.strip())
        if not match:
            return None
        digits, minor, suffix, ptx = match.groups()
        if minor is None:
            if len(digits) < 2:
                return None
            digits, minor = digits[:-1], digits[-1]
        if len(digits.lstrip("0")) > 2:  # majors are one or two digits (arch.MAX_MAJOR)
            return None
        major, minor, suffix = int(digits), int(minor), suffix.lower()
        if (major, minor) not in arch.KNOWN_CAPABILITIES or (suffix == "a" and major < 9) or \
                (suffix == "f" and major < 10):  # no such GPU (issue 35)
            return None
        return arch.Arch(major, minor, suffix, bool(ptx))

    rng = random.Random(3)
    samples = ["9.0", "0.5", "10.0", "9.0a", "9.9", "8.0a", "12.0f", "9.0f", " 9.0 ", "9.x", "a.0", "9.00", "9,0", "9.0\u00a0"]
    samples += ["".join(rng.choice("0123456789.afsm_+PTX ") for _ in range(rng.randint(1, 5))) for _ in range(3000)]
    for text in samples:
        try:
            got = arch.parse_arch(text)
        except ValueError:
            got = None
        assert got == by_pattern(text), repr(text)
    for text in ["9.0", "9.0\u00a08.0", "8.0;9.0", "hopper", "9.0 ", "\u20039.0"]:
        try:
            got = arch.parse_arch_list(text)
        except ValueError:
            got = None
        parts = [p for p in re.split(r"[;,\s]+", text.strip()) if p]
        try:
            expected = tuple(sorted({a for p in parts for a in map(arch.parse_arch,
                                                                    arch.NAMED_ARCHS.get(p.lower(), p).split(";"))}))
        except ValueError:
            expected = None
        assert got == (expected or None), repr(text)


@pytest.mark.parametrize("text", ["9" * 5000 + ".0", "sm_" + "9" * 5000, "9" * 4000 + ".0", "sm_1000", "100.0"],
                         ids=["5000-digit-major", "sm_5000-digits", "4000-digit-major", "sm_1000", "100.0"])
def test_an_arch_major_is_read_by_the_bounded_reader(text):
    """Issue 18, T3: an arch's major of 5000 digits raised Python's int-string ValueError inside
    int(), and one of 4000 digits was accepted; a major is at most two digits."""
    with pytest.raises(ValueError, match="major version must be at most 99") as info:
        parse_arch(text)
    assert len(str(info.value)) < 200 and "int-string" not in str(info.value)


# ---- issue 35: `info` accepted SGLANG_HICACHE_JIT_ARCH=sm_999 (compute capability 99.9) -----------------------

@pytest.mark.parametrize("text", ["sm_999", "99.9", "9.9", "0.5", "1.0", "13.0", "sm_91", "8.0a", "9.0f",
                                  "9.\u0660", "sm_\u0669\u0660", "\uff19.0"])
def test_an_arch_no_gpu_has_is_refused(text):
    with pytest.raises(ValueError, match="compute capability|variant exists only|expected forms") as info:
        parse_arch_list(text)
    assert repr(text)[1:-1] in str(info.value) or text in str(info.value)


@pytest.mark.parametrize("text", ["3.5", "7.5", "8.6", "8.9", "9.0a", "10.0f", "10.3", "11.0", "12.1a", "sm_120",
                                  "blackwell", "rubin", "Ampere"])
def test_every_real_arch_is_still_read(text):
    assert parse_arch_list(text)


def test_info_marks_an_arch_no_gpu_has_invalid(monkeypatch, capsys):
    from sglang_hicache_jit import cli

    monkeypatch.setenv("SGLANG_HICACHE_JIT_ARCH", "sm_999")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    line, = [x for x in out.splitlines() if x.strip().startswith("SGLANG_HICACHE_JIT_ARCH")]
    assert "INVALID" in line and "99.9" in line
    assert "loads 99.9" not in out and "no arch to load" in out
    assert cli.main(["info", "--json"]) == 0
    import json

    document = json.loads(capsys.readouterr().out)
    record, = [s for s in document["settings"] if s["variable"] == "SGLANG_HICACHE_JIT_ARCH"]
    assert "99.9" in record["error"] and document["target"]["archs"] is None
