"""Reads the cells' JSON, logs and traces and says what a run showed: per configuration, the verdict and why.

A configuration is (release, model, effective io_backend, effective layout): SGLang's server arguments
rewrite two requested pairs (``plan.REWRITTEN``), and such a cell is judged with the configuration it
becomes (from its recorded effective arguments, else from the plan's rewrite table; a recorded rewrite
that differs from the table is a problem). It passes only when:

* **finished**: every engine it names (every planned cell, and every cell with a result) finished and
  served its workload; one that raised, timed out, hit the deadline or never started fails it (with the
  plugin off, upstream refusing a configuration is recorded as such, and fails it too: nothing could be
  compared there);
* **equal**: upstream, plugin and plugin-nojit served the same token ids and logprobs for every
  request (fewer than two modes that ran is "incomplete");
* **host hits**: every mode counted host hits (tokens loaded back) > 0, and on the same requests;
* **control differs**: each negative control (rows loaded back zeroed) differs from the reference on
  every one of its host-hit requests, counted on those requests alone (whether it hit the host on the
  same requests as the reference is recorded beside); and the sensitivity pair differed inside every run (else equal outputs
  prove nothing);
* **the package moved the rows**: each plugin engine's trace (``harness_plugin.py``) shows, for every
  load-back, this package's ops moving at least the tokens loaded, and at the first layer at least the
  host-hit tokens (per op: ``checks["package_ops"]``); an engine with the plugin off shows none;
* **clean logs**: no ERROR/CRITICAL line and no Traceback in any engine's log (the runs log with the
  level, see ``main.py``), except the lines ``BENIGN`` names;
* the plugin's start line and per-pool line are in the log of every plugin run.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from sglang_server import plan

ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback \(most recent call last\)")
BENIGN = (
    re.compile(r"Ignore import error when loading sglang\.srt\.models"),  # models whose optional deps are absent
)
START_LINE = re.compile(r"sglang-hicache-jit: sglang \S+ \(.*\): routing \d+ HiCache ops")
POOL_LINE = re.compile(r"sglang-hicache-jit: \w+TokenToKVPoolHost \(layout=\S+, \d+ B rows\)")
PLUGIN_MODES = ("plugin", "plugin-nojit", "control-plugin")


def _trace(path: Path) -> list:
    events = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:  # a line cut by a killed process
                continue
            if isinstance(event, dict):
                events.append(event)
    return events


def load(cells_dir: Path) -> list:
    records = []
    for path in sorted(Path(cells_dir).glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except ValueError:
            continue
        if not isinstance(record, dict) or "cell" not in record:
            continue
        log = path.with_suffix(".log")
        record["_log"] = log.read_text(errors="replace") if log.exists() else ""
        record["_trace"] = _trace(path.with_suffix(".trace.jsonl"))
        records.append(record)
    return records


def error_lines(log: str) -> list:
    return [line for line in log.splitlines() if ERROR_LINE.search(line) and not any(b.search(line) for b in BENIGN)]


def _key(record: dict) -> tuple:
    spec = record["spec"]
    eff = record.get("effective") or {}
    planned = plan.effective(spec["io_backend"], spec["layout"])
    io_backend = eff.get("hicache_io_backend") or planned[0]
    layout = eff.get("hicache_mem_layout") or planned[1]
    return spec["release"], spec["kind"], io_backend, layout


def _cell_key(cell) -> tuple:
    return (cell.release, cell.model) + plan.effective(cell.io_backend, cell.layout)


def _signature(record: dict) -> list:
    return [(r["id"], r["output_ids"], r["logprobs"]) for r in record.get("requests", [])]


def _differences(a: dict, b: dict) -> int:
    """How many requests' outputs (ids or logprobs) differ between two runs of the same workload."""
    return sum(1 for x, y in zip(_signature(a), _signature(b)) if x != y) + abs(len(_signature(a)) - len(_signature(b)))


def _host_hit_ids(record: dict) -> list:
    return [r["id"] for r in record.get("requests", []) if r.get("host_hit", 0) > 0]


