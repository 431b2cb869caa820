"""Reads the cells' JSON and logs and says what a run showed: per configuration, the verdict and why.

For each (release, model, effective io_backend, effective layout):

* **equal**: upstream, plugin and plugin-nojit served the same token ids and logprobs for every
  request (only modes that ran count; fewer than two is "incomplete");
* **host hits**: every mode counted host hits (tokens loaded back) > 0, and the same per request;
* **control differs**: the negative control (rows loaded back zeroed) changed at least one output,
  and the sensitivity pair differed inside every run (else equal outputs prove nothing);
* **clean logs**: no ERROR/CRITICAL line and no Traceback in any engine's log (the runs log with the
  level, see ``main.py``), except the lines ``BENIGN`` names;
* the plugin's start line and per-pool line are in the log of every plugin run.

A cell that raised is listed with its error: with the plugin off, upstream may refuse a configuration,
which is recorded, not a failure of the package.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback \(most recent call last\)")
BENIGN = (
    re.compile(r"Ignore import error when loading sglang\.srt\.models"),  # models whose optional deps are absent
)
START_LINE = re.compile(r"sglang-hicache-jit: sglang \S+ \(.*\): routing \d+ HiCache ops")
POOL_LINE = re.compile(r"sglang-hicache-jit: \w+TokenToKVPoolHost \(layout=\S+, \d+ B rows\)")


def load(cells_dir: Path) -> list:
    records = []
    for path in sorted(Path(cells_dir).glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except ValueError:
            continue
        if "cell" not in record:
            continue
        log = path.with_suffix(".log")
        record["_log"] = log.read_text(errors="replace") if log.exists() else ""
        records.append(record)
    return records


def error_lines(log: str) -> list:
    return [line for line in log.splitlines() if ERROR_LINE.search(line) and not any(b.search(line) for b in BENIGN)]


def _key(record: dict) -> tuple:
    spec = record["spec"]
    eff = record.get("effective") or {}
    io_backend = eff.get("hicache_io_backend") or spec["io_backend"]
    layout = eff.get("hicache_mem_layout") or spec["layout"]
    return spec["release"], spec["kind"], io_backend, layout


def _signature(record: dict) -> list:
    return [(r["id"], r["output_ids"], r["logprobs"]) for r in record.get("requests", [])]


def _differences(a: dict, b: dict) -> int:
    """How many requests' outputs (ids or logprobs) differ between two runs of the same workload."""
    return sum(1 for x, y in zip(_signature(a), _signature(b)) if x != y) + abs(len(_signature(a)) - len(_signature(b)))


def _sensitive(record: dict) -> bool | None:
    pair = {r["id"]: r for r in record.get("requests", []) if r["phase"] == "sensitivity"}
    if len(pair) != 2:
        return None
    a, b = pair["sensitivity-a"], pair["sensitivity-b"]
    return (a["output_ids"], a["logprobs"]) != (b["output_ids"], b["logprobs"])


def judge(records: list) -> dict:
    groups: dict = {}
    for record in records:
        if record.get("spec", {}).get("workload", "correctness") != "correctness":
            continue
        groups.setdefault(_key(record), []).append(record)
    verdicts = []
    for key, members in sorted(groups.items()):
        by_mode: dict = {}
        for r in members:
            by_mode.setdefault(r["spec"]["mode"], []).append(r)
        served = {m: rs for m, rs in by_mode.items() if all(r["ok"] for r in rs)}
        raised = {r["cell"]: r["error"] for r in members if not r["ok"]}
        reference = next((served[m][0] for m in ("upstream", "plugin", "plugin-nojit") if m in served), None)
        equal_modes = [m for m in ("upstream", "plugin", "plugin-nojit") if m in served]
        checks = {"served": sorted(served), "raised": raised}
        if reference is not None:
            # every run of the three modes, the requests SGLang rewrote into this pair included
            same = [r for m in equal_modes for r in served[m]]
            checks["equal"] = {r["cell"]: _differences(reference, r) == 0 for r in same}
            checks["host_hits"] = {r["cell"]: r.get("host_hit_tokens", 0) for r in same}
            checks["hit_pattern_equal"] = len({tuple(x["host_hit"] for x in r["requests"]) for r in same}) == 1
            checks["sensitive"] = {r["cell"]: _sensitive(r) for r in same}
            controls = served.get("control", []) + served.get("control-plugin", [])
            checks["control_differs"] = {r["cell"]: _differences(reference, r) for r in controls}
        checks["error_lines"] = {r["cell"]: error_lines(r["_log"])[:5] for r in members if error_lines(r["_log"])}
        plugin_runs = [r for r in members if r["ok"] and r["spec"]["mode"].startswith("plugin")]
        checks["start_line"] = {r["cell"]: bool(START_LINE.search(r["_log"])) for r in plugin_runs}
        checks["pool_line"] = {r["cell"]: bool(POOL_LINE.search(r["_log"])) for r in plugin_runs}
        verdicts.append({"release": key[0], "model": key[1], "io_backend": key[2], "layout": key[3],
                         "verdict": _verdict(checks, equal_modes), "checks": checks})
    return {"configurations": verdicts, "passed": bool(verdicts) and all(v["verdict"] == "pass" for v in verdicts)}


