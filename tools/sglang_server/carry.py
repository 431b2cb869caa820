"""The carry for a real SGLang server on the offline GPU machine: one release, trimmed, with what it needs.

Written into one folder (``python3 tools/sglang_carry.py --server 0.5.17 -o /tmp/srvcarry-0.5.17``):

* ``sglang-<X>.tar.gz``: the release's wheel (checked against the recorded sha256) without what a server
  never imports: ``multimodal_gen/``, ``benchmark/`` and the Rust extensions of the Rust HTTP/gRPC
  servers, the multimodal preprocessor and the benchmark client (``_core*.so`` up to 0.5.17,
  ``rust_extensions/_server``, ``_grpc`` and ``_multimodal`` from 0.5.19, ``_bench`` in 0.5.23, 8.3 MB, which
  only ``sglang/benchmark`` imports; the Rust radix tree core stays);
* ``sgl_kernel-<K>.tar.gz``: sglang-kernel's Python files, its sm90 library (``sm90/common_ops``),
  ``spatial_ops``, ``triton_kernels`` and its dist-info, without FA3, FlashMLA, InfLLM and the sm100
  library (about 1.1 GB the server path never loads with ``--attention-backend triton``);
* ``*.whl``: the wheels for the target Python (3.12) that the GPU image lacks (``SERVER_WHEELS`` below,
  found by importing the server's modules against a bare torch, see ``server_imports.py``), plus the
  release's own pins of flashinfer, transformers and tokenizers;
* ``carry.json``: what is in it (with the sha256 of every file, which ``install.py`` checks on the GPU
  machine), the environment the engines need (``env``), and whether the route is **official** (the
  release with its own pinned sglang-kernel) or **unofficial** (cross-pinned: a release whose pinned
  sglang-kernel does not load on the image's torch, run on sglang-kernel 0.4.5 with
  ``SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1``). A release that ships SGLang's Rust radix tree core built
  for another torch than the image's (0.5.23's, for torch 2.14, segfaults the scheduler on 2.11 in
  ``caffe2::TypeMeta::error_unsupported_typemeta``, plugin or not) gets
  ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``: SGLang's Python tree core.

Every wheel taken (sglang's, sglang-kernel's and each small one) is checked against a recorded sha256
before anything is read from it: sglang's in the release records (``tests/sglang_data``), the others in
``wheels.json`` beside this file. A wheel whose name is not recorded is refused, as is one whose sha256
differs; ``--record-wheels`` adds the names a carry for a release would take, with the sha256 the package
index reports for them (``pip install --dry-run --report``; review the diff). A member with an absolute
name or a ``..`` component refuses its whole wheel.

A device call carries 64 MiB with the repository (about 5 MB), so ``build`` refuses a carry over what
the checkout leaves, less 1 MiB (``default_limit``): 0.5.17 makes 53.9 MiB, 0.5.19 with its own
flashinfer pin 58.2 MiB, 0.5.23 with ``--flashinfer 0.6.15.post1`` 55.8 MiB. ``tools/gpu_server.sh``
installs it there.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
CALL = 64 * 2**20  # what one device call carries: the repository's files and the carry together
LIMIT = 58 * 2**20  # outside a git checkout: the call less a repository of up to 6 MiB
MARGIN = 2**20  # room for the files a session adds before its next call
KERNEL = "0.4.5"  # the sglang-kernel whose libraries load on the image's torch 2.11
PYTHON = "3.12"
IMAGE_TORCH = "2.11.0"
WHEELS_JSON = Path(__file__).resolve().parent / "wheels.json"  # the recorded sha256 of every other wheel
_RUST_TREE_CORE = re.compile(r"^sglang/srt/mem_cache/rust_tree_core/[^/]*\.so$")

# Distributions the server path imports that the image lacks, at the versions the import check here ran
# with (server_imports.py). The release's own pins (flashinfer-python, transformers, tokenizers,
# xgrammar, apache-tvm-ffi, openai) come from its metadata instead.
SERVER_WHEELS = {
    "annotated-types": "0.8.0", "compressed-tensors": "0.20.1", "dill": "0.4.1", "distro": "1.9.0",
    "fastapi": "0.165.0", "gguf": "0.19.0", "ipython": "9.18.1", "loguru": "0.7.3", "msgspec": "0.23.0",
    "opentelemetry-api": "1.45.2", "orjson": "3.13.0", "partial-json-parser": "0.2.1.1.post7",
    "platformdirs": None, "pybase64": "1.5.1", "pydantic": "2.14.4", "pydantic-core": "2.50.5",
    "pyzmq": "27.3.0", "setproctitle": "1.3.8", "sniffio": "1.3.1", "starlette": "1.10.0",
    "traitlets": "5.16.1", "typing-inspection": "0.4.5", "uvicorn": "0.55.0",
    # transformers' tokenizer, at the pin of the releases that pin it (the image's 0.23 is newer than
    # transformers 5.12 accepts)
    "tokenizers": "0.22.2",
}
PINNED = ("flashinfer-python", "transformers", "tokenizers", "xgrammar", "apache-tvm-ffi", "openai")
# Versions the image has of packages a release may pin (read there with pip list, 2026-11): a pin equal
# to one of these is not carried.
IMAGE_VERSIONS = {"tokenizers": "0.23.2", "transformers": "5.17.0", "safetensors": "0.8.0",
                  "huggingface-hub": "1.33.0"}
# Never carried: the image's torch stack, and this package (it travels as the repository).
IMAGE_STACK = {"torch", "triton", "torchvision", "torchaudio", "sglang-kernel", "sglang", "sglang-hicache-jit"}

_TRIM_SGLANG = re.compile(r"^sglang/(multimodal_gen|benchmark)/|/_core\.cpython-[^/]*\.so$"
                          r"|^sglang/srt/rust_extensions/_(server|grpc|multimodal|bench)\.cpython-[^/]*\.so$")
# A CPython extension built for another interpreter cannot be imported by the target's (SGLang's wheels
# are tagged cp311 and hold cpython-311 Rust extensions, 11.7 MB in 0.5.23; the image runs 3.12): its
# importer falls back or the module is not on the server path, and the carry need not hold it.
_FOREIGN_EXTENSION = re.compile(r"\.cpython-(\d+)-[^/]*\.so$")
_KEEP_KERNEL = re.compile(r"^(sgl_kernel/(?!sm100/)[^/]*\.py|sgl_kernel/(?!sm100/).*/[^/]*\.py|sgl_kernel/sm90/"
                          r"common_ops\.[^/]*so|sgl_kernel/spatial_ops\.[^/]*so|triton_kernels/.*|"
                          r"sglang_kernel-[^/]*\.dist-info/.*)$")
# xgrammar's static library: only for linking against it, never loaded (65 MB of its 119). Every carried
# shared library also loses its debug sections (xgrammar's bindings: 53 MB -> 3 MB).
# transformers: the model code (modeling_, modular_ and convert_ files) of the models a server never
# imports; SGLang has its own model code and imports only llama's and the auto classes from here
# (configurations, tokenizers and processors stay for every model).
_TRIM_WHEEL = {"xgrammar": re.compile(r"^xgrammar/lib/.*\.a$"),
               "transformers": re.compile(r"^transformers/models/(?!(auto|llama|deepseek_v3|qwen2|qwen3)/)[^/]+/"
                                          r"(modeling|modular|convert)_[^/]*\.py$")}


def default_limit(root: Path = ROOT) -> int:
    """The most a carry may hold: a call's 64 MiB less the files of this checkout that travel with it
    (tracked and untracked-not-ignored, as ``git ls-files`` lists them) and ``MARGIN``; ``LIMIT`` where
    git cannot say."""
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], capture_output=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return LIMIT
    size = 0
    for name in filter(None, listed.split(b"\0")):
        try:
            size += (root / os.fsdecode(name)).lstat().st_size
        except OSError:  # listed but gone (deleted, not yet committed)
            continue
    return CALL - size - MARGIN


def _keep_in_sglang(name: str, python: str = PYTHON) -> bool:
    if _TRIM_SGLANG.search(name):
        return False
    foreign = _FOREIGN_EXTENSION.search(name)
    return foreign is None or foreign.group(1) == python.replace(".", "")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def release_pins(metadata_text: str) -> dict:
    """{distribution: version} of the ``==`` pins in a wheel's METADATA (extras left out)."""
    pins = {}
    for line in metadata_text.splitlines():
        m = re.match(r"Requires-Dist:\s*([A-Za-z0-9._-]+)(?:\[[^\]]*\])?\s*==\s*([^;\s]+)\s*(;.*)?$", line)
        if m and not (m.group(3) and "extra ==" in m.group(3)):
            pins[normalize(m.group(1))] = m.group(2)
    return pins


