"""The gpumesh-vs-SMG report: medians over repeats per (workload, load, gateway), the verdict
against the best SMG variant, and the markdown tables."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from gpumesh_bench.harness import median, share_medians


METRICS = (("ttft_p50", "summary.ttft_ms.p50"), ("ttft_p99", "summary.ttft_ms.p99"),
           ("lat_p99", "summary.latency_ms.p99"), ("goodput", "summary.goodput_fraction"),
           ("gw_cpu", "cpu_summary.gateway_pct"), ("lg_cpu", "cpu_summary.loadgen_pct"),
           ("nodes_cpu", "cpu_summary.nodes_pct"), ("machine", "cpu_summary.machine_busy_cores"))


def _get(d: dict[str, Any], path: str) -> float:
    for k in path.split("."):
        d = d.get(k) if isinstance(d, dict) else None  # type: ignore[assignment]
    return math.nan if d is None else float(d)  # type: ignore[arg-type]


def _others(r: dict[str, Any]) -> float:
    """Cores busy with processes outside this benchmark during the run (the shared machine)."""
    c = r.get("cpu_summary", {})
    mine = sum(c.get(k, 0.0) for k in ("gateway_pct", "loadgen_pct", "nodes_pct",
                                           "idle_gateways_pct")) / 100
    return max(0.0, c.get("machine_busy_cores", math.nan) - mine)


def aggregate(runs: list[dict[str, Any]]) -> dict[tuple[str, float, str], dict[str, Any]]:
    groups: dict[tuple[str, float, str], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        c = r["config"]
        groups[(c["workload"], float(c["load"]), c["label"])].append(r)
    out = {}
    for key, rs in groups.items():
        row: dict[str, Any] = {m: median([_get(r, p) for r in rs]) for m, p in METRICS}
        row["others"] = median([_others(r) for r in rs])
        row["p99s"] = [_get(r, "summary.ttft_ms.p99") for r in rs]
        row["errors"] = sum(r["summary"]["requests"] - r["summary"]["ok"] for r in rs)
        row["mismatch"] = sum(r["summary"].get("prompt_mismatch", 0) for r in rs)
        row["n"] = len(rs)
        row["share"] = share_medians(rs)
        row["gateway"] = rs[0]["config"]["gateway"]
        out[key] = row
    return out


def _share_str(share: dict[str, float]) -> str:
    """Per node in fleet order, grouped by speed: ``x1 a/b/c/d · x2 e/f · x0.5 g/h`` (%)."""
    groups: dict[str, list[str]] = defaultdict(list)
    for k in sorted(share):
        sp = k.rsplit("-x", 1)[-1] if "-x" in k else "?"
        groups[sp].append(f"{100 * share[k]:.0f}")
    return " · ".join(f"x{sp} {'/'.join(v)}" for sp, v in groups.items())


def verdict(agg: dict[tuple[str, float, str], dict[str, Any]], wl: str, load: float,
            ref: str = "gpumesh-predicted_latency") -> str:
    rows = {k[2]: v for k, v in agg.items() if k[:2] == (wl, load)}
    smg = {k: v for k, v in rows.items() if v["gateway"] == "smg"}
    if ref not in rows or not smg:
        return "-"
    best = min(smg, key=lambda k: smg[k]["ttft_p99"])
    w = rows[ref]
    ok_p99 = w["ttft_p99"] <= smg[best]["ttft_p99"]
    ok_good = w["goodput"] >= smg[best]["goodput"]
    ok_good_all = w["goodput"] >= max(v["goodput"] for v in smg.values())
    return (f"WLL p99 {w['ttft_p99']:.0f} vs SMG best ({best}) {smg[best]['ttft_p99']:.0f} ms "
            f"-> {w['ttft_p99'] / smg[best]['ttft_p99']:.2f}x {'met' if ok_p99 else 'MISSED'}; "
            f"goodput {100 * w['goodput']:.1f}% vs {100 * smg[best]['goodput']:.1f}% "
            f"{'met' if ok_good else 'MISSED'} (vs SMG's highest goodput: "
            f"{'met' if ok_good_all else 'missed'})")


def markdown(doc: dict[str, Any]) -> str:
    runs = doc["runs"]
    agg = aggregate(runs)
    lines: list[str] = []
    ts = doc.get("args", {}).get("time_scale", 0)
    for wl in sorted({k[0] for k in agg}):
        cap = doc.get("capacity", {}).get(f"{doc['args']['fleet']}/{wl}", {})
        lines.append(f"\n#### {doc['args']['fleet']} / {wl} (capacity "
                     f"{cap.get('req_per_s', 0):.1f} req/s wall at time_scale {ts:g})\n")
        lines.append("| load | gateway / policy | TTFT p50 ms | TTFT p99 ms (median) | p99 each "
                     "repeat | lat p99 ms | goodput % | p99 / best SMG | gateway CPU % | "
                     "loadgen CPU % | nodes CPU % | machine cores busy (others) | errors | node share % |")
        lines.append("|" + "---|" * 14)
        for load in sorted({k[1] for k in agg if k[0] == wl}):
            rows = {k[2]: v for k, v in agg.items() if k[:2] == (wl, load)}
            smg_best = min((v["ttft_p99"] for v in rows.values() if v["gateway"] == "smg"),
                           default=math.nan)
            for name in sorted(rows, key=lambda n: (rows[n]["gateway"] != "gpumesh", n)):
                r = rows[name]
                mism = f" ({r['mismatch']} prompt-size mismatches)" if r["mismatch"] else ""
                lines.append(
                    f"| {load:.0%} | {name} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | "
                    f"{', '.join(f'{x:.0f}' for x in r['p99s'])} | {r['lat_p99']:.0f} | "
                    f"{100 * r['goodput']:.1f} | {r['ttft_p99'] / smg_best:.2f} | "
                    f"{r['gw_cpu']:.0f} | {r['lg_cpu']:.0f} | {r['nodes_cpu']:.0f} | "
                    f"{r['machine']:.2f} ({r['others']:.2f}) | {r['errors']}{mism} | {_share_str(r['share'])} |")
        lines.append("")
        for load in sorted({k[1] for k in agg if k[0] == wl}):
            lines.append(f"- {wl} {load:.0%}: {verdict(agg, wl, load)}")
    if doc.get("git_head"):
        lines.append(f"\ncode: {doc['git_head']}; wall {doc.get('wall_s', 0):.0f} s")
    src = doc.get("smg_load_source")
    if src:
        lines.append("\nSMG load source per gateway (engine_load.version): "
                     + "; ".join(f"{k}: {', '.join(v)}" for k, v in src.items()))
    for k, v in (doc.get("smg_overload_counters") or {}).items():
        if v:
            lines.append(f"\nSMG {k} fallback/overload counters (whole session): "
                         + "; ".join(f"{m} = {x:g}" for m, x in v.items()))
    return "\n".join(lines) + "\n"
