"""The simulator's SMG reference against the real SMG gateway, on the same trace.

``python -m gpumesh_bench.sim.smg_check LIVE_DIR... [--seeds 3] [--out ROWS.json]``

Input: output folders of ``gpumesh bench prefix ... --model DIR --smg NAME=cache_aware``
(``prefix.json``): the live simulated fleet (real node processes with gRPC, heartbeats and KV
event streams, engines slowed ``time_scale`` T times) behind real SMG 1.13.0 gateways and
gpumesh routers, on the multi-tenant shared-prefix workload. For every live run (one door at
one load) the same requests are rebuilt — the run's ``TenantSpec`` (its seed is the bench's
``--seed`` plus the load's position), tokenized with DIR's tokenizer as every live path was,
hashed into the nodes' 16-token blocks — and replayed in the simulator on the same fleet: the
live nodes' ``SimEngineConfig`` (the bench's 7B step model, KV, limits; the load-rate window
of 5 s wall = 5/T simulated), heartbeats every 0.25 s wall (0.25/T simulated), no network
delay. An SMG door replays under ``smg_cache_aware`` (``smg_policy``, its wall-clock pacing
scaled by T: ``SmgConfig.for_time_scale``), a gpumesh setup under its router settings. Both
sides count the requests arriving after the bench's ``--warmup``; TTFT in simulated seconds
(live: wall / T). Each live run is replayed over ``--seeds`` seeds of the simulator's own
randomness (the trace is fixed).

Output: one row per live run — live and simulated p50 / p90 TTFT, their ratio, and for SMG the
simulated decisions by branch (hit, spill, miss) beside the live gateway's own counters — and
one per (door, load) with every run's counted requests pooled; ``--out`` writes the rows as
JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpumesh.kvblocks import block_hashes
from gpumesh.node.engines.sim import SimEngineConfig
from gpumesh_bench.locality.live import SHAPE_7B, _model_sim
from gpumesh_bench.sim.core import Simulation
from gpumesh_bench.sim.fleets import FleetSpec, NodeSpec
from gpumesh_bench.sim.smg_policy import SmgConfig
from gpumesh_bench.sim.workloads import Arrival, Workload
from gpumesh_bench.stats import percentile
from gpumesh_bench.tenants import TenantSpec, trace

#: gpumesh setups of the prefix bench the simulator replays: (policy, prefix_locality)
ROUTER_SETUPS = {"least_request": ("least_request", "off"),
                 "wll": ("predicted_latency", "off"),
                 "approximate": ("predicted_latency", "approximate"),
                 "precise": ("predicted_latency", "precise")}


def live_fleet(args: dict[str, Any], locality: str = "off") -> FleetSpec:
    """The prefix bench's nodes (``prefix_bench.main``) as a simulator fleet."""
    ts = float(args["time_scale"])
    eng = SimEngineConfig(**{**SHAPE_7B, **_model_sim(args["model"]), "model_name": "sim-model",
                             "kv_capacity_tokens": int(args["kv_tokens"]), "time_scale": 0.0,
                             "rate_window_s": 5.0 / ts})
    nodes = tuple(NodeSpec(f"n{i:02d}", replace(eng, seed=i), 1.0)
                  for i in range(int(args["nodes"])))
    return FleetSpec(f"prefix-{len(nodes)}x7b", nodes, heartbeat_interval_s=0.25 / ts,
                     network_delay_s=0.0,
                     router={"prefix_locality": locality, "affinity_max_keys": 0})


def rebuild(doc: dict[str, Any], k: int, tokenizer: Any) -> Workload:
    """The requests of the bench's ``k``-th load (``prefix_bench.main``), as the nodes saw
    them: token counts and 16-token block hashes of the model's tokenization."""
    a = doc["args"]
    load = float([x for x in str(a["loads"]).split(",") if x][k])
    spec = TenantSpec(tenants=int(a["tenants"]), rate=load * doc["nominal_capacity_req_per_s"],
                      seed=int(a["seed"]) + k, unique=bool(a["unique"]))
    out = []
    for r in trace(spec, float(a["duration"])):
        ids = tokenizer.encode(r.prompt).ids
        out.append(Arrival(r.index, r.arrival_s, len(ids), r.max_tokens,
                           tuple(block_hashes(ids)), r.conversation))
    return Workload(f"tenants-load{load:g}-seed{spec.seed}", out, [])


