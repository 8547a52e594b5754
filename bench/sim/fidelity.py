"""The simulator's side of the fidelity check and the comparison with the live fleet.

``sim_fleet`` mirrors the live fleet: one simulated node per live engine, with the node ids,
the scheduler limits (max_num_seqs, max_num_batched_tokens), the KV capacity and block size,
the context length and the heartbeat interval of the live nodes, and the step model of an
engine profile (``step_a_ms``, ``step_b_decode_ms``, ``step_c_decode_ms``,
``step_b_prefill_ms`` and the attention terms ``step_b_decode_context_ms``,
``step_c_prefill_ms`` where the profile has them; ``front_end_ms``: the node's fixed time per
request, split into the two one-way message delays; the serving path's CPU costs
``SERVING_KEYS`` where the profile has them: the router and each node's front end as queues,
``serving.py``, and the fixed time then less what the front end's work of a lone request
already accounts for). ``simulate_side`` replays the trace through the simulator with
the router's real code (``core.Simulation``) for a few seeds (the seeds change the
simulator's own random draws, e.g. power_of_two's sampling, not the trace).

``summarize`` turns either side's per-request outcomes into the compared metrics: TTFT
p50/p90/p99 and end-to-end p50/p99 (ms), every node's share of the requests, over the
requests after the first ``WARMUP`` fraction of the trace (the same indexes on both sides);
``compare`` sets them side by side with error = sim / live - 1, and checks per workload and
metric whether the simulator orders the policies as the live fleet does: every pair of
policies whose live values differ by more than ``TIE`` (5 %) must come in the same order in
the simulator (a pair the live fleet does not tell apart asks nothing of it; the strict
order of all policies is reported beside it).

``load_profile`` reads an engine profile for the simulator side, ``profile_toml`` writes a
fitted step model in the profile format, ``merge`` folds several ``gpumesh sim validate``
results into one comparison.
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpumesh.node.engines.sim import SimEngineConfig
from gpumesh_bench.sim.core import Simulation
from gpumesh_bench.sim.fleets import FleetSpec, NodeSpec
from gpumesh_bench.sim.serving import ServingCosts
from gpumesh_bench.sim.workloads import Workload
from gpumesh_bench.stats import percentile

WARMUP = 0.05
METRICS = ("ttft_p50", "ttft_p90", "ttft_p99", "e2e_p50", "e2e_p99")
BANDED = ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")   # the +-25 % band applies to these
BAND = 0.25
TIE = 0.05   # two live values closer than this are a tie: no order to reproduce
STEP_KEYS = ("step_a_ms", "step_b_decode_ms", "step_c_decode_ms", "step_b_prefill_ms",
             "step_b_decode_context_ms", "step_c_prefill_ms")
# profile dict key -> ServingCosts field (the serving path's CPU work, ms)
SERVING_KEYS = {"front_end_cpu_request_ms": "node_request_ms",
                "front_end_cpu_output_ms": "node_output_ms",
                "front_end_cpu_message_ms": "node_message_ms",
                "front_end_cpu_prompt_token_ms": "node_prompt_token_ms",
                "router_cpu_request_ms": "router_request_ms",
                "router_cpu_message_ms": "router_message_ms",
                "router_cpu_prompt_token_ms": "router_prompt_token_ms"}


def serving_costs(profile: dict[str, Any]) -> ServingCosts | None:
    """The profile's serving-path costs, or None where it has none (every one 0)."""
    costs = ServingCosts(**{f: float(profile.get(k, 0.0)) for k, f in SERVING_KEYS.items()})
    return costs if costs.enabled else None


def sim_fleet(node_ids: Sequence[str], profile: dict[str, Any], *, max_num_seqs: int,
              max_num_batched_tokens: int, kv_capacity_tokens: int, max_context_length: int,
              heartbeat_s: float = 0.25, kv_block_size: int = 16) -> FleetSpec:
    """The live fleet as a simulator fleet (module docstring)."""
    steps = {k: float(profile[k]) for k in STEP_KEYS if k in profile}
    serving = serving_costs(profile)
    eng = SimEngineConfig.for_shape(
        "0.5b", **steps, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        kv_capacity_tokens=kv_capacity_tokens, kv_block_size=kv_block_size,
        max_context_length=max_context_length, time_scale=1.0, prefix_caching=True,
        front_end_tokens_per_s=float(profile.get("front_end_tokens_per_s", 0.0)))
    nodes = tuple(NodeSpec(n, eng, 1.0) for n in node_ids)
    fixed_ms = float(profile.get("front_end_ms", 0.0))
    if serving is not None:
        # livecal's fixed time is the intercept of TTFT over prompt length (0 tokens)
        fixed_ms = max(fixed_ms - serving.lone_request_ms(), 0.0)
    return FleetSpec("live-mirror", nodes, 1, heartbeat_s, fixed_ms / 2000.0, serving=serving)


