"""Alias: ``sglang_hicache_jit.probe`` is ``sglang_hicache_jit.transfer.probe``, kept for users (docs/layout.md)."""

import sys

from .transfer import probe as _module

# The same module object under both names, so attribute reads and monkeypatches reach one namespace.
sys.modules[__name__] = _module
