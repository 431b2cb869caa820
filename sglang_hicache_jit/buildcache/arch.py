"""Which GPU architectures to build for: parsing, naming and resolution.

An arch list looks like ``9.0``, ``8.0;9.0;10.0`` or ``8.0 9.0+PTX`` (the
TORCH_CUDA_ARCH_LIST syntax; ``sm_90`` and ``90`` are accepted too, and so
are torch's arch names such as ``Hopper``, which stand for what they stand
for in torch). Several archs build one fat binary, at most ``MAX_ARCHS``.
Resolution order: the caller's argument, then SGLANG_HICACHE_JIT_ARCH, then
TORCH_CUDA_ARCH_LIST (``native`` there means the current GPU), then the
current GPU.
"""

from __future__ import annotations

import re

from .. import settings
from ..errors import BadSettingError, NoArchError
from .record import record

# torch.utils.cpp_extension's names for TORCH_CUDA_ARCH_LIST (torch 2.9-2.14),
# copied because importing cpp_extension costs a second; matched ignoring case.
NAMED_ARCHS = {
    "kepler+tesla": "3.7", "kepler": "3.5+PTX", "maxwell+tegra": "5.3", "maxwell": "5.0;5.2+PTX",
    "pascal": "6.0;6.1+PTX", "volta+tegra": "7.2", "volta": "7.0+PTX", "turing": "7.5+PTX",
    "ampere+tegra": "8.7", "ampere": "8.0;8.6+PTX", "ada": "8.9+PTX", "hopper": "9.0+PTX",
    "blackwell+tegra": "11.0", "blackwell": "10.0;10.3;12.0;12.1+PTX", "rubin": "10.7+PTX",
}
# One fat build names every arch in its directory and lock names, which must
# stay under the 255-byte file name limit; no real fleet needs more.
MAX_ARCHS = 16

# ASCII digits only ([0-9], not \d): '9.\u0660' (an Arabic-Indic zero) must not read as 9.0.
_ARCH_PATTERN = r"^(?:sm_?|compute_?)?([0-9]+)(?:\.([0-9]))?([af]?)(\+ptx)?$"
_ARCH_RE = None  # compiled at the first arch that is not plain 'M.m' (compiling costs 0.2 ms of a warm load)
MAX_MAJOR = 99  # compute capability majors are one or two digits (12.0 is sm_120)
# Every compute capability of a shipped or announced NVIDIA GPU, from Kepler on (nvcc 13.0 targets 7.5 to
# 12.1; older toolkits down to 3.0). Anything else is a typo ('sm_999' read as 99.9 and was accepted): the
# nvcc of the first build would refuse it only minutes later, and `info` said it would load it. 10.1 is
# CUDA 12.8's name for what CUDA 13 calls 11.0; 10.7 is what torch's arch name 'Rubin' stands for.
KNOWN_CAPABILITIES = frozenset({
    (3, 0), (3, 2), (3, 5), (3, 7), (5, 0), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2), (7, 0), (7, 2), (7, 5),
    (8, 0), (8, 6), (8, 7), (8, 8), (8, 9), (9, 0), (10, 0), (10, 1), (10, 3), (10, 7), (11, 0), (12, 0), (12, 1),
})
# Arch-specific ('a') code exists from Hopper on, family-specific ('f') from Blackwell on (CUDA 12.9).
_SUFFIX_FROM = {"a": 9, "f": 10}


def _check_known(shown: str, major: int, minor: int, suffix: str) -> None:
    if (major, minor) not in KNOWN_CAPABILITIES:
        known = ", ".join(f"{a}.{b}" for a, b in sorted(KNOWN_CAPABILITIES))
        raise ValueError(f"arch {shown} reads as compute capability {major}.{minor}, which no NVIDIA GPU has; "
                         f"known: {known}")
    if suffix and major < _SUFFIX_FROM[suffix]:
        raise ValueError(f"arch {shown}: the '{suffix}' variant exists only from compute capability "
                         f"{_SUFFIX_FROM[suffix]}.0 on")


# Records on the warm path are record() tuples (immutable, hashable, ordered by their fields): defining
# a frozen dataclass costs 0.5-0.8 ms on a small machine, a typing.NamedTuple ~0.2 ms and a
# collections.namedtuple ~0.12 ms, against ~0.02 ms, and a whole warm load takes about 4 ms (record.py).
class Arch(record("Arch", ["major", "minor", "suffix", "ptx"], defaults=("", False))):
    """One compute capability, e.g. 9.0: major and minor (int), suffix ('' or 'a'/'f': arch-specific
    features), ptx (bool: also embed PTX, forward compatible, JIT-compiled by the driver)."""

    __slots__ = ()

    @property
    def number(self) -> str:
        return f"{self.major}{self.minor}{self.suffix}"

    @property
    def tag(self) -> str:
        return f"sm{self.number}" + ("+ptx" if self.ptx else "")

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}{self.suffix}" + ("+PTX" if self.ptx else "")

    def nvcc_flags(self) -> list[str]:
        flags = [f"-gencode=arch=compute_{self.number},code=sm_{self.number}"]
        if self.ptx:
            flags.append(f"-gencode=arch=compute_{self.number},code=compute_{self.number}")
        return flags

    def runs_on(self, capability: tuple[int, int]) -> bool:
        """True when this arch's machine code runs on a GPU of ``capability``.

        sm_XY code runs on X.Z with Z >= Y; 'a'/'f' variants only on X.Y itself
        ('f' also on later minors of the same family).
        """
        major, minor = capability
        if major != self.major or minor < self.minor:
            return False
        return self.suffix != "a" or minor == self.minor