def summarize(indexes: Sequence[int], ttft_s: Sequence[float], e2e_s: Sequence[float],
              node_ids: Sequence[str], n_trace: int, nodes: Sequence[str]) -> dict[str, Any]:
    """Metrics over the successful requests after the warm-up (module docstring)."""
    skip = int(n_trace * WARMUP)
    keep = [k for k, i in enumerate(indexes) if i >= skip]
    tt = [1000 * ttft_s[k] for k in keep]
    ee = [1000 * e2e_s[k] for k in keep]
    share = Counter(node_ids[k] for k in keep)
    return {"requests": len(keep),
            "ttft_p50": percentile(tt, 50), "ttft_p90": percentile(tt, 90),
            "ttft_p99": percentile(tt, 99), "e2e_p50": percentile(ee, 50),
            "e2e_p99": percentile(ee, 99),
            "share": {n: share.get(n, 0) / max(len(keep), 1) for n in nodes}}


def simulate_side(fleet: FleetSpec, w: Workload, policy: str,
                  seeds: Sequence[int] = (1, 2, 3)) -> dict[str, Any]:
    """The simulator's metrics for ``policy`` on trace ``w``: each metric's mean over
    ``seeds`` (and its range), the mean share, the prefix hit rate (cached prompt tokens over
    prompt tokens looked up, every request) and the engines' busy fraction."""
    nodes = [n.node_id for n in fleet.nodes]
    runs = []
    for s in seeds:
        sim = Simulation(fleet, w, policy, s)
        res = sim.run()
        ok = [r for r in res.records if not r.error]
        m = summarize([r.index for r in ok], [r.ttft_s for r in ok], [r.e2e_s for r in ok],
                      [r.node_id for r in ok], len(w.arrivals), nodes)
        q = sum(n.sched.prefix.query_tokens for n in sim.nodes.values() if n.sched.prefix)
        h = sum(n.sched.prefix.hit_tokens for n in sim.nodes.values() if n.sched.prefix)
        m["prefix_hit"] = h / q if q else 0.0
        m["busy"] = statistics.fmean(n.sched.stats.busy_s / max(res.sim_s, 1e-9)
                                     for n in sim.nodes.values())
        m["errors"] = len(res.records) - len(ok)
        path = sim.path   # the serving path's servers: busy fraction (cores) of each kind
        m["front_end_busy"] = (statistics.fmean(f.server.busy_s for f in path.fronts.values())
                               / max(res.sim_s, 1e-9) if path is not None else 0.0)
        m["router_busy"] = (statistics.fmean(r.busy_s for r in path.routers)
                            / max(res.sim_s, 1e-9) if path is not None else 0.0)
        runs.append(m)
    out: dict[str, Any] = {"seeds": list(seeds)}
    for k in (*METRICS, "prefix_hit", "busy", "front_end_busy", "router_busy", "requests",
              "errors"):
        vals = [r[k] for r in runs]
        out[k] = statistics.fmean(vals)
        out[k + "_range"] = [min(vals), max(vals)]
    out["share"] = {n: statistics.fmean(r["share"][n] for r in runs) for n in nodes}
    return out


def _err(sim: float, live: float) -> float:
    return sim / live - 1.0 if live and not math.isnan(live) else math.nan