def route(release: str, pinned_kernel: str | None) -> dict:
    """Whether this release runs on its own sglang-kernel pin (official) or cross-pinned on KERNEL."""
    official = pinned_kernel == KERNEL
    return {"release": release, "kernel": KERNEL, "pinned_kernel": pinned_kernel, "official": official,
            "label": (f"official: sglang {release} with its own pins (sglang-kernel {KERNEL})" if official else
                      f"unofficial: sglang {release} cross-pinned on sglang-kernel {KERNEL} (pins "
                      f"{pinned_kernel}), SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1"),
            "env": {} if official else {"SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1"}}


def wheel_plan(pins: dict, image: set, flashinfer: str | None = None) -> dict:
    """{distribution: version or None (newest)}: the small wheels plus the release's pins, less the image."""
    plan = dict(SERVER_WHEELS)
    for name in PINNED:
        if name in pins:
            plan[name] = pins[name]
    if flashinfer:
        plan["flashinfer-python"] = flashinfer
    if plan.get("transformers") == IMAGE_VERSIONS["transformers"]:
        plan.pop("tokenizers", None)  # the image's own pair
    return {n: v for n, v in sorted(plan.items()) if n not in IMAGE_STACK and (n not in image or n in PINNED)
            and not (v is not None and IMAGE_VERSIONS.get(n) == v)}


