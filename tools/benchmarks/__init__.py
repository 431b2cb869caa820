"""The workloads of tools/bench.py, one module per question (see tools/bench.py --list)."""