def _verdict(checks: dict, equal_modes: list) -> str:
    if len(equal_modes) < 2 or "equal" not in checks:
        return "incomplete"
    problems = []
    if not all(checks["equal"].values()):
        problems.append("outputs differ between modes")
    if not all(v > 0 for v in checks["host_hits"].values()):
        problems.append("a mode had no host hit")
    if not all(v is True for v in checks["sensitive"].values()):
        problems.append("the sensitivity pair did not differ")
    if checks["control_differs"] and not all(v > 0 for v in checks["control_differs"].values()):
        problems.append("a negative control equalled the reference")
    if checks["error_lines"]:
        problems.append("error lines in a log")
    if not all(checks["start_line"].values()) or not all(checks["pool_line"].values()):
        problems.append("a plugin run lacks the start line or the per-pool line")
    return "pass" if not problems else "fail: " + "; ".join(problems)


MODE_NAMES = {"upstream": "upstream (sgl-kernel)", "plugin": "plugin", "plugin-nojit": "plugin, copy engines"}


def ttft_table(records: list, kv_bytes_per_token: int, link_gbps: float = 55.0) -> list:
    """Rows (length, background) x mode: host-hit and device-hit medians beside the PCIe floor."""
    rows = {}
    for r in records:
        if r.get("spec", {}).get("workload") != "ttft" or not r.get("ok"):
            continue
        for s in r.get("ttft_summary", []):
            row = rows.setdefault((s["length"], s["background"]), {
                "length": s["length"], "background": s["background"],
                "floor_ms": round(s["length"] * kv_bytes_per_token / (link_gbps * 1e9) * 1000, 2)})
            row[f"host_ms_{r['spec']['mode']}"] = s["host_hit_ms"]
            row[f"device_ms_{r['spec']['mode']}"] = s["device_hit_ms"]
            row[f"cold_ms_{r['spec']['mode']}"] = s.get("cold_ms")
            row[f"host_rounds_{r['spec']['mode']}"] = s["host_rounds"]
    return [rows[k] for k in sorted(rows)]


def markdown(result: dict, ttft: list | None = None, label: str = "") -> str:
    lines = [f"# SGLang server tests {label}".rstrip(), ""]
    if result["configurations"]:
        lines += ["| release | model | io_backend | layout | modes served | host-hit tokens | control diffs | verdict |",
                  "|---|---|---|---|---|---|---|---|"]
        for v in result["configurations"]:
            c = v["checks"]
            lines.append(f"| {v['release']} | {v['model']} | {v['io_backend']} | {v['layout']} | "
                         f"{', '.join(c['served'])} | {', '.join(str(x) for x in c.get('host_hits', {}).values())} | "
                         f"{', '.join(str(x) for x in c.get('control_differs', {}).values())} | {v['verdict']} |")
        raised = {k: e for v in result["configurations"] for k, e in v["checks"]["raised"].items()}
        if raised:
            lines += ["", "Cells that raised (with the plugin off, upstream may refuse a configuration):", ""]
            lines += [f"* `{k}`: {e[:300]}" for k, e in sorted(raised.items())]
    if ttft:
        lines += ["", "TTFT medians in ms (a prompt of the prefix plus 64 new tokens, one output token); the device hit, "
                  "the host hit and a miss (the whole prompt computed), each mode's engine on its own.", "",
                  "| prefix tokens | beside decoding | PCIe floor | mode | miss | device hit | host hit | "
                  "host hit - device hit |", "|---|---|---|---|---|---|---|---|"]
        for row in ttft:
            for mode in ("upstream", "plugin", "plugin-nojit"):
                if f"host_ms_{mode}" not in row:
                    continue
                host, device = row[f"host_ms_{mode}"], row[f"device_ms_{mode}"]
                delta = round(host - device, 2) if host is not None and device is not None else None
                lines.append(f"| {row['length']} | {'yes' if row['background'] else 'no'} | {row['floor_ms']} | "
                             f"{MODE_NAMES.get(mode, mode)} | {row.get(f'cold_ms_{mode}')} | {device} | {host} | {delta} |")
    return "\n".join(lines) + "\n"
