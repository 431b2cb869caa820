"""Alias: ``sglang_hicache_jit.ops`` is ``sglang_hicache_jit.transfer.ops``, kept for users (docs/layout.md)."""

import sys

from .transfer import ops as _module

# The same module object under both names, so attribute reads and monkeypatches reach one namespace.
sys.modules[__name__] = _module
