"""Markdown of the front-door phases' records (``frontdoors.phases``): per shape and engine count, each door's
median over rounds with its range, and gpumesh's ratio to it paired within the same round of the
same harness run (``records.pair_key``), by C ÷ p50 and by completions in the window; the
unequal pair (``uneq05``) per balancer, with each node's share of the completed requests.

  python -m gpumesh_bench.gpu.frontdoors.report results.json[.gz]... [--md OUT.md] [--from-round N]
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

from gpumesh_bench.gpu.records import median_field, median_of, ms, pair_key, report_cli, spread

GPUMESH = "gpumesh"


def loop_qps(r: dict[str, Any]) -> float:
    """A closed loop's throughput by Little's law: concurrency / median latency. With a fixed
    output length the loop's streams finish in waves of about C requests, so completions
    counted in a window of a few latencies move in steps of C / window (``done_qps``); C / p50
    does not (latencies within a run spread by a few percent: p99 / p50 is in the record)."""
    p50 = r.get("lat_p50") or math.nan
    return r["concurrency"] / p50 if p50 and not math.isnan(p50) else math.nan


def cpu_us_per_token(r: dict[str, Any]) -> float:
    """The door's own cores in the window over its token rate (C x output tokens / p50)."""
    cores = r.get("cpu", {}).get("door front", math.nan)
    tok_s = loop_qps(r) * (r.get("out_tokens_p50") or math.nan)
    return cores / tok_s * 1e6 if tok_s and not math.isnan(tok_s) else math.nan


def door_rows(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per door of one (phase, engines): medians over rounds and gpumesh's paired
    ratios (gpumesh / door of the same round of the same run: QPS by C ÷ p50, completions in
    the window, p50 latency)."""
    by_door: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        by_door.setdefault(r["door_key"], []).append(r)
    ours = {pair_key(r): r for r in by_door.get(GPUMESH, [])}
    rows = []
    for d, rs in by_door.items():
        paired = [(ours[pair_key(r)], r) for r in rs if pair_key(r) in ours]
        rows.append({
            "door": d, "label": rs[0]["door"], "rounds": len(rs),
            "qps": [loop_qps(r) for r in rs], "qps_med": median_of([loop_qps(r) for r in rs]),
            "win_qps": [r["done_qps"] for r in rs],
            "ttft50": median_field(rs, "ttft_p50"), "ttft99": median_field(rs, "ttft_p99"),
            "lat50": median_field(rs, "lat_p50"), "lat99": median_field(rs, "lat_p99"),
            "cpu_tok": [cpu_us_per_token(r) for r in rs],
            "cores": median_of([r.get("cpu", {}).get("door front", math.nan) for r in rs]),
            "qps_ratio": [loop_qps(o) / loop_qps(r) for o, r in paired if loop_qps(r) > 0],
            "win_ratio": [o["done_qps"] / r["done_qps"] for o, r in paired if r.get("done_qps")],
            "p50_ratio": [o["lat_p50"] / r["lat_p50"] for o, r in paired if r["lat_p50"]],
            "p99_ratio": [o["lat_p99"] / r["lat_p99"] for o, r in paired if r.get("lat_p99")]})
    order = ["bare", GPUMESH, "nginx", "smg"]
    return sorted(rows, key=lambda x: order.index(x["door"]) if x["door"] in order else 9)


def doors_table(recs: list[dict[str, Any]]) -> str:
    out = ["| front door | QPS = C ÷ p50 latency | completions/s in the window | TTFT p50 / p99 ms | "
           "latency p50 / p99 ms | front-door CPU µs per output token | front-door cores | "
           "gpumesh ÷ this: C ÷ p50 / completions | gpumesh ÷ this: latency p50 / p99 "
           "| rounds |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for x in door_rows(recs):
        mine = x["door"] == GPUMESH
        out.append(
            f"| {x['label']} | {spread(x['qps'])} | {spread(x['win_qps'])} | "
            f"{ms(x['ttft50'])} / {ms(x['ttft99'])} | "
            f"{ms(x['lat50'])} / {ms(x['lat99'])} | {spread(x['cpu_tok'], 0)} | "
            f"{x['cores']:.2f} | "
            f"{'—' if mine else spread(x['qps_ratio'], 2) + ' / ' + spread(x['win_ratio'], 2)} | "
            f"{'—' if mine else spread(x['p50_ratio'], 2) + ' / ' + spread(x['p99_ratio'], 2)} | "
            f"{x['rounds']} |")
    return "\n".join(out)


def uneq_table(recs: list[dict[str, Any]]) -> str:
    out = ["| balancer | completions/s in the window | TTFT p50 / p99 ms | latency p50 / p99 ms | "
           "share of requests on big / small | failed requests | rounds |",
           "|---|---|---|---|---|---|---|"]
    by: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        by.setdefault(r["policy"], []).append(r)
    for p, rs in by.items():
        shares = []
        for r in rs:
            s = r.get("node_share", {})
            tot = sum(s.values()) or 1
            shares.append((s.get("big", 0) / tot, s.get("small", 0) / tot))
        big = median_of([a for a, _ in shares])
        small = median_of([b for _, b in shares])
        out.append(f"| {p} | {spread([r['done_qps'] for r in rs])} | "
                   f"{ms(median_field(rs, 'ttft_p50'))} / {ms(median_field(rs, 'ttft_p99'))} | "
                   f"{ms(median_field(rs, 'lat_p50'))} / {ms(median_field(rs, 'lat_p99'))} | "
                   f"{big:.0%} / {small:.0%} | {sum(r.get('errors', 0) for r in rs)} of "
                   f"{sum(r.get('requests', 0) for r in rs)} | {len(rs)} |")
    return "\n".join(out)


def doors_markdown(records: list[dict[str, Any]], meta: dict[str, Any],
                   from_round: int = 0) -> str:
    """The front-door sections of a results document ("" when it has none); rounds before
    ``from_round`` of each run left out."""
    recs = [r for r in records if "door" in r and r.get("round", 0) >= from_round]
    if not recs:
        return ""
    parts = ["\n## Front doors\n"]
    for phase in sorted({r["phase"] for r in recs if r["phase"].startswith("doors")}):
        for n in (1, 2):
            rs = [r for r in recs if r["phase"] == phase and r.get("engines") == n]
            if rs:
                sched = rs[0].get("scheduler") or {}
                limits = (f"; every engine max_num_seqs {sched.get('max_num_seqs')}, "
                          f"max_num_batched_tokens {sched.get('max_num_batched_tokens')}"
                          if sched else "")
                parts.append(f"### {phase}: {rs[0]['shape']}, {n} engine{'s' if n > 1 else ''} "
                             f"on one GPU, concurrency {rs[0]['concurrency']}{limits}\n")
                parts.append(doors_table(rs) + "\n")
    un = [r for r in recs if r["phase"].startswith("uneq")]
    if un:
        parts.append(f"### {un[0]['phase']}: two engines on one GPU, KV blocks "
                     f"{un[0].get('kv_blocks')}, concurrency {un[0]['concurrency']}\n")
        parts.append(uneq_table(un) + "\n")
    if meta.get("doors_failed"):
        parts.append("Not run or failed:\n" + "\n".join(
            f"- {k}: {v[:300]}" for k, v in meta["doors_failed"].items()) + "\n")
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    return report_cli("python -m gpumesh_bench.gpu.frontdoors.report", __doc__, argv,
                      lambda records, meta, from_round: doors_markdown(
                          records, {"doors_failed": meta.get("doors_failed", {})}, from_round))


if __name__ == "__main__":
    sys.exit(main())
