"""Alias: ``sglang_hicache_jit.compat`` is ``sglang_hicache_jit.integrations.compat``, kept for users
(docs/layout.md)."""

import sys

from .integrations import compat as _module

# The same module object under both names, so attribute reads and monkeypatches reach one namespace.
sys.modules[__name__] = _module