def compare(live: dict[str, dict[str, dict[str, Any]]],
            sim: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """``live[workload][policy]`` and ``sim[workload][policy]`` metric dicts -> rows with
    errors, the band verdict per (workload, policy) cell and the ranking per (workload,
    metric) cell."""
    rows, rankings = [], []
    for wk, pols in live.items():
        for pol, lv in pols.items():
            sv = sim[wk][pol]
            row: dict[str, Any] = {"workload": wk, "policy": pol}
            for m in (*METRICS, "prefix_hit"):
                row[m] = {"live": lv[m], "sim": sv[m], "err": _err(sv[m], lv[m])}
            row["share"] = {n: {"live": lv["share"].get(n, 0.0), "sim": sv["share"].get(n, 0.0)}
                            for n in sorted(set(lv["share"]) | set(sv["share"]))}
            row["within_band"] = all(abs(row[m]["err"]) <= BAND for m in BANDED)
            row["worst"] = max(BANDED, key=lambda m: abs(row[m]["err"]))
            rows.append(row)
        for m in METRICS:
            lo = sorted(pols, key=lambda p: pols[p][m])
            so = sorted(pols, key=lambda p: sim[wk][p][m])
            # every pair the live fleet tells apart (by more than TIE) in the same order
            pairs = [(x, y) for i, x in enumerate(lo) for y in lo[i + 1:]
                     if pols[y][m] > pols[x][m] * (1 + TIE)]
            same = all(sim[wk][x][m] < sim[wk][y][m] for x, y in pairs)
            rankings.append({"workload": wk, "metric": m, "live": lo, "sim": so,
                             "live_distinct_pairs": len(pairs), "same": same,
                             "same_strict": lo == so})
    within = sum(r["within_band"] for r in rows)
    same = sum(r["same"] for r in rankings)
    return {"rows": rows, "rankings": rankings, "band": BAND,
            "cells_within_band": within, "cells": len(rows),
            "rankings_same": same, "ranking_cells": len(rankings)}


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:+.0f} %"