def unsafe_member(name: str) -> str | None:
    """Why a member name of a wheel or a tar may not be written under the site (None if it may): an absolute
    name, a '..' component, a backslash or a NUL would write outside it, or somewhere else on another tool."""
    if not name or name.startswith("/") or "\\" in name or "\0" in name:
        return "an absolute or unusual name"
    if ".." in name.split("/"):
        return "a '..' component"
    return None


def check_members(source: Path, names) -> None:
    """Refuses the whole archive ``source`` for one unsafe member name."""
    for name in names:
        why = unsafe_member(name)
        if why is not None:
            raise SystemExit(f"{source}: member {name!r} has {why}; refusing the whole archive")


def trim_zip(source: Path, keep) -> bytes:
    """A tar.gz of the members of a wheel (zip) for which ``keep(name)`` is true."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(source) as z, tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=9) as tar:
        check_members(source, z.namelist())
        for info in z.infolist():
            if info.is_dir() or not keep(info.filename):
                continue
            data = z.read(info)
            member = tarfile.TarInfo(info.filename)
            member.size, member.mode = len(data), 0o755 if info.filename.endswith(".so") else 0o644
            tar.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


def strip_debug(data: bytes) -> bytes:
    """A shared library without its debug sections (``strip --strip-debug``: the code is untouched);
    the input where ``strip`` is missing or fails."""
    import shutil
    import tempfile

    if shutil.which("strip") is None:
        return data
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(data)
        f.flush()
        if subprocess.run(["strip", "--strip-debug", f.name], capture_output=True).returncode != 0:
            return data
        return Path(f.name).read_bytes()


def _record_line(name: str, data: bytes) -> str:
    import base64

    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def trim_wheel(source: Path, drop: re.Pattern | None = None) -> bytes:
    """The wheel without the members matching ``drop``, its shared libraries without debug sections, and
    its RECORD rewritten to match."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(source) as z, zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as out:
        check_members(source, z.namelist())
        record_name = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        for info in z.infolist():
            if info.filename == record_name or (drop is not None and drop.search(info.filename)):
                continue
            data = z.read(info)
            if re.search(r"\.so(\.[0-9]+)*$", info.filename):
                data = strip_debug(data)
            out.writestr(info, data)
            lines.append(_record_line(info.filename, data))
        lines.append(f"{record_name},,")
        out.writestr(z.getinfo(record_name), "\n".join(lines) + "\n")
    return buffer.getvalue()


def download(spec: str, dest: Path, python: str = PYTHON) -> Path:
    """One wheel for the target machine (pip download --no-deps); returns its path."""
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.iterdir())
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", "--platform=manylinux2014_x86_64",
                    *[f"--platform=manylinux_2_{n}_x86_64" for n in range(17, 40)], "--platform=any",
                    "-d", str(dest), spec], check=True)
    name = normalize(re.split(r"[=<>]", spec)[0]).replace("-", "_")
    found = [p for p in dest.iterdir() if normalize(p.name.split("-")[0]).replace("-", "_") == name
             and p.suffix == ".whl"]
    new = [p for p in found if p not in before] or found
    version = spec.split("==")[1] if "==" in spec else None
    match = [p for p in new if version is None or p.name.split("-")[1] == version]
    if not match:
        raise SystemExit(f"pip download {spec}: no wheel found in {dest}")
    return match[0]


