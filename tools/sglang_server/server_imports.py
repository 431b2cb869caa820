"""Imports the modules a real SGLang server runs, all of them, and says what is missing, in one go.

On the GPU machine it is the preflight of ``tools/gpu_server.sh`` (a missing module shows in seconds,
not after an engine's start). Here, with ``--fake-cuda``, it runs against a torch without a GPU (told
it has an H200) and an sgl_kernel stand-in (``tests/release_kit.py standin``): that is how the wheel
list in ``carry.py`` was found, and how a carry is checked before it travels.

    python3 tools/sglang_server/server_imports.py [--fake-cuda]

Prints one JSON line: {"ok": bool, "failed": {module: error}, "missing": [top-level names],
"distributions": {distribution: version} of every non-stdlib module loaded}.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import sys
from pathlib import Path

MODULES = (
    "sglang.srt.entrypoints.engine", "sglang.srt.managers.scheduler", "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager", "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.deepseek_v2", "sglang.srt.models.llama", "sglang.srt.layers.attention.triton_backend",
    # HiCache's radix tree: its own module up to 0.5.22, folded into the unified radix cache in 0.5.23.
    ("sglang.srt.mem_cache.hiradix_cache", "sglang.srt.mem_cache.unified_radix_cache"),
    "sglang.srt.managers.cache_controller", "sglang.srt.model_loader.loader",
    "sglang.srt.layers.sampler", "sglang.srt.mem_cache.pool_host.mla", "sglang.srt.mem_cache.pool_host.mha",
    "flashinfer", "xgrammar", "transformers", "tokenizers",
)


def fake_cuda() -> None:
    """A torch without a GPU that says it has an H200 (what SGLang's module-level checks read)."""
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    torch.cuda.get_device_name = lambda *args, **kwargs: "NVIDIA H200"
    if torch.version.cuda is None:
        torch.version.cuda = "13.0"


def _present(name: str) -> bool:
    """Whether the installed packages have module ``name``, read from the files: importing its parents
    to ask would fail, or leave half-imported packages behind, when one of them is broken."""
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None or not rest:
        return spec is not None
    for base in spec.submodule_search_locations or ():
        path = Path(base, *rest)
        if path.with_suffix(".py").is_file() or path.is_dir():
            return True
    return False


def check(modules=MODULES) -> dict:
    """Imports each of ``modules``; an entry that is a tuple names one module under the names it has had
    across releases, and the first one the installed release has is imported (the last when none is)."""
    failed = {}
    for entry in modules:
        names = (entry,) if isinstance(entry, str) else entry
        name = next((n for n in names if _present(n)), names[-1])
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - any failure to import is the answer
            failed[name] = f"{type(exc).__name__}: {exc}"
    # A distribution is missing when a top-level name cannot be found at all; a submodule that an
    # installed package lacks is a failure of that module, not a missing distribution.
    tops = {m.group(1) for e in failed.values() for m in [re.search(r"No module named '([^'.]+)", e)] if m}
    missing = sorted(top for top in tops if not _present(top))
    from importlib import metadata

    owners = metadata.packages_distributions()
    top = {name.split(".")[0] for name in list(sys.modules)}
    dists = {}
    for name in sorted(top - set(sys.stdlib_module_names)):
        for dist in owners.get(name, ()):
            try:
                dists[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                pass
    return {"ok": not failed, "failed": failed, "missing": missing, "distributions": dists}


if __name__ == "__main__":
    if "--fake-cuda" in sys.argv:
        fake_cuda()
    result = check()
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)