def markdown(doc: dict[str, Any]) -> str:
    """The fidelity tables: one row per (workload, policy), then the rankings."""
    c = doc["comparison"]
    lines = ["| workload | policy | TTFT p50 ms live / sim (err) | TTFT p90 | TTFT p99 | "
             "e2e p50 | e2e p99 | prefix hit live / sim | share live / sim | within "
             f"{100 * c['band']:.0f} % |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in c["rows"]:
        cells = [f"{r[m]['live']:.0f} / {r[m]['sim']:.0f} ({_pct(r[m]['err'])})"
                 for m in METRICS]
        share = ", ".join(f"{n} {v['live']:.2f}/{v['sim']:.2f}" for n, v in r["share"].items())
        hit = f"{r['prefix_hit']['live']:.2f} / {r['prefix_hit']['sim']:.2f}"
        lines.append(f"| {r['workload']} | {r['policy']} | " + " | ".join(cells)
                     + f" | {hit} | {share} | {'yes' if r['within_band'] else 'no'} |")
    lines += ["", "| workload | metric | live order (best first) | sim order | live pairs "
              f"> {100 * TIE:.0f} % apart | same order on them | same strict order |",
              "|---|---|---|---|---|---|---|"]
    for k in c["rankings"]:
        lines.append(f"| {k['workload']} | {k['metric']} | {' < '.join(k['live'])} | "
                     f"{' < '.join(k['sim'])} | {k['live_distinct_pairs']} | "
                     f"{'yes' if k['same'] else 'no'} | {'yes' if k['same_strict'] else 'no'} |")
    lines += ["", f"Cells within the band: {c['cells_within_band']} of {c['cells']}; "
              f"same ranking: {c['rankings_same']} of {c['ranking_cells']}."]
    return "\n".join(lines) + "\n"


def load_profile(name_or_path: str) -> dict[str, Any]:
    """The simulator's step model from an engine profile (``gpumesh.profiles``): a TOML file
    (the one ``gpumesh calibrate`` writes) or a built-in profile's name (``tiny-cpu``)."""
    from gpumesh import profiles

    if Path(name_or_path).exists():
        p = profiles.load_profile(name_or_path)
    else:
        p = profiles.builtin_profile(name_or_path)
    return {"step_a_ms": p.a_ms, "step_b_decode_ms": p.b_decode_ms,
            "step_c_decode_ms": p.c_decode_ms, "step_b_prefill_ms": p.b_prefill_ms,
            "step_b_decode_context_ms": p.b_decode_context_ms,
            "step_c_prefill_ms": p.c_prefill_ms,
            "front_end_tokens_per_s": p.front_end_tokens_per_s,
            "front_end_ms": p.request_overhead_ms,
            "front_end_cpu_request_ms": p.front_end_cpu_request_ms,
            "front_end_cpu_output_ms": p.front_end_cpu_output_ms,
            "front_end_cpu_message_ms": p.front_end_cpu_message_ms,
            "router_cpu_request_ms": p.router_cpu_request_ms,
            "router_cpu_message_ms": p.router_cpu_message_ms,
            "front_end_cpu_prompt_token_ms": p.front_end_cpu_prompt_token_ms,
            "router_cpu_prompt_token_ms": p.router_cpu_prompt_token_ms,
            "source": f"profile {name_or_path}"}


def profile_toml(p: dict[str, Any], live: dict[str, Any]) -> str:
    """The fitted step model as an engine profile TOML (the ``load_profile`` format), so
    that later runs (``--profile``) simulate with the same one."""
    return "\n".join([
        'format = "gpumesh.engine-profile/1"', "[engine]", 'name = "live-fit"',
        f'source = "{p.get("source", "")}"', "[scheduler]",
        f"max_num_seqs = {live.get('max_num_seqs', 0)}",
        f"max_num_batched_tokens = {live.get('max_num_batched_tokens', 0)}", "[kv]",
        f"capacity_tokens = {live.get('kv_capacity_tokens', 0)}", "block_size = 16", "[step]",
        f"a_ms = {p['step_a_ms']!r}", f"b_decode_ms = {p['step_b_decode_ms']!r}",
        f"c_decode_ms = {p.get('step_c_decode_ms', 0.0)!r}",
        f"b_prefill_ms = {p['step_b_prefill_ms']!r}", "[front_end]",
        f"tokens_per_s = {p.get('front_end_tokens_per_s', 0.0)!r}",
        f"request_overhead_ms = {p.get('front_end_ms', 0.0)!r}",
        *[f"{k.removeprefix('front_end_')} = {float(p.get(k, 0.0))!r}" for k in SERVING_KEYS
          if k.startswith("front_end_")], "[router]",
        *[f"{k.removeprefix('router_')} = {float(p.get(k, 0.0))!r}" for k in SERVING_KEYS
          if k.startswith("router_")]]) + "\n"


def read_doc(path: str | Path) -> dict[str, Any]:
    """A validate.json document, plain or gzipped (``.gz``: how results are kept in the
    repository)."""
    raw = Path(path).read_bytes()
    if str(path).endswith(".gz"):
        raw = gzip.decompress(raw)
    return json.loads(raw.decode("utf-8"))


def merge(files: list[str], profile: dict[str, Any] | None = None,
          sim_seeds: int = 3, step_scale: float = 1.0,
          serving: dict[str, float] | None = None,
          policies: Sequence[str] = ()) -> dict[str, Any]:
    """One document from several validate.json files (e.g. one policy each, each calibrated
    in its own run): their live runs (a later file's (workload, policy) replaces an earlier
    one's), and the simulator re-run on every trace with ONE profile: ``profile``, else each
    step-model term's median over the files' fits; its step terms times ``step_scale``;
    ``serving`` (``SERVING_KEYS``) replaces its serving-path costs. ``policies``: only those
    policies' live runs (default every one)."""
    from gpumesh_bench.sim import fidelity_trace as ft

    docs = [read_doc(f) for f in files]
    if profile is None:
        keys = (*STEP_KEYS, "front_end_ms", "front_end_tokens_per_s", *SERVING_KEYS)
        profile = {k: statistics.median(float(d["profile"].get(k, 0.0)) for d in docs)
                   for k in keys}
        profile["source"] = f"median of {len(docs)} fits on the live engines"
    if serving is not None:
        profile = {**profile, **{k: float(serving.get(k, 0.0)) for k in SERVING_KEYS}}
    if step_scale != 1.0:
        profile = {**profile, "step_scale": step_scale,
                   **{k: float(profile.get(k, 0.0)) * step_scale for k in STEP_KEYS}}
    live, tr = docs[0]["live"], docs[0]["trace"]
    out: dict[str, Any] = {"command": " ; ".join(d["command"] for d in docs),
                           "merged": list(files), "live": live, "trace": tr,
                           "profile": profile, "workloads": {}, "live_runs": {},
                           "sim_runs": {}, "parts": [{"command": d["command"],
                                                       "profile": d["profile"],
                                                       "live": d["live"]} for d in docs]}
    for d in docs:
        out["workloads"].update(d["workloads"])
        for wk, pols in d["live_runs"].items():
            out["live_runs"].setdefault(wk, {}).update(
                {p: v for p, v in pols.items() if not policies or p in policies})
    sfleet = sim_fleet(
        tuple(live["node_engines"]), profile, max_num_seqs=live["max_num_seqs"],
        max_num_batched_tokens=live["max_num_batched_tokens"],
        kv_capacity_tokens=min(live["kv_capacity_tokens"], 1 << 24),
        max_context_length=live["max_model_len"])
    for wk, pols in out["live_runs"].items():
        info = out["workloads"][wk]
        w = ft.build(wk, info["requests"], info["rate"], tr["seed"], tr["tenants"],
                     tr["system_tokens"])
        out["sim_runs"][wk] = {p: simulate_side(sfleet, w, p,
                                                         tuple(range(1, sim_seeds + 1)))
                               for p in pols}
    out["comparison"] = compare(out["live_runs"], out["sim_runs"])
    return out
