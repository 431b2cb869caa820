#!/usr/bin/env python3
"""Transfer benchmark (same as `sglang-hicache-jit bench`); see sglang_hicache_jit/bench/."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sglang_hicache_jit.bench.command import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