def _release_kit():
    """tests/release_kit.py (the releases' records, the private wheel cache, the sha256 of a file)."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    import release_kit

    return release_kit


def recorded_wheels(release: str) -> dict:
    """{wheel file name: sha256} of every wheel a carry may take: the release's sglang wheels from its record
    (``tests/sglang_data``, absent for an unrecorded release) and every other wheel from ``wheels.json``."""
    try:
        recorded = dict(_release_kit().record(release)["wheels"])
    except FileNotFoundError:
        recorded = {}
    if WHEELS_JSON.exists():
        recorded.update(json.loads(WHEELS_JSON.read_text()))
    return recorded


def checked(wheel: Path, recorded: dict) -> Path:
    """``wheel`` when its sha256 is the one recorded for its name; SystemExit otherwise (an unrecorded name
    too: a wheel of another platform tag than the recorded one is not taken unchecked)."""
    digest = recorded.get(wheel.name)
    if digest is None:
        raise SystemExit(f"{wheel.name}: no sha256 recorded for this wheel (tests/sglang_data for sglang, "
                         f"{WHEELS_JSON.name} for the others); record it with --record-wheels and review the diff")
    if _release_kit().sha256(wheel) != digest:
        raise SystemExit(f"{wheel}: sha256 differs from the recorded {digest}; refusing it")
    return wheel


def tree_core_env(wheel: Path, pins: dict) -> dict:
    """SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python where the release ships a Rust tree core built for a torch
    other than the image's (it aborts the scheduler there, plugin on or off); {} otherwise."""
    with zipfile.ZipFile(wheel) as z:
        rust = any(_RUST_TREE_CORE.match(name) for name in z.namelist())
    if rust and pins.get("torch") not in (None, IMAGE_TORCH):
        return {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
    return {}


def build(release: str, out: Path, cache: Path, *, image: set, recorded_wheels: dict, flashinfer: str | None = None,
          limit: int = LIMIT) -> dict:
    """Writes the carry for ``release`` into ``out``; returns what carry.json says."""
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.whl")) + list(out.glob("*.tar.gz")):
        old.unlink()
    wheel = checked(download(f"sglang=={release}", cache), recorded_wheels)
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        pins = release_pins(z.read(meta).decode())
    facts = route(release, pins.get("sglang-kernel"))
    tree_core = tree_core_env(wheel, pins)
    if tree_core:
        facts["env"].update(tree_core)
        facts["label"] += f"; SGLang's Python radix tree core (its Rust one is built for torch {pins['torch']})"
    (out / f"sglang-{release}.tar.gz").write_bytes(trim_zip(wheel, _keep_in_sglang))
    kernel = checked(download(f"sglang-kernel=={KERNEL}", cache), recorded_wheels)
    (out / f"sgl_kernel-{KERNEL}.tar.gz").write_bytes(trim_zip(kernel, lambda n: bool(_KEEP_KERNEL.match(n))))
    wheels = wheel_plan(pins, image, flashinfer)
    if flashinfer and flashinfer != pins.get("flashinfer-python"):  # another cross-pin: say so
        facts["official"] = False
        facts["label"] = (("unofficial: " + facts["label"].split(": ", 1)[1]) if not facts["label"].startswith(
            "unofficial") else facts["label"]) + f"; flashinfer {flashinfer} (pins {pins.get('flashinfer-python')})"
    for name, version in wheels.items():
        path = checked(download(f"{name}=={version}" if version else name, cache), recorded_wheels)
        (out / path.name).write_bytes(trim_wheel(path, _TRIM_WHEEL.get(name)))
    files = sorted(p for p in out.iterdir() if p.name != "carry.json")
    size = sum(p.stat().st_size for p in files)
    facts.update(python=PYTHON, sglang_wheel=wheel.name, flashinfer=wheels.get("flashinfer-python"),
                 transformers=wheels.get("transformers"), files=[p.name for p in files], bytes=size,
                 sha256={p.name: _release_kit().sha256(p) for p in files})
    (out / "carry.json").write_text(json.dumps(facts, indent=1) + "\n")
    if size > limit:
        raise SystemExit(f"{out}: {size / 2**20:.1f} MiB, over the {limit / 2**20:.0f} MiB a call carries beside "
                         "the repository")
    return facts


def _index_report(specs: list, python: str = PYTHON) -> list:
    """pip's report of the wheels ``specs`` resolve to for the target (no download of the wheels themselves:
    the index serves their metadata): [(file name, sha256, requires_dist)]."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--no-deps", "--ignore-installed",
                        "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
                        "--platform=manylinux2014_x86_64", *[f"--platform=manylinux_2_{n}_x86_64" for n in range(17, 40)],
                        "--platform=any", "--target", str(Path(tmp) / "t"), "--report", str(report), *specs], check=True)
        items = json.loads(report.read_text())["install"]
    return [(item["download_info"]["url"].rsplit("/", 1)[1], item["download_info"]["archive_info"]["hashes"]["sha256"],
             item.get("metadata", {}).get("requires_dist") or []) for item in items]


def record_wheels(release: str, image: set, flashinfer: str | None = None) -> dict:
    """Adds to wheels.json the sha256 of every wheel the carry for ``release`` takes that it lacks (sglang's own
    come from the release record); an entry already there is never changed: a different sha256 for a recorded
    name is refused. Returns what was added."""
    (_, _, requires), = _index_report([f"sglang=={release}"])
    pins = release_pins("\n".join(f"Requires-Dist: {r}" for r in requires))
    return record_specs([f"sglang-kernel=={KERNEL}"] +
                        [f"{n}=={v}" if v else n for n, v in wheel_plan(pins, image, flashinfer).items()])


def record_specs(specs: list, python: str = PYTHON) -> dict:
    """Adds the sha256 the index reports for the wheels ``specs`` resolve to (for ``python``) to wheels.json,
    never changing a recorded one; returns what was added."""
    recorded = json.loads(WHEELS_JSON.read_text()) if WHEELS_JSON.exists() else {}
    added = {}
    for name, digest, _ in _index_report(specs, python):
        if name in recorded and recorded[name] != digest:
            raise SystemExit(f"{name}: the index now reports sha256 {digest}, {WHEELS_JSON.name} records "
                             f"{recorded[name]}; refusing to change a recorded wheel")
        if name not in recorded:
            added[name] = digest
    if added:
        WHEELS_JSON.write_text(json.dumps(dict(sorted({**recorded, **added}.items())), indent=1) + "\n")
    return added


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="sglang_carry.py --server", description=__doc__.split("\n\n")[0])
    parser.add_argument("release")
    parser.add_argument("-o", "--out", type=Path, help="default: /tmp/srvcarry-<release>")
    parser.add_argument("--flashinfer", help="carry this flashinfer-python instead of the release's pin")
    parser.add_argument("--have", type=Path, default=ROOT / "tools" / "gpu_image_packages.txt",
                        help="distributions the target image already has, one per line")
    parser.add_argument("--record-wheels", action="store_true",
                        help=f"record the sha256 of the wheels this carry takes that {WHEELS_JSON.name} lacks (as the "
                             "package index reports them), then stop; review the diff")
    parser.add_argument("--limit-mib", type=float, default=None,
                        help="most MiB the carry may hold (default: 64 MiB less this checkout's files and 1 MiB)")
    args = parser.parse_args(argv)
    release_kit = _release_kit()
    image = {normalize(line.strip()) for line in args.have.read_text().splitlines()
             if line.strip() and not line.startswith("#")}
    if args.record_wheels:
        added = record_wheels(args.release, image, args.flashinfer)
        print(f"{WHEELS_JSON}: {len(added)} wheels added" + "".join(f"\n  {n}  {d}" for n, d in sorted(added.items())))
        return 0
    out = args.out or Path(f"/tmp/srvcarry-{args.release}")
    facts = build(args.release, out, release_kit.cache_root() / "wheels", image=image,
                  recorded_wheels=recorded_wheels(args.release),
                  flashinfer=args.flashinfer,
                  limit=default_limit() if args.limit_mib is None else int(args.limit_mib * 2**20))
    print(f"{out}: {facts['bytes'] / 2**20:.1f} MiB; {facts['label']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
