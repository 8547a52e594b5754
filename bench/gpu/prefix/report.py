"""Markdown of the cache-aware phases' records (``prefix05``, ``prefix7``): per balancer,
medians over rounds (spread beside the main figures), each node's share and prefix-cache hit
rate, and p90 TTFT paired against least_request and SMG cache_aware within the same round of
the same harness run (``records.pair_key``).

  python -m gpumesh_bench.gpu.prefix.report results.json[.gz]... [--md OUT.md] [--from-round N]

(``python -m gpumesh_bench.gpu report`` includes these tables.) ``--from-round N`` leaves each
run's rounds before N out (warm rounds only).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

from gpumesh_bench.gpu.records import median_field, median_of, ms, pair_key, report_cli, spread

SHAPE_LABEL = {"0.5b": "0.5B", "7b": "7B"}


def _ratio(rs: list[dict[str, Any]], base: dict[tuple[int | None, int], dict[str, Any]]
           ) -> list[float]:
    out = []
    for r in rs:
        b = base.get(pair_key(r))
        if b and b.get("ttft_p90") and not math.isnan(b["ttft_p90"]):
            out.append(r["ttft_p90"] / b["ttft_p90"])
    return out


def prefix_table(recs: list[dict[str, Any]]) -> str:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        by.setdefault(r["prefix"], []).append(r)
    lr = {pair_key(r): r for r in by.get("least_request", [])}
    smg = {pair_key(r): r for r in by.get("smg", [])}
    nodes = sorted({n for r in recs for n in r.get("nodes", {})}
                   | {n for r in recs for n in r.get("node_share", {})} - {"?"})
    out = ["| balancer | TTFT p50 / p90 / p99 ms | p90 TTFT ms (range) | latency p50 / p99 ms "
           "| completions/s | share " + " / ".join(nodes) + " | prefix hit rate "
           + " / ".join(nodes) + " | tenant on its main node | p90 TTFT ÷ least_request "
           "| p90 TTFT ÷ SMG | errors | rounds |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = ["least_request", "precise", "approximate", "smg"]
    for s, rs in sorted(by.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 9):
        shares = []
        for r in rs:
            tot = sum(r.get("node_share", {}).values()) or 1
            shares.append([r.get("node_share", {}).get(n, 0) / tot for n in nodes])
        share = " / ".join(f"{median_of([x[i] for x in shares]):.0%}" for i in range(len(nodes)))
        hits = [[r.get("nodes", {}).get(n, {}).get("prefix_hit_rate", math.nan) for r in rs]
                for n in nodes]
        hit = " / ".join(f"{median_of(h):.0%}" for h in hits)
        out.append(
            f"| {rs[0]['balancer']} | {ms(median_field(rs, 'ttft_p50'))} / "
            f"{ms(median_field(rs, 'ttft_p90'))} / {ms(median_field(rs, 'ttft_p99'))} "
            f"| {spread([r['ttft_p90'] * 1000 for r in rs], 0)} "
            f"| {ms(median_field(rs, 'lat_p50'))} / {ms(median_field(rs, 'lat_p99'))} "
            f"| {spread([r['done_qps'] for r in rs])} | {share} | {hit} "
            f"| {median_of([r.get('tenant_stickiness', math.nan) for r in rs]):.0%} "
            f"| {'—' if s == 'least_request' else spread(_ratio(rs, lr), 2)} "
            f"| {'—' if s == 'smg' else spread(_ratio(rs, smg), 2)} "
            f"| {sum(r.get('errors', 0) for r in rs)} of {sum(r.get('requests', 0) for r in rs)} "
            f"| {len(rs)} |")
    return "\n".join(out)


def prefix_markdown(records: list[dict[str, Any]], from_round: int = 0) -> str:
    """The cache-aware section of a results document ("" when it has none); rounds before
    ``from_round`` of each run left out."""
    recs = [r for r in records if "prefix" in r and r.get("round", 0) >= from_round]
    if not recs:
        return ""
    parts = ["\n## Cache-aware routing\n"]
    for phase in sorted({r["phase"] for r in recs}):
        rs = [r for r in recs if r["phase"] == phase]
        w = rs[0].get("workload", {})
        shapes = " and ".join(SHAPE_LABEL.get(x, x) for x in sorted({r.get("shape", "0.5b")
                                                                     for r in rs}))
        sched = w.get("scheduler") or {}
        limits = (f"; scheduler max_num_seqs {sched.get('max_num_seqs')}, "
                  f"max_num_batched_tokens {sched.get('max_num_batched_tokens')}"
                  if sched else "")
        runs = len({r.get("call") for r in rs})
        parts.append(
            f"### {phase}: two {shapes} engines on one GPU, {w.get('tenants')} tenants x "
            f"{w.get('system_words')}-token system prompts, up to {w.get('max_turns')} turns, "
            f"{w.get('max_tokens')} output tokens, closed loop at concurrency "
            f"{rs[0]['concurrency']}; KV {w.get('kv_tokens')} tokens per node "
            f"(all system prompts: {w.get('system_prompt_tokens_all')}){limits}; "
            f"{runs} run{'s' if runs > 1 else ''}"
            + (f", rounds from {from_round}" if from_round else "") + "\n")
        parts.append(prefix_table(rs) + "\n")
        modes = sorted({r["smg_mode"] for r in rs if r.get("smg_mode")})
        if modes:
            parts.append("SMG cache state: " + "; ".join(modes) + "\n")
        stalls = [f"{r['balancer']} round {r['round']}: first completion at "
                  f"{r['first_done_s']:.1f} s" for r in rs
                  if r.get("first_done_s", 0) > r.get("warmup_s", math.inf)]
        if stalls:
            parts.append("First completion after the warm-up: " + "; ".join(stalls) + "\n")
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    return report_cli("python -m gpumesh_bench.gpu.prefix.report", __doc__, argv,
                      lambda records, _meta, from_round: prefix_markdown(records, from_round))


if __name__ == "__main__":
    sys.exit(main())
