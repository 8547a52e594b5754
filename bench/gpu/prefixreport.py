"""Markdown of the ``prefix05`` records: per balancer, medians over rounds (spread beside the
main figures), each node's share and prefix-cache hit rate, and p90 TTFT paired round by
round against least_request and SMG cache_aware."""

from __future__ import annotations

import math
from typing import Any

from gpumesh_bench.gpu.doorsreport import _med, _ms, _spread


def _ratio(rs: list[dict[str, Any]], base: dict[int, dict[str, Any]]) -> list[float]:
    return [r["ttft_p90"] / base[r["round"]]["ttft_p90"] for r in rs
            if r["round"] in base and base[r["round"]].get("ttft_p90")
            and not math.isnan(base[r["round"]]["ttft_p90"])]


def prefix_table(recs: list[dict[str, Any]]) -> str:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        by.setdefault(r["prefix"], []).append(r)
    lr = {r["round"]: r for r in by.get("least_request", [])}
    smg = {r["round"]: r for r in by.get("smg", [])}
    nodes = sorted({n for r in recs for n in r.get("nodes", {})}
                   | {n for r in recs for n in r.get("node_share", {})} - {"?"})
    out = ["| balancer | TTFT p50 / p90 / p99 ms | p90 TTFT ms (spread) | latency p50 / p99 ms "
           "| completions/s | share " + " / ".join(nodes) + " | prefix hit rate "
           + " / ".join(nodes) + " | tenant on its main node | p90 TTFT ÷ least_request "
           "| p90 TTFT ÷ SMG | errors | rounds |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, rs in by.items():
        shares = []
        for r in rs:
            tot = sum(r.get("node_share", {}).values()) or 1
            shares.append([r.get("node_share", {}).get(n, 0) / tot for n in nodes])
        share = " / ".join(f"{_med([x[i] for x in shares]):.0%}" for i in range(len(nodes)))
        hit = " / ".join(
            f"{_med([r.get('nodes', {}).get(n, {}).get('prefix_hit_rate', math.nan) for r in rs]):.0%}"
            for n in nodes)
        out.append(
            f"| {rs[0]['balancer']} | {_ms(_med([r['ttft_p50'] for r in rs]))} / "
            f"{_ms(_med([r['ttft_p90'] for r in rs]))} / {_ms(_med([r['ttft_p99'] for r in rs]))} "
            f"| {_spread([r['ttft_p90'] * 1000 for r in rs], 0)} "
            f"| {_ms(_med([r['lat_p50'] for r in rs]))} / {_ms(_med([r['lat_p99'] for r in rs]))} "
            f"| {_spread([r['done_qps'] for r in rs])} | {share} | {hit} "
            f"| {_med([r.get('tenant_stickiness', math.nan) for r in rs]):.0%} "
            f"| {'—' if s == 'least_request' else _spread(_ratio(rs, lr), 2)} "
            f"| {'—' if s == 'smg' else _spread(_ratio(rs, smg), 2)} "
            f"| {sum(r.get('errors', 0) for r in rs)} of {sum(r.get('requests', 0) for r in rs)} "
            f"| {len(rs)} |")
    return "\n".join(out)


def prefix_markdown(records: list[dict[str, Any]]) -> str:
    """The cache-aware section of a results document ("" when it has none)."""
    recs = [r for r in records if "prefix" in r]
    if not recs:
        return ""
    parts = ["\n## Cache-aware routing\n"]
    for phase in sorted({r["phase"] for r in recs}):
        rs = [r for r in recs if r["phase"] == phase]
        w = rs[0].get("workload", {})
        parts.append(
            f"### {phase}: two 0.5B engines on one GPU, {w.get('tenants')} tenants x "
            f"{w.get('system_words')}-token system prompts, up to {w.get('max_turns')} turns, "
            f"{w.get('max_tokens')} output tokens, closed loop at concurrency "
            f"{rs[0]['concurrency']}; KV {w.get('kv_tokens')} tokens per node "
            f"(all system prompts: {w.get('system_prompt_tokens_all')})\n")
        parts.append(prefix_table(rs) + "\n")
        modes = sorted({r["smg_mode"] for r in rs if r.get("smg_mode")})
        if modes:
            parts.append("SMG cache state: " + "; ".join(modes) + "\n")
    return "\n".join(parts)