def _control(reference: dict, control: dict) -> dict:
    """A negative control's differences from the reference, on its host-hit requests alone."""
    wanted = {r["id"]: (r["output_ids"], r["logprobs"]) for r in reference.get("requests", [])}
    hits = _host_hit_ids(control)
    differ = sum(1 for r in control.get("requests", []) if r["id"] in hits
                 and (r["output_ids"], r["logprobs"]) != wanted.get(r["id"]))
    return {"host_hit_requests": len(hits), "differ": differ,
            "same_hits_as_reference": hits == _host_hit_ids(reference)}


def _sensitive(record: dict) -> bool | None:
    pair = {r["id"]: r for r in record.get("requests", []) if r["phase"] == "sensitivity"}
    if len(pair) != 2:
        return None
    a, b = pair["sensitivity-a"], pair["sensitivity-b"]
    return (a["output_ids"], a["logprobs"]) != (b["output_ids"], b["logprobs"])


def package_ops(record: dict) -> dict:
    """What the trace says the package's ops moved in this engine's load-backs: per op, the tokens at the first
    layer; ``moved``/``loaded`` there; ``short``: load calls whose rows the package's ops did not all move."""
    loads = [e for e in record.get("_trace", []) if e.get("event") == "load" and isinstance(e.get("ops"), dict)]
    first = min((e.get("layer", 0) for e in loads), default=0)
    at_first = [e for e in loads if e.get("layer", 0) == first]
    per_op: dict = {}
    for event in at_first:
        for op, tokens in event["ops"].items():
            per_op[op] = per_op.get(op, 0) + tokens
    return {"mode": record["spec"]["mode"], "ops": per_op, "moved": sum(per_op.values()),
            "loaded": sum(e.get("tokens", 0) for e in at_first),
            "loads": len(loads), "short": sum(1 for e in loads if sum(e["ops"].values()) < e.get("tokens", 0)),
            "any": sum(sum(e["ops"].values()) for e in loads), "host_hit_tokens": record.get("host_hit_tokens", 0)}


# A pool call that keeps SGLang's scheduler thread this long is waiting for the GPU (a device sync), not
# launching: upstream's backups and loads take 0.1-1 ms there (2026-12-06, docs/BENCHMARKS.md).
HELD_MS = 10.0


def transfer_spans(record: dict, token_bytes: int) -> dict:
    """The GPU spans the harness traced (harness_plugin.Spans): per all-layer backup and per whole load,
    medians by token count (ms, and GB/s of the KV moved), so a run says what each transfer took on its
    stream; ``host_ms``, the median time the scheduler's thread spent in the pool's calls, and ``held``, how
    many calls kept it over HELD_MS (both None where the trace has none); and the ops inside each backup
    (``backup_ops``: tokens per op, over every backup)."""
    out: dict = {"backup": {}, "load": {}, "backup_ops": {}}
    spans = [e for e in record.get("_trace", []) if e.get("event") == "span" and e.get("ms")]
    for kind in ("backup", "load"):
        by_tokens: dict = {}
        for e in spans:
            if e.get("of") == kind:
                by_tokens.setdefault(int(e.get("tokens", 0)), []).append(e)
        for tokens, records in sorted(by_tokens.items()):
            median = statistics.median(float(e["ms"]) for e in records)
            host = [float(e["host_ms"]) for e in records if e.get("host_ms") is not None]
            out[kind][tokens] = {"n": len(records), "ms": round(median, 3),
                                 "gbps": round(tokens * token_bytes / (median * 1e6), 2) if median > 0 else None,
                                 "host_ms": round(statistics.median(host), 3) if host else None,
                                 "held": sum(h > HELD_MS for h in host) if host else None}
    for e in record.get("_trace", []):
        if e.get("event") == "backup":
            for op, tokens in (e.get("ops") or {}).items():
                out["backup_ops"][op] = out["backup_ops"].get(op, 0) + tokens
    return out


