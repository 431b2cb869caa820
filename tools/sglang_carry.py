#!/usr/bin/env python3
"""Builds the carry for a GPU machine without network: SGLang releases, trimmed, and the wheels they need.

For each release named, child processes here import the release's own code
the way the GPU cell tests do (the plugin loaded through SGLang's
``load_plugins()``, every pool of the cell matrix built on the CPU, and the
plugin once more on a torch made to report a GPU, so that what SGLang imports
only on CUDA is found too) and list every module they loaded. Then it writes, under the output directory:

* ``sglang-<X>.tar.gz``: from the release's wheel for the target Python
  (checked against the recorded sha256), the directories of the ``sglang``
  modules that were loaded (their data files included), the sources of
  SGLang's own HiCache JIT kernels, and the dist-info, so ``importlib.metadata``
  reports the release; untar it and put it on PYTHONPATH;
* ``*.whl``: the target Python's wheels, at the versions installed here, of
  every distribution those imports loaded (and this package's own
  dependencies) that the target image lacks (``tools/gpu_image_packages.txt``),
  each checked against the sha256 recorded in ``tools/sglang_server/wheels.json``
  (``--record-wheels`` records those it lacks, as the index reports them, and
  stops: review the diff); install them with ``pip install --no-index --no-deps --target``;
* ``carry.json``: what is in it.

    python3 tools/sglang_carry.py 0.5.19 0.5.21 0.5.22 0.5.23 -o .devwhl

With ``--server RELEASE`` it writes instead the carry of a real SGLang server for
one release (tools/sglang_server/carry.py; tools/gpu_server.sh runs it).

``STEPS=sglang tools/gpu_bench.sh`` runs the GPU cells from such a carry. Needs network
here (pip download) and this package installed with its ``sglang`` extra.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import release_kit  # noqa: E402

# Sources of SGLang's own HiCache JIT kernels, which an unpatched pool builds on first use
# (tools/bench.py sglang-pool measures one): they are read by the compiler, not imported.
UPSTREAM_JIT_SOURCES = re.compile(r"sglang/(kernels/jit|jit_kernel)/(include/|csrc/kvcacheio/)")
# Loaded here because of this machine's own tools (pytest, pip), or part of the GPU image's torch stack.
NEVER = {"sglang", "sglang-hicache-jit", "torch", "triton", "pip", "setuptools", "pytest", "pluggy", "iniconfig"}

# Run in a child with the release first on the path: the construct mode of the cell tests on the CPU, or
# (CUDA) the plugin alone on a torch that says it has a GPU, so the modules SGLang imports only on CUDA
# are found too; then every module loaded.
_PROBE = """
import json, sys, runpy
if sys.argv[1] == "plugin":
    import torch
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    torch.cuda.get_device_name = lambda *args, **kwargs: "NVIDIA H200"
from release_kit import tolerate_newer_transformers
tolerate_newer_transformers()
cells, sys.argv = sys.argv[2], ["sglang_cells.py", sys.argv[1]]
try:
    runpy.run_path(cells, run_name="__main__")
except SystemExit:
    pass
files = sorted({m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)})
print("CARRY-MODULES " + json.dumps({"files": files, "top": sorted({n.split(".")[0] for n in sys.modules})}))
"""


def loaded_modules(version: str) -> tuple:
    """(files in the release tree, top-level module names) of what the cell tests load, on CPU and on CUDA."""
    tree = release_kit.release_tree(version)
    files, top = set(), set()
    with tempfile.TemporaryDirectory() as tmp:
        standin = release_kit.write_standin(Path(tmp), version)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(standin), str(tree), str(ROOT), str(ROOT / "tests")]))
        for mode in ("construct", "plugin"):
            out = subprocess.run([sys.executable, "-c", _PROBE, mode, str(ROOT / "tests" / "sglang_cells.py")],
                                 capture_output=True, text=True, env=env, timeout=600)
            line = next((x for x in out.stdout.splitlines() if x.startswith("CARRY-MODULES ")), None)
            if line is None:
                raise SystemExit(f"sglang {version} ({mode}): the probe failed:\n{out.stderr[-3000:]}")
            loaded = json.loads(line[len("CARRY-MODULES "):])
            files |= {os.path.relpath(f, tree) for f in loaded["files"] if f.startswith(str(tree) + os.sep)}
            top |= set(loaded["top"])
    return sorted(files), sorted(top)


def trimmed_tree(version: str, python: str, cache: Path, relative: list) -> bytes:
    """A tar.gz of the release wheel's dist-info and every file beside a loaded sglang module."""
    name, digest = next((n, d) for n, d in release_kit.record(version)["wheels"].items()
                        if f"-cp{python.replace('.', '')}-" in n or "-py3-none-any" in n)
    wheel = cache / name
    if not wheel.exists() or release_kit.sha256(wheel) != digest:
        download(f"sglang=={version}", cache, python)
    if not wheel.exists():  # pip took a wheel of another platform tag: its sha256 is recorded nowhere
        raise SystemExit(f"pip download sglang=={version} did not write the recorded wheel {name} (sha256 {digest}) "
                         f"in {cache}; no other wheel is taken")
    if release_kit.sha256(wheel) != digest:
        raise SystemExit(f"{wheel}: sha256 differs from the recorded one")
    keep_dirs = {os.path.dirname(r) for r in relative}
    buffer = io.BytesIO()
    with zipfile.ZipFile(wheel) as z, tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        server_carry().check_members(wheel, z.namelist())  # an absolute or '..' name refuses the wheel
        for info in z.infolist():
            name = info.filename
            if info.is_dir() or not (name.split("/")[0].endswith(".dist-info") or os.path.dirname(name) in keep_dirs
                                     or UPSTREAM_JIT_SOURCES.match(name)):
                continue
            data = z.read(info)
            member = tarfile.TarInfo(name)
            member.size, member.mode = len(data), 0o644
            tar.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


