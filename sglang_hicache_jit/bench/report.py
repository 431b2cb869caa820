"""The benchmark's report: one line per record, the best of ours against the best of upstream per cell,
and the optional plot."""

from __future__ import annotations

import io

from .. import safeio, settings
from .providers import family

def _row(r: dict) -> str:
    ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "  - "
    kernel = f"  [{r['kernel']} kernel]" if r.get("kernel") else ""  # what upstream's provider ran
    return (f"{r['workload']:<12} {r['scope']:<3} {r['direction']} p{r['page_size']:<3} {r['tokens']:>6} "
            f"{r['provider']:<16} {r['gbps']:7.2f} GB/s  x{ratio}  ({r['median_s'] * 1e6:9.1f} us, n={r['reps']})"
            f"{kernel}")


CELL = ("workload", "scope", "direction", "page_size", "tokens")


def _cell_order(key):
    workload, scope, direction, page_size, tokens = key
    return workload, scope, direction, -page_size, tokens


def summarize(records: list[dict]) -> list[dict]:
    """Ours against upstream per cell (workload, scope, direction, page size, tokens) of a transfer run.

    For each cell with a figure from either side: the best ``jit*`` provider and the best
    ``upstream*`` provider by ratio to the same-run ceiling, and ``quotient`` = ours / upstream
    (above 1: ours is faster; the ceiling cancels, so it is also the quotient of the GB/s).
    """
    cells: dict = {}
    for r in records:
        side = family(r["provider"])
        if r.get("mode", "transfer") != "transfer" or side == "baseline":
            continue
        cell = cells.setdefault(tuple(r[k] for k in CELL), {})
        if side == "ceiling":
            cell["ceiling"] = r
        elif r.get("ratio") is not None and (side not in cell or r["ratio"] > cell[side]["ratio"]):
            cell[side] = r
    rows = []
    for key in sorted(cells, key=_cell_order):
        cell = cells[key]
        if "ours" not in cell and "upstream" not in cell:
            continue
        row = dict(zip(CELL, key))
        row["ceiling_gbps"] = cell["ceiling"]["gbps"] if "ceiling" in cell else None
        for side in ("ours", "upstream"):
            best = cell.get(side)
            row[side] = best["provider"] if best else None
            row[f"{side}_kernel"] = best.get("kernel") if best else None
            row[f"{side}_gbps"] = best["gbps"] if best else None
            row[f"{side}_ratio"] = best["ratio"] if best else None
        row["quotient"] = row["ours_ratio"] / row["upstream_ratio"] if cell.get("ours") and cell.get("upstream") \
            else None
        rows.append(row)
    return rows


def summary_lines(rows: list[dict]) -> list[str]:
    """The summary as text: one line per cell, ours and upstream with their ratios, then ours/upstream."""
    def side(row, name):
        if row[name] is None:
            return f"{'-':<18} {'':>5}"
        return f"{row[name]:<18} {row[name + '_ratio']:5.2f}"

    lines = ["ours vs upstream: the best of each per cell, ratio to the same-run ceiling; "
             "ours/upstream above 1: ours is faster",
             f"{'workload':<12} {'scope':<5} {'dir':<3} {'page':>4} {'tokens':>6}  {'best ours':<18} {'ratio':>5}  "
             f"{'best upstream':<18} {'ratio':>5}  ours/upstream"]
    for row in rows:
        quotient = f"{row['quotient']:.2f}" if row["quotient"] is not None else "-"
        lines.append(f"{row['workload']:<12} {row['scope']:<5} {row['direction']:<3} {row['page_size']:>4} "
                     f"{row['tokens']:>6}  {side(row, 'ours')}  {side(row, 'upstream')}  {quotient}")
    return lines


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["workload"], r["scope"], r["direction"], r["page_size"]) for r in records})
    cols = 4
    rows = (len(groups) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, group in zip(axes.flat, groups):
        sel = [r for r in records if (r["workload"], r["scope"], r["direction"], r["page_size"]) == group]
        for provider in sorted({r["provider"] for r in sel}):
            pts = sorted((r["tokens"], r["gbps"]) for r in sel if r["provider"] == provider)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=provider,
                    linestyle="--" if provider == "ceiling" else "-")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{group[0]} {group[1]}-layer {group[2]} page {group[3]}", fontsize=9)
        ax.set_xlabel("tokens per call")
        ax.set_ylabel("GB/s")
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)))
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    safeio.write_output(settings.user_path("--plot", path), png.getvalue(), "--plot")
