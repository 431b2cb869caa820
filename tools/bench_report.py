#!/usr/bin/env python3
"""Markdown tables from bench_transfer JSON: one row per (workload, scope, direction, page, tokens),
one column per provider, each cell 'GB/s (ratio to the same-run ceiling)'.

    python tools/bench_report.py bench.json [--providers ceiling jit torch-index per-page]
    python tools/bench_report.py bench.json --vs-upstream   # ours vs upstream SGLang, same run

--vs-upstream gives one row per cell instead: the ceiling, the best of ours (jit*) and the best of
upstream SGLang's kernels (upstream*), each 'provider GB/s (ratio)', and ours / upstream.
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sglang_hicache_jit.bench.report import summarize  # noqa: E402  (no torch import)


def table(records, providers=None) -> str:
    cells = defaultdict(dict)
    seen = []
    for r in records:
        key = (r["workload"], r["scope"], r["direction"], r["page_size"], r["tokens"])
        cells[key][r["provider"]] = r
        if r["provider"] not in seen:
            seen.append(r["provider"])
    providers = providers or seen
    head = "| workload | layers | dir | page | tokens | " + " | ".join(providers) + " |"
    rule = "|" + "---|" * (5 + len(providers))
    rows = [head, rule]
    for key in sorted(cells, key=lambda k: (k[0], k[1], k[2], -k[3], k[4])):
        out = []
        for p in providers:
            r = cells[key].get(p)
            if r is None:
                out.append("-")
            elif p == "ceiling":
                out.append(f"{r['gbps']:.1f}")
            else:
                out.append(f"{r['gbps']:.1f} ({r['ratio']:.2f})")
        w, scope, d, page, tokens = key
        rows.append(f"| {w} | {scope} | {d} | {page} | {tokens} | " + " | ".join(out) + " |")
    return "\n".join(rows)


def vs_upstream_table(records) -> str:
    """Ours against upstream in the same run, one row per cell that has both or either."""
    def side(row, name):
        if row[name] is None:
            return "-"
        kernel = f" [{row[name + '_kernel']}]" if row[name + "_kernel"] else ""
        return f"{row[name]}{kernel} {row[name + '_gbps']:.1f} ({row[name + '_ratio']:.2f})"

    rows = ["| workload | layers | dir | page | tokens | ceiling | best ours | best upstream | ours / upstream |",
            "|" + "---|" * 9]
    for row in summarize(records):
        ceiling = f"{row['ceiling_gbps']:.1f}" if row["ceiling_gbps"] is not None else "-"
        quotient = f"{row['quotient']:.2f}" if row["quotient"] is not None else "-"
        rows.append(f"| {row['workload']} | {row['scope']} | {row['direction']} | {row['page_size']} | "
                    f"{row['tokens']} | {ceiling} | {side(row, 'ours')} | {side(row, 'upstream')} | {quotient} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json")
    p.add_argument("--providers", nargs="*")
    p.add_argument("--vs-upstream", action="store_true",
                   help="one row per cell: the best of ours against the best of upstream SGLang's kernels")
    args = p.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    records = data["records"] if isinstance(data, dict) else data
    print(vs_upstream_table(records) if args.vs_upstream else table(records, args.providers))


if __name__ == "__main__":
    main()
