"""HiCache KV transfer kernels for SGLang, compiled on first use into a per-arch build cache.

Importing this package is cheap: it imports neither torch nor any extension
and compiles nothing. ``load_kernels()`` builds (once) and loads the library;
``sglang_hicache_jit.probe.probe()`` says whether the kernels can be used
here, and why not.
"""

import importlib

__version__ = "0.1.0"

__all__ = ["__version__", "load_kernels", "one_layer_kernel_available"]

_LAZY = {"load_kernels": ".buildcache.loader", "one_layer_kernel_available": ".probe"}


def __getattr__(name):
    # Resolved on first use: the loader pulls in filelock and, when it loads, torch.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'sglang_hicache_jit' has no attribute {name!r}")
