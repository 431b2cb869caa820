"""The CLI's ``bench`` and ``demo`` commands: why benchmark code ships inside the package.

``sglang-hicache-jit bench`` times the transfer ops (and upstream SGLang's kernels beside them when
SGLang is importable) on the user's own GPU, and ``demo`` runs one round trip through a host pool;
both must work from an installed wheel, so they live here. The deeper studies that only a checkout
runs (tools/bench_*.py) stay in tools/. Nothing here is imported unless one of those commands runs.
"""