def _dash(value) -> str:
    return "-" if value is None else str(value)


def forward_timeline(record: dict) -> list:
    """The harness's ``timeline`` lines (harness_plugin.Timeline) as rows of medians: per kind of extend pass,
    ``host hit`` (it consumed a load), ``device hit`` (no load, few new tokens) and ``miss`` (at least 1024
    new tokens, no load), by prefix tokens (rounded to a page of 64): n, the pass's GPU ms, and for host
    hits the GPU ms from the load's start to the pass's start and end, and the scheduler's ms from the
    load's start to the forward call."""
    groups: dict = {}
    for e in record.get("_trace", []):
        if e.get("event") != "timeline" or e.get("forward_ms") is None:
            continue
        kind = "host hit" if e.get("load") else ("miss" if int(e.get("extend_tokens", 0)) >= 1024 else "device hit")
        prefix = int(e.get("prefix_tokens", 0)) // 64 * 64
        groups.setdefault((kind, prefix), []).append(e)

    def median(rows, key):
        values = [float(r[key]) for r in rows if r.get(key) is not None]
        return round(statistics.median(values), 3) if values else None

    order = {"host hit": 0, "device hit": 1, "miss": 2}
    return [{"kind": kind, "prefix": prefix, "n": len(rows), "forward_ms": median(rows, "forward_ms"),
             "to_forward_ms": median(rows, "to_forward_ms"), "to_end_ms": median(rows, "to_end_ms"),
             "host_to_forward_ms": median(rows, "host_to_forward_ms")}
            for (kind, prefix), rows in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][1]))
            if prefix >= 1024]  # the measured prefixes; a request of a few pages says little


def _package_ok(mode: str, ops: dict) -> bool:
    if mode in PLUGIN_MODES:
        return ops["loads"] > 0 and ops["short"] == 0 and ops["moved"] >= ops["host_hit_tokens"] > 0
    return ops["any"] == 0  # the plugin is off: the package must move nothing


def judge(records: list, cells=None, outcomes=None) -> dict:
    """Verdicts per configuration. ``cells`` (plan.Cell) are the engines the run planned, ``outcomes`` the
    runner's {cell name: status}: a planned cell without a result fails its configuration."""
    verdicts = judge_groups(records, cells, outcomes)
    result = {"configurations": verdicts, "passed": bool(verdicts) and all(v["verdict"] == "pass" for v in verdicts)}
    result["broken_plugin"] = broken_plugin(records)
    if any(not v.startswith("fail") for v in result["broken_plugin"].values()):
        result["passed"] = False  # the judge let a plugin engine with zeroed rows through: it proves nothing
    return result


