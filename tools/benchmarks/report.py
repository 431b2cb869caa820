"""``tools/bench.py report FILE...``: the tables of result files, printed again.

* A tools/bench.py result file (JSON lines): the table of each workload in it (``layouts``, ``cta``; the
  grid's one column per provider for ``grid`` rows; one JSON line per row for the others).
* The CLI bench's ``--json`` document (``{"schema": 1, "records": [...]}``), as the recorded runs in
  docs/data/ are: one row per (workload, layers, direction, page, tokens), one column per provider, each
  cell 'GB/s (ratio to the same-run ceiling)'; ``--vs-upstream``: the ceiling, the best of ours (jit*) and
  the best of upstream SGLang's kernels (upstream*) per cell, and ours / upstream.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from sglang_hicache_jit.bench.report import summarize  # no torch import

from . import harness, layouts


def grid_table(records, providers=None) -> str:
    cells = defaultdict(dict)
    seen = []
    for r in records:
        key = (r["workload"], r["scope"], r["direction"], r["page_size"], r["tokens"])
        cells[key][r["provider"]] = r
        if r["provider"] not in seen:
            seen.append(r["provider"])
    providers = providers or seen
    rows = ["| workload | layers | dir | page | tokens | " + " | ".join(providers) + " |",
            "|" + "---|" * (5 + len(providers))]
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
        workload, scope, direction, page, tokens = key
        rows.append(f"| {workload} | {scope} | {direction} | {page} | {tokens} | " + " | ".join(out) + " |")
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


def _grid_records(rows):
    return [r for r in rows if r.get("mode", "transfer") == "transfer" and "gbps" in r]


def render(path: str, *, vs_upstream: bool = False, providers=None) -> list[str]:
    text = Path(path).read_text()
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        document = None
    if isinstance(document, (dict, list)) and not (isinstance(document, dict) and document.get("kind")):
        records = document["records"] if isinstance(document, dict) else document
        return [vs_upstream_table(records) if vs_upstream else grid_table(records, providers)]
    headers, rows = harness.read(path)
    lines = []
    for header in headers:
        lines.append(f"{path}: {header['bench']} ({header.get('date')}, {header.get('gpu', 'no GPU')}, driver "
                     f"{header.get('driver')}, torch {header.get('torch')}, commit {header.get('commit')})")
    for bench in dict.fromkeys(r["bench"] for r in rows):
        mine = [r for r in rows if r["bench"] == bench]
        if bench in ("layouts", "cta"):
            lines += layouts.table(mine, bench)
        elif bench == "grid" and _grid_records(mine):
            records = _grid_records(mine)
            lines.append(vs_upstream_table(records) if vs_upstream else grid_table(records, providers))
        else:
            lines += [json.dumps({k: v for k, v in r.items() if k not in ("kind", "bench")}) for r in mine]
    return lines


def main(args) -> int:
    for path in args.files:
        print("\n".join(render(path, vs_upstream=args.vs_upstream, providers=args.providers)))
    return 0