def parse_arch(text: str) -> Arch:
    global _ARCH_RE
    text = text.strip()
    if len(text) == 3 and text[1] == "." and text[0] in "123456789" and text[2] in "0123456789":
        major, minor = int(text[0]), int(text[2])  # '9.0', the common form, without the regex
        if (major, minor) in KNOWN_CAPABILITIES:
            return Arch(major, minor)
        _check_known(settings.shown(text), major, minor, "")
    if _ARCH_RE is None:
        _ARCH_RE = re.compile(_ARCH_PATTERN, re.IGNORECASE)
    match = _ARCH_RE.match(text)
    shown = settings.shown(text)
    if not match:
        raise ValueError(
            f"arch {shown} is not a compute capability; expected forms like '9.0', '9.0a', "
            "'sm_90' or '8.0+PTX'"
        )
    digits, minor, suffix, ptx = match.groups()
    if minor is None:  # '90' or 'sm_90': the last digit is the minor version
        if len(digits) < 2:
            raise ValueError(f"arch {shown} is ambiguous; write it as major.minor, e.g. '9.0'")
        digits, minor = digits[:-1], digits[-1]
    # The settings' whole-number reader: a major of 5000 digits is no arch (int() raised at 4300 digits,
    # and a major of 4000 digits was accepted).
    major = settings.whole_number(digits, 0, MAX_MAJOR)
    if major is None:
        raise ValueError(f"arch {shown} is not a compute capability: the major version must be at most {MAX_MAJOR}")
    _check_known(shown, major, int(minor), suffix.lower())
    return Arch(major, int(minor), suffix.lower(), bool(ptx))


def parse_arch_list(text: str) -> tuple[Arch, ...]:
    """Parses 'a;b c,d' into sorted, de-duplicated archs (torch's names expanded)."""
    parts = []
    text = text.strip()
    several = any(c in ";," or c.isspace() for c in text)  # what the split pattern splits on (\s: isspace)
    for part in (re.split(r"[;,\s]+", text) if several else (text,)):
        if part:
            parts += NAMED_ARCHS.get(part.lower(), part).split(";")
    if not parts:
        raise ValueError("the arch list is empty; name at least one arch, e.g. '9.0'")
    archs = tuple(sorted(set(parse_arch(p) for p in parts)))
    if len(archs) > MAX_ARCHS:
        raise ValueError(f"the arch list names {len(archs)} archs; one build holds at most {MAX_ARCHS} "
                         "(build the others separately, e.g. `prewarm --arch` builds each arch on its own)")
    return archs


def archs_tag(archs: tuple[Arch, ...]) -> str:
    """Directory name for a build's arch set, e.g. 'sm90' or 'sm80-sm90'."""
    return "-".join(a.tag for a in archs)


def current_gpu_capability(device: int | None = None) -> tuple[int, int] | None:
    """Compute capability of the current (or given) CUDA device, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def named_archs() -> tuple[tuple[Arch, ...], str] | None:
    """The archs the environment names, with the variable that names them (SGLANG_HICACHE_JIT_ARCH, else
    TORCH_CUDA_ARCH_LIST); None where neither is set, or the list says 'native' (the current GPU).
    BadSettingError for a list that names no arch."""
    named = settings.arch_request()
    if named is None or (named[1] == settings.TORCH_ARCH_LIST and named[0].lower() == "native"):
        return None
    value, variable = named
    try:
        return parse_arch_list(value), variable
    except ValueError as exc:
        raise BadSettingError(f"{variable}={settings.shown(value)}: {exc}.", f"correct or unset {variable}.") from None


def resolve_archs(arch: str | tuple[Arch, ...] | None = None, device: int | None = None
                  ) -> tuple[tuple[Arch, ...], str]:
    """The archs to build for and where they came from (for messages). Without
    an arch named anywhere, the GPU ``device`` (default: current) decides."""
    if isinstance(arch, tuple) and not isinstance(arch, Arch):  # an Arch is a tuple too
        return arch, "argument"
    if arch is not None and str(arch).strip():
        return parse_arch_list(str(arch)), "argument"
    named = named_archs()
    if named is not None:
        return named
    capability = current_gpu_capability(device)
    if capability is None:
        raise NoArchError(
            "No CUDA GPU is visible and no arch was named, so there is nothing to build for.",
            f"name the target, e.g. `sglang-hicache-jit prewarm --arch 9.0` or "
            f"{settings.ARCH}=9.0 (several: '8.0;9.0;10.0').",
        )
    major, minor = capability
    return (Arch(major, minor),), "current GPU"