def judge_groups(records: list, cells=None, outcomes=None) -> list:
    """The verdict and checks of each configuration (see ``judge``)."""
    groups: dict = {}
    for record in records:
        if record.get("spec", {}).get("workload", "correctness") != "correctness":
            continue
        groups.setdefault(_key(record), {"records": [], "planned": set()})["records"].append(record)
    for cell in cells or ():
        if cell.workload == "correctness":
            groups.setdefault(_cell_key(cell), {"records": [], "planned": set()})["planned"].add(cell.name)
    outcomes = outcomes or {}
    verdicts = []
    for key, group in sorted(groups.items()):
        members = group["records"]
        by_mode: dict = {}
        for r in members:
            by_mode.setdefault(r["spec"]["mode"], []).append(r)
        served = {m: [r for r in rs if r["ok"]] for m, rs in by_mode.items()}
        served = {m: rs for m, rs in served.items() if rs}
        raised = {r["cell"]: r["error"] for r in members if not r["ok"]}
        unfinished = dict(raised)
        with_result = {r["cell"] for r in members}
        for name in sorted(group["planned"] - with_result):
            unfinished[name] = f"no result ({outcomes.get(name, 'not run')})"
        for r in members:
            status = outcomes.get(r["cell"])
            if r["ok"] and status not in (None, "done"):
                unfinished[r["cell"]] = f"served, but the runner says {status}"
        reference = next((served[m][0] for m in ("upstream", "plugin", "plugin-nojit") if m in served), None)
        equal_modes = [m for m in ("upstream", "plugin", "plugin-nojit") if m in served]
        checks = {"served": sorted(served), "raised": raised, "unfinished": unfinished}
        checks["rewrites"] = {r["cell"]: [r["effective"].get("hicache_io_backend"), r["effective"].get("hicache_mem_layout")]
                              for r in members if r.get("effective") and
                              (r["effective"].get("hicache_io_backend"), r["effective"].get("hicache_mem_layout"))
                              != plan.effective(r["spec"]["io_backend"], r["spec"]["layout"])}
        if reference is not None:
            # every run of the three modes, the requests SGLang rewrote into this pair included
            same = [r for m in equal_modes for r in served[m]]
            checks["equal"] = {r["cell"]: _differences(reference, r) == 0 for r in same}
            checks["host_hits"] = {r["cell"]: r.get("host_hit_tokens", 0) for r in same}
            checks["hit_pattern_equal"] = len({tuple(x["host_hit"] for x in r["requests"]) for r in same}) == 1
            checks["sensitive"] = {r["cell"]: _sensitive(r) for r in same}
            controls = served.get("control", []) + served.get("control-plugin", [])
            checks["control_differs"] = {r["cell"]: _control(reference, r) for r in controls}
        ok_runs = [r for r in members if r["ok"]]
        checks["package_ops"] = {r["cell"]: package_ops(r) for r in ok_runs}
        checks["package_ok"] = {r["cell"]: _package_ok(r["spec"]["mode"], checks["package_ops"][r["cell"]])
                                for r in ok_runs}
        checks["error_lines"] = {r["cell"]: error_lines(r["_log"])[:5] for r in members if error_lines(r["_log"])}
        plugin_runs = [r for r in ok_runs if r["spec"]["mode"].startswith("plugin")]
        checks["start_line"] = {r["cell"]: bool(START_LINE.search(r["_log"])) for r in plugin_runs}
        checks["pool_line"] = {r["cell"]: bool(POOL_LINE.search(r["_log"])) for r in plugin_runs}
        verdicts.append({"release": key[0], "model": key[1], "io_backend": key[2], "layout": key[3],
                         "verdict": _verdict(checks, equal_modes), "checks": checks})
    return verdicts


def broken_plugin(records: list) -> dict:
    """The judge on a real broken plugin engine: in each configuration where a ``control-plugin`` engine (the
    plugin on, every row loaded back zeroed) served, that engine stands in for the plugin engine and the
    configuration is judged again; {control-plugin cell: verdict}. Each verdict must be a fail."""
    out = {}
    for broken in (r for r in records if r.get("ok") and r.get("spec", {}).get("mode") == "control-plugin"):
        key = _key(broken)
        rest = [r for r in records if r is not broken and r.get("spec", {}).get("mode") not in
                ("plugin", "control-plugin") and r.get("spec", {}).get("workload", "correctness") == "correctness"
                and _key(r) == key]
        posing = dict(broken, spec=dict(broken["spec"], mode="plugin"))
        verdicts = judge_groups(rest + [posing])
        out[broken["cell"]] = verdicts[0]["verdict"] if verdicts else "incomplete"
    return out