def server_carry():
    """tools/sglang_server/carry.py: the member-name rule and the recorded sha256 of every wheel."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    from sglang_server import carry

    return carry


def download(spec: str, dest: Path, python: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", "--platform=manylinux2014_x86_64",
                    *[f"--platform=manylinux_2_{n}_x86_64" for n in range(17, 40)], "--platform=any",
                    "-d", str(dest), spec], check=True)


def distributions(top_level: set) -> set:
    """Installed distributions that provide these top-level modules."""
    owners = metadata.packages_distributions()
    return {dist for name in top_level for dist in owners.get(name, ())}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main() -> int:
    if "--server" in sys.argv[1:]:  # a real server's carry: one release, trimmed, with what it needs
        sys.path.insert(0, str(ROOT / "tools"))
        from sglang_server.carry import main as server_main

        return server_main([a for a in sys.argv[1:] if a != "--server"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("releases", nargs="+")
    parser.add_argument("-o", "--out", type=Path, default=ROOT / ".devwhl")
    parser.add_argument("--python", default="3.12", help="the target machine's Python (default 3.12)")
    parser.add_argument("--have", type=Path, default=ROOT / "tools" / "gpu_image_packages.txt",
                        help="distributions the target already has, one per line")
    parser.add_argument("--record-wheels", action="store_true",
                        help="record the sha256 of the wheels this carry takes that tools/sglang_server/wheels.json "
                             "lacks (as the package index reports them), then stop; review the diff")
    args = parser.parse_args()
    have = {normalize(line.strip()) for line in args.have.read_text().splitlines()
            if line.strip() and not line.startswith("#")}
    cache = release_kit.cache_root() / "wheels"
    args.out.mkdir(parents=True, exist_ok=True)
    top_level, trees = set(), {}
    for version in args.releases:
        relative, top = loaded_modules(version)
        (args.out / f"sglang-{version}.tar.gz").write_bytes(trimmed_tree(version, args.python, cache, relative))
        trees[version] = len(relative)
        top_level |= set(top)
    needed = distributions(top_level)
    own = {normalize(re.split(r"[ <>=!;\[]", r)[0]) for r in metadata.requires("sglang-hicache-jit") or ()
           if "extra ==" not in r}
    needed = {normalize(n) for n in needed} | own
    carried = sorted(n for n in needed if n not in have and n not in NEVER)
    carry = server_carry()
    if args.record_wheels:
        added = carry.record_specs([f"{name}=={metadata.version(name)}" for name in carried], args.python)
        print(f"{carry.WHEELS_JSON}: {len(added)} wheels added" + "".join(f"\n  {n}" for n in sorted(added)))
        return 0
    for old in args.out.glob("*.whl"):
        old.unlink()
    try:
        for name in carried:
            try:
                download(f"{name}=={metadata.version(name)}", args.out, args.python)
            except subprocess.CalledProcessError:  # no wheel of that version for the target Python: its newest
                print(f"{name} {metadata.version(name)} has no wheel for Python {args.python}; taking the newest")
                download(name, args.out, args.python)
        recorded = carry.recorded_wheels(args.releases[0])
        for wheel in args.out.glob("*.whl"):  # every wheel against its recorded sha256, or the carry stops
            carry.checked(wheel, recorded)
    except BaseException:  # and leaves no wheel where tools/gpu_carry.sh would install it unchecked
        for wheel in args.out.glob("*.whl"):
            wheel.unlink()
        raise
    size = sum(p.stat().st_size for p in args.out.iterdir())
    (args.out / "carry.json").write_text(json.dumps({"python": args.python, "releases": trees, "wheels": sorted(
        p.name for p in args.out.glob("*.whl"))}, indent=1) + "\n")
    print(f"{args.out}: {len(trees)} releases, {len(carried)} wheels, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
