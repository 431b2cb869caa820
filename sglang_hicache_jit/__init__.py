"""HiCache KV transfer kernels for SGLang, compiled on first use into a per-arch build cache.

Importing this package is cheap: it imports neither torch nor any extension
and compiles nothing. ``load_kernels()`` builds (once) and loads the library;
``sglang_hicache_jit.probe.probe()`` says whether the kernels can be used
here, and why not.
"""

import gc
import importlib

__version__ = "0.1.0"

__all__ = ["__version__", "load_kernels", "one_layer_kernel_available"]

_LAZY = {"one_layer_kernel_available": ".probe"}


def load_kernels(arch=None, *, device=None, build=True):
    """The kernel library for ``arch``, built on first use: see sglang_hicache_jit.buildcache.loader.load_kernels.

    The loader's modules are imported here, on the first call, and the whole warm path (those imports,
    the cache lookup, the checks and the dlopen) runs with Python's cyclic garbage collector paused. A
    warm load allocates enough to start a collection, and in an SGLang process (torch, numpy, SGLang's
    imports) that collection took 1.1-1.4 ms of a 4.5 ms budget. The collection still runs, at the first
    allocation after the load returns: its work is moved out of the load, not saved."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        from .buildcache.loader import load_kernels as load

        return load(arch, device=device, build=build)
    finally:
        if enabled:
            gc.enable()


def __getattr__(name):
    # Resolved on first use: the probe pulls in the loader and torch.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'sglang_hicache_jit' has no attribute {name!r}")