def _verdict(checks: dict, equal_modes: list) -> str:
    problems = []
    if checks["unfinished"]:
        problems.append("engines that did not finish: " + ", ".join(sorted(checks["unfinished"])))
    if checks["rewrites"]:
        problems.append("SGLang rewrote a pair otherwise than the plan says: " + ", ".join(sorted(checks["rewrites"])))
    if len(equal_modes) < 2 or "equal" not in checks:
        return "fail: " + "; ".join(problems) if problems else "incomplete"
    if not all(checks["equal"].values()):
        problems.append("outputs differ between modes")
    if not all(v > 0 for v in checks["host_hits"].values()):
        problems.append("a mode had no host hit")
    if not all(v is True for v in checks["sensitive"].values()):
        problems.append("the sensitivity pair did not differ")
    for cell, control in sorted(checks["control_differs"].items()):
        if not (control["host_hit_requests"] > 0 and control["differ"] == control["host_hit_requests"]):
            problems.append(f"a negative control equalled the reference on a host-hit request ({cell}: "
                            f"{control['differ']} of {control['host_hit_requests']} differ)")
    for cell, ok in sorted(checks["package_ok"].items()):
        if not ok:
            ops = checks["package_ops"][cell]
            problems.append(f"the trace of {cell} does not show the package's ops moving the host hits (moved "
                            f"{ops['moved']} of {ops['host_hit_tokens']} host-hit tokens at the first layer, "
                            f"{ops['short']} of {ops['loads']} loads short, {ops['any']} tokens in all)")
    if checks["error_lines"]:
        first = sorted(checks["error_lines"].items())[0]
        problems.append(f"error lines in a log ({first[0]}: {first[1][0][:200]!r})")
    if not all(checks["start_line"].values()) or not all(checks["pool_line"].values()):
        problems.append("a plugin run lacks the start line or the per-pool line")
    return "pass" if not problems else "fail: " + "; ".join(problems)


MODE_NAMES = {"upstream": "upstream (SGLang's own kernels)", "plugin": "plugin", "plugin-nojit": "plugin, copy engines",
              "hicache-off": "HiCache off"}


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
        lines += ["| release | model | io_backend | layout | modes served | host-hit tokens | package ops (first "
                  "layer) | control diffs on host hits | verdict |", "|---|---|---|---|---|---|---|---|---|"]
        for v in result["configurations"]:
            c = v["checks"]
            ops = "; ".join(f"{o['mode']}: " + (", ".join(f"{op} {n}" for op, n in sorted(o["ops"].items())) or "none")
                            for _, o in sorted(c.get("package_ops", {}).items()))
            controls = ", ".join(f"{x['differ']}/{x['host_hit_requests']}" for x in c.get("control_differs", {}).values())
            lines.append(f"| {v['release']} | {v['model']} | {v['io_backend']} | {v['layout']} | "
                         f"{', '.join(c['served'])} | {', '.join(str(x) for x in c.get('host_hits', {}).values())} | "
                         f"{ops} | {controls} | {v['verdict']} |")
        for cell, verdict in sorted(result.get("broken_plugin", {}).items()):
            lines += ["", f"A broken plugin engine judged as the plugin ({cell}, rows loaded back zeroed): {verdict}"]
        unfinished = {k: e for v in result["configurations"] for k, e in v["checks"]["unfinished"].items()}
        if unfinished:
            lines += ["", "Engines that did not finish (each fails its configuration):", ""]
            lines += [f"* `{k}`: {e[:300]}" for k, e in sorted(unfinished.items())]
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


def _stats_ms(values: list) -> dict | None:
    """Median, min and max of seconds, in ms (None where there is none)."""
    if not values:
        return None
    ms = sorted(v * 1000 for v in values)
    mid = len(ms) // 2
    median = ms[mid] if len(ms) % 2 else (ms[mid - 1] + ms[mid]) / 2
    return {"median": round(median, 2), "min": round(ms[0], 2), "max": round(ms[-1], 2), "n": len(ms)}