def _ttft(res: Any, warmup_s: float) -> list[float]:
    return [x.ttft_s for x in res.records if not x.error and x.arrival_s >= warmup_s]


def replay(doc: dict[str, Any], seeds: Sequence[int], front_end_s: float = 0.0,
           loads: Sequence[float] = ()) -> list[dict[str, Any]]:
    """One row per live run of ``doc`` (module docstring), at ``loads`` (all when empty);
    ``front_end_s``: the SMG reference's per-request gateway time (simulated seconds)."""
    from tokenizers import Tokenizer

    a = doc["args"]
    tok = Tokenizer.from_file(str(Path(a["model"]) / "tokenizer.json"))
    ts = float(a["time_scale"])
    setups = [s for s in str(a["setups"]).split(",") if s]
    smg = {x.split("=", 1)[0]: x.split("=", 1)[1] for x in str(a["smg"]).split(",") if x}
    doors = setups + list(smg)
    rows = []
    traces: dict[int, Workload] = {}
    for i, run in enumerate(doc["runs"]):
        k = i // len(doors)
        door = run["setup"]
        if loads and run["load"] not in loads:
            continue
        if door in smg:
            if smg[door] != "cache_aware":
                continue
            policy, fleet = "smg_cache_aware", live_fleet(a)
        elif door in ROUTER_SETUPS:
            policy, locality = ROUTER_SETUPS[door]
            fleet = live_fleet(a, locality)
        else:
            continue
        w = traces.get(k) or rebuild(doc, k, tok)
        traces[k] = w
        cfg = replace(SmgConfig().for_time_scale(ts), front_end_s=front_end_s)
        sim, branches = [], []
        for s in seeds:
            one = Simulation(fleet, w, policy, s, smg=cfg)
            sim.append(_ttft(one.run(), float(a["warmup"])))
            gw = one.routers[0].smg
            branches.append(dict(gw.branches) if gw is not None else {})
        live = run.get("ttft_all_s", [])
        rows.append({"door": door, "policy": policy, "load": run["load"], "trace": w.name,
                     "front_end_s": front_end_s if policy == "smg_cache_aware" else 0.0,
                     "live_requests": run["ok"], "sim_requests": len(sim[0]),
                     "live_ttft_s": live, "sim_branches": branches,
                     "live_smg_counters": (doc.get("smg", {}).get(door, {})
                                           .get("kv_metrics", {}) if door in smg else {}),
                     "sim_ttft_s": [sorted(x) for x in sim], "_sim_order": sim,
                     **_stats(live, sim)})
    return rows


def front_end(rows: list[dict[str, Any]]) -> float:
    """The SMG gateway's own time per request the simulator lacks: over the SMG rows
    (replayed with ``front_end_s`` 0), the median of live minus simulated TTFT, request by
    request (both lists are in arrival order; medians of each when their counts differ)."""
    diffs: list[float] = []
    for r in rows:
        if r["policy"] != "smg_cache_aware":
            continue
        live = r["live_ttft_s"]
        for sim in r["_sim_order"]:
            if len(sim) == len(live):
                diffs += [a - b for a, b in zip(live, sim, strict=True)]
            else:
                diffs.append(statistics.median(live) - statistics.median(sim))
    if not diffs:
        raise ValueError("no SMG run at that load to measure the gateway's time from")
    return statistics.median(diffs)


