#!/usr/bin/env python3
"""Markdown tables from bench_transfer JSON: one row per (workload, scope, direction, page, tokens),
one column per provider, each cell 'GB/s (ratio to the same-run ceiling)'.

    python tools/bench_report.py bench.json [--providers ceiling jit torch-index per-page]
"""

import argparse
import json
from collections import defaultdict


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json")
    p.add_argument("--providers", nargs="*")
    args = p.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    print(table(data["records"] if isinstance(data, dict) else data, args.providers))


if __name__ == "__main__":
    main()