def realsize_tables(records: list, h2d_gbps: float | None) -> dict:
    """The real-size runs' TTFT and TPOT rows, from each engine's raw rounds.

    A round counts for the host hit only when ``cached_tokens_details`` says the whole prefix (within
    one page) came from the host, and for the device hit only when it all came from the device; a miss
    only when nothing was cached. ``host - device`` is paired within each round that proved both. The
    floor is the prefix's KV bytes at the contiguous pinned copy's rate measured in the same call."""
    from sglang_server import models

    ttft, tpot, engines = [], [], []
    for r in records:
        spec = r.get("spec", {})
        if spec.get("workload") != "realsize":
            continue
        kind, mode = spec.get("kind"), spec.get("mode")
        token_bytes = models.kv_row_bytes(kind)["token"]
        engines.append({"model": kind, "mode": mode, "ok": r.get("ok"), "error": r.get("error", "")[:300],
                        "start_s": r.get("engine_start_s"), "workload_s": r.get("workload_s"),
                        "cut": r.get("ttft_cut") or r.get("tpot_cut"), "effective": r.get("effective"),
                        "dropped_args": r.get("dropped_args"), "package_ops": package_ops(r),
                        "spans": transfer_spans(r, token_bytes), "timeline": forward_timeline(r)})
        rows = r.get("ttft", [])
        for key in sorted({(x["length"], x["background"]) for x in rows}):
            sel = [x for x in rows if (x["length"], x["background"]) == key]
            length = key[0]
            host_ok = [x for x in sel if x.get("host", {}).get("host_hit", 0) >= length - 64]
            dev_ok = [x for x in sel if x.get("device", {}).get("device_hit", 0) >= length - 64]
            pairs = [x for x in host_ok if x in dev_ok]
            floor = round(length * token_bytes / (h2d_gbps * 1e9) * 1000, 2) if h2d_gbps else None
            delta = _stats_ms([x["host"]["ttft_s"] - x["device"]["ttft_s"] for x in pairs])
            ttft.append({
                "model": kind, "mode": mode, "length": length, "background": key[1], "rounds": len(sel),
                "miss": _stats_ms([x["cold"]["ttft_s"] for x in sel if x["cold"]["cached"] == 0]),
                "device": _stats_ms([x["device"]["ttft_s"] for x in dev_ok]),
                # What ran just before a device hit changes it: right after the miss, the miss's write-through
                # backup may still be running; right after the host hit, nothing is.
                "device_after_miss": _stats_ms([x["device"]["ttft_s"] for x in dev_ok if x.get("device_first")]),
                "device_after_host": _stats_ms([x["device"]["ttft_s"] for x in dev_ok if not x.get("device_first")]),
                "host": _stats_ms([x["host"]["ttft_s"] for x in host_ok]),
                # The same split for the host hit: first in its round it runs beside the miss's backup.
                "host_after_miss": _stats_ms([x["host"]["ttft_s"] for x in host_ok if not x.get("device_first")]),
                "host_after_device": _stats_ms([x["host"]["ttft_s"] for x in host_ok if x.get("device_first")]),
                "host_minus_device": delta, "floor_ms": floor,
                "of_floor": round(delta["median"] / floor, 3) if delta and floor else None,
                "host_hits_proven": len(host_ok), "device_hits_proven": len(dev_ok)})
        for t in r.get("tpot", []):
            tpot.append({"model": kind, "mode": mode, **{k: v for k, v in t.items() if k != "requests"},
                         "traffic_requests": len(t.get("requests", []))})
    return {"ttft": ttft, "tpot": tpot, "engines": engines, "h2d_gbps": h2d_gbps}


def _fmt(stats: dict | None) -> str:
    return "-" if not stats else f"{stats['median']} [{stats['min']}-{stats['max']}] n={stats['n']}"