def _stats(live: list[float], sim: list[list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for q in (50, 90):
        lv = percentile(live, q) if live else float("nan")
        per = [percentile(x, q) for x in sim if x]
        sm = statistics.fmean(per) if per else float("nan")
        out[f"p{q}"] = {"live": lv, "sim": sm, "sim_seeds": per,
                        "ratio": sm / lv if lv else float("nan")}
    return out


def pooled(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (door, load): every run's counted requests pooled, live and simulated."""
    out: dict[tuple[str, float], dict[str, Any]] = {}
    for r in rows:
        c = out.setdefault((r["door"], r["load"]), {"door": r["door"], "load": r["load"],
                                                    "runs": 0, "live": [], "sim": None})
        c["runs"] += 1
        c["live"] += r["live_ttft_s"]
        c["sim"] = ([x + y for x, y in zip(c["sim"], r["sim_ttft_s"], strict=True)]
                    if c["sim"] else [list(x) for x in r["sim_ttft_s"]])
    res = []
    for c in out.values():
        res.append({"door": c["door"], "load": c["load"], "runs": c["runs"],
                    "live_requests": len(c["live"]), **_stats(c["live"], c["sim"])})
    return res


def _fmt_branches(b: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(b.items())) or "–"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| door | load | trace | requests live / sim | p50 TTFT live / sim (s) | "
             "p90 TTFT live / sim (s) | p90 sim ÷ live |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['door']} | {r['load']:g} | {r['trace']} | {r['live_requests']} / "
                     f"{r['sim_requests']} | {r['p50']['live']:.3f} / {r['p50']['sim']:.3f} | "
                     f"{r['p90']['live']:.3f} / {r['p90']['sim']:.3f} "
                     f"[{', '.join(f'{x:.3f}' for x in r['p90']['sim_seeds'])}] | "
                     f"{r['p90']['ratio']:.2f} |")
    lines += ["", "| trace | SMG decisions, live gateway | simulated (first seed) |", "|---|---|---|"]
    for r in rows:
        if r["policy"] == "smg_cache_aware":
            live = {k.split('"')[1]: int(v) for k, v in r["live_smg_counters"].items()
                    if k.startswith("smg_cache_aware_policy_branch") and '"' in k}
            lines.append(f"| {r['trace']} | {_fmt_branches(live)} | "
                         f"{_fmt_branches(r['sim_branches'][0])} |")
    lines += ["", "| door | load | runs | requests (live) | p50 TTFT live / sim (s) | "
              "p90 TTFT live / sim (s) | p90 sim ÷ live |", "|---|---|---|---|---|---|---|"]
    for c in pooled(rows):
        lines.append(f"| {c['door']} | {c['load']:g} | {c['runs']} | {c['live_requests']} | "
                     f"{c['p50']['live']:.3f} / {c['p50']['sim']:.3f} | "
                     f"{c['p90']['live']:.3f} / {c['p90']['sim']:.3f} | "
                     f"{c['p90']['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpumesh_bench.sim.smg_check",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("live", nargs="+", help="gpumesh bench prefix output folders")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--front-end-from", type=float, default=None, metavar="LOAD",
                   help="measure the SMG gateway's own per-request time on the runs at LOAD "
                        "(front_end), then replay the other loads with it")
    p.add_argument("--front-end-s", type=float, default=0.0,
                   help="the SMG reference's per-request gateway time, simulated seconds")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    docs = [json.loads((Path(d) / "prefix.json").read_text(encoding="utf-8")) for d in a.live]
    seeds = range(1, a.seeds + 1)
    fe, calib = a.front_end_s, []
    if a.front_end_from is not None:
        calib = [r for doc in docs for r in replay(doc, seeds, 0.0, [a.front_end_from])]
        fe = front_end(calib)
        sys.stdout.write(f"SMG gateway time per request, measured at load "
                         f"{a.front_end_from:g}: {fe * 1000:.2f} ms (simulated)\n\n")
    rows = [r for doc in docs for r in replay(doc, seeds, fe)
            if a.front_end_from is None or r["load"] != a.front_end_from]
    sys.stdout.write(markdown(rows) + "\n")
    if a.out:
        for r in calib + rows:
            r.pop("_sim_order", None)
        Path(a.out).write_text(json.dumps({"front_end_s": fe, "calibration_rows": calib,
                                           "rows": rows, "pooled": pooled(rows)}) + "\n",
                               encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
