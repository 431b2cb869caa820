"""Alias: ``sglang_hicache_jit.host_pool`` is ``sglang_hicache_jit.transfer.host_pool``, kept for users
(docs/layout.md)."""

import sys

from .transfer import host_pool as _module

# The same module object under both names, so attribute reads and monkeypatches reach one namespace.
sys.modules[__name__] = _module