def realsize_markdown(tables: dict) -> str:
    lines = ["", "## Real-size engines", "", "| model | mode | served | start s | workload s | cut at | "
             "package ops: tokens at the first layer |", "|---|---|---|---|---|---|---|"]
    for e in tables.get("engines", []):
        po = e["package_ops"]
        ops = (", ".join(f"{op} {n}" for op, n in sorted(po["ops"].items())) or "none") + \
            f" (loaded {po['loaded']}, loads {po['loads']}, short {po['short']})"
        lines.append(f"| {e['model']} | {MODE_NAMES.get(e['mode'], e['mode'])} | {'yes' if e['ok'] else e['error']} | "
                     f"{e['start_s']} | {e['workload_s']} | {e['cut'] or '-'} | {ops} |")
    lines += ["", "## Transfers on their streams (harness spans: ms median and GB/s, n, by tokens)", "",
              "| model | mode | transfer | tokens | n | ms | GB/s | scheduler's ms in the calls | calls over "
              f"{HELD_MS:g} ms there | ops inside the backups |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in tables.get("engines", []):
        spans = e.get("spans") or {}
        ops = ", ".join(f"{op} {n}" for op, n in sorted(spans.get("backup_ops", {}).items())) or "none"
        for kind in ("load", "backup"):
            for tokens, row in spans.get(kind, {}).items():
                if int(tokens) >= 1024:  # the prefixes and chunks; a page of a short suffix says little
                    lines.append(f"| {e['model']} | {MODE_NAMES.get(e['mode'], e['mode'])} | {kind} | {tokens} | "
                                 f"{row['n']} | {row['ms']} | {row['gbps']} | "
                                 f"{_dash(row.get('host_ms'))} | {_dash(row.get('held'))} | "
                                 f"{ops if kind == 'backup' else '-'} |")
    lines += ["", "## Where a hit's time goes (harness timeline: GPU ms, medians; load start = SGLang's "
              "start_loading)", "",
              "| model | mode | pass | prefix | n | pass's GPU ms | load start to pass start | load start to pass end | "
              "scheduler's ms, load start to forward call |", "|---|---|---|---|---|---|---|---|---|"]
    for e in tables.get("engines", []):
        for row in e.get("timeline") or []:
            lines.append(f"| {e['model']} | {MODE_NAMES.get(e['mode'], e['mode'])} | {row['kind']} | {row['prefix']} | "
                         f"{row['n']} | {row['forward_ms']} | {_dash(row['to_forward_ms'])} | "
                         f"{_dash(row['to_end_ms'])} | {_dash(row['host_to_forward_ms'])} |")
    lines += ["", f"## Real-size TTFT (ms: median [min-max] n=rounds), PCIe floor at {tables['h2d_gbps']} GB/s "
             "(contiguous pinned H2D, same call)", "",
             "| model | mode | prefix | beside decoding | miss | device hit | device hit after a miss | "
             "device hit after a host hit | host hit | host hit after a miss | host hit after a device hit | "
             "host - device (paired) | floor | of floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in tables["ttft"]:
        lines.append(f"| {row['model']} | {MODE_NAMES.get(row['mode'], row['mode'])} | {row['length']} | "
                     f"{'yes' if row['background'] else 'no'} | {_fmt(row['miss'])} | {_fmt(row['device'])} | "
                     f"{_fmt(row.get('device_after_miss'))} | {_fmt(row.get('device_after_host'))} | "
                     f"{_fmt(row['host'])} | {_fmt(row.get('host_after_miss'))} | "
                     f"{_fmt(row.get('host_after_device'))} | {_fmt(row['host_minus_device'])} | "
                     f"{row['floor_ms']} | {row['of_floor']} |")
    # The baseline of each row: HiCache off under the same traffic (the same request stream, computed
    # and never written to or read from the host).
    off = {(r["model"], r["traffic"]): r["median_ms"] for r in tables["tpot"] if r["mode"] == "hicache-off"}
    lines += ["", "## Real-size TPOT (ms per output token of the steady decode batch)", "",
              "| model | mode | traffic | median | mean | p90 | p99 | median over HiCache off | samples | "
              "traffic requests | host-hit tokens |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in tables["tpot"]:
        base = off.get((row["model"], row["traffic"]))
        over = f"{(row['median_ms'] / base - 1) * 100:+.1f}%" if base and row["median_ms"] else "-"
        lines.append(f"| {row['model']} | {MODE_NAMES.get(row['mode'], row['mode'])} | {row['traffic']} | "
                     f"{row['median_ms']} | {row.get('mean_ms', '-')} | {row['p90_ms']} | {row.get('p99_ms', '-')} | "
                     f"{over} | {row['samples']} | {row['traffic_requests']} | {row['host_hit_tokens']} |")
    return "\n".join(lines) + "\n"
