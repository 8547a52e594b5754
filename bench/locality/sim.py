"""``gpumesh bench prefix-sim``: cache-aware routing in the virtual-time simulator.

The multi-tenant shared-prefix workload (``gpumesh_bench.tenants``: ``--tenants`` tenants
with ~4,000-token system prompts, growing multi-turn conversations; ``--unique`` the control
without shared prefixes) is tokenized with the simulator's tokenizer and hashed into 16-token
blocks (``gpumesh.kvblocks``), exactly what a live simulated node and the router compute, and
replayed in ``gpumesh sim``'s discrete-event simulator (``gpumesh_bench.sim.core``: the
router's real Registry / AdmissionQueue / profiles / prefix index, the simulated engine's real
scheduler and prefix cache, heartbeats and KV events with network delay).

Fleet: ``--nodes`` nodes of the ``7b-h200`` shape with ``--kv-tokens`` of KV each (about a
quarter of all tenants' system prompts), one router. Every request carries its
conversation's id as its routing key, as a live client's would. Setups (as
``gpumesh bench prefix`` defines them): ``least_request``; ``wll`` (predicted_latency,
``prefix_locality = off``, no routing-key table); ``approximate`` and ``precise`` (the
locality mode, no routing-key table); ``affinity`` (predicted_latency,
``prefix_locality = off``, the routing key's last node as an expected hit);
``precise_affinity`` (both: what a router with precise locality does with clients that send
routing keys, the routing-key table on).

Load is relative to the capacity of ``least_request`` on this workload: a closed-loop
saturation run (``gpumesh_bench.sim.grid.capacity``'s method: completions per second between
the 20th and 80th percentile of completions). A run starts as a service that has been serving
its tenants: the first ``--warm-fraction`` of its requests arrive at ``--warm-load`` (the
caches fill), the rest at the load measured; metrics are over the requests after the warm
phase. ``--warm-fraction 0`` starts cold at the full rate. For each load and seed one trace
is replayed under every setup (paired). Throughput at SLO: the highest load whose p90 TTFT
stays within ``--slo-ttft-ms`` (mean over seeds), as completed requests per second.

``--router KEY=VALUE`` sets a router setting (a ``RouterConfig`` field) for every setup.

Results: OUT/prefix-sim.json and OUT/prefix-sim.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpumesh.kvblocks import block_hashes
from gpumesh.node.engines.sim import SimEngineConfig
from gpumesh.node.engines.sim.text import SimTokenizer
from gpumesh_bench.sim.core import simulate
from gpumesh_bench.sim.fleets import FleetSpec, NodeSpec, router_settings
from gpumesh_bench.sim.metrics import SLOSpec, run_metrics
from gpumesh_bench.sim.workloads import Arrival, Workload
from gpumesh_bench.tenants import TenantSpec, iter_tenant_requests

# name -> (policy, prefix_locality, routing-key table on)
SETUPS: dict[str, tuple[str, str, float]] = {
    "least_request": ("least_request", "off", 0.0),
    "wll": ("predicted_latency", "off", 0.0),
    "approximate": ("predicted_latency", "approximate", 0.0),
    "precise": ("predicted_latency", "precise", 0.0),
    "affinity": ("predicted_latency", "off", 1.0),
    "precise_affinity": ("predicted_latency", "precise", 1.0),
}


def fleet(nodes: int, kv_tokens: int, locality: str, affinity_weight: float = 0.0
          ) -> FleetSpec:
    eng = SimEngineConfig.for_shape("7b-h200", model_name="sim-model", time_scale=0.0,
                                    kv_capacity_tokens=kv_tokens, max_context_length=8192,
                                    max_num_seqs=64)
    return FleetSpec(f"tenants-{nodes}x7b", tuple(NodeSpec(f"n{i:02d}", replace(eng, seed=i), 1.0)
                                                  for i in range(nodes)),
                     router={"prefix_locality": locality,
                             "affinity_max_keys": 100_000 if affinity_weight else 0})


def arrivals(spec: TenantSpec, n: int, warm: int = 0, warm_rate: float = 0.0
             ) -> list[Arrival]:
    """``n`` requests of the tenant workload, tokenized and hashed as the engine does, each
    with its conversation's id as routing key; the first ``warm`` of them at ``warm_rate``
    (Poisson), the others at ``spec.rate``."""
    tok = SimTokenizer()
    gaps = random.Random(spec.seed ^ 0xA11)
    out: list[Arrival] = []
    t = 0.0
    for r in iter_tenant_requests(spec):
        if len(out) >= n:
            break
        ids = tok.encode(r.prompt)
        if warm:
            if out:
                t += gaps.expovariate(warm_rate if len(out) < warm else spec.rate)
        else:
            t = r.arrival_s
        out.append(Arrival(r.index, t, len(ids), r.max_tokens, tuple(block_hashes(ids)),
                           r.conversation))
    return out


def capacity(nodes: int, kv_tokens: int, spec: TenantSpec, n: int) -> float:
    """least_request's saturation throughput on the workload (requests per second)."""
    f = fleet(nodes, kv_tokens, "off")
    conc = sum(x.engine.max_num_seqs for x in f.nodes)
    w = Workload("tenants", arrivals(replace(spec, rate=1.0), n), [])
    r = simulate(f, w, "least_request", 1000, closed_concurrency=conc)
    ends = sorted(x.end_s for x in r.records if not x.error)
    lo, hi = int(0.2 * len(ends)), int(0.8 * len(ends))
    return (hi - lo) / (ends[hi] - ends[lo])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench/locality/results/sim")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--tenants", type=int, default=64)
    p.add_argument("--kv-tokens", type=int, default=72_000)
    p.add_argument("--loads", default="0.5,0.8,1.2,1.6,2.0,2.5,3.0",
                   help="x least_request's capacity on the workload")
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--unique", action="store_true", help="the control: no shared prefixes")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--warm-fraction", type=float, default=0.25,
                   help="of each run's requests, arriving first at --warm-load")
    p.add_argument("--warm-load", type=float, default=0.5)
    p.add_argument("--router", action="append", default=[], metavar="KEY=VALUE",
                   help="a router setting (RouterConfig field) for every setup, e.g. "
                        "kv_hard_threshold=0.9; repeatable")


def main(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    setups = [s for s in a.setups.split(",") if s]
    loads = [float(x) for x in a.loads.split(",") if x]
    base = TenantSpec(tenants=a.tenants, unique=a.unique)
    overrides = router_settings(a.router)
    t0 = time.process_time()
    cap = capacity(a.nodes, a.kv_tokens, base, max(3000, a.requests))
    print(f"least_request capacity {cap:.1f} req/s ({time.process_time() - t0:.0f} s CPU)",
          flush=True)
    slo = SLOSpec(a.slo_ttft_ms, float("inf"))
    doc: dict[str, Any] = {"args": vars(a), "capacity_req_per_s": cap, "runs": []}
    for load in loads:
        for seed in range(1, a.seeds + 1):
            warm = int(a.warm_fraction * a.requests)
            w = Workload("tenants", arrivals(replace(base, rate=load * cap, seed=seed),
                                             a.requests, warm, a.warm_load * cap), [])
            for s in setups:
                policy, locality, affinity = SETUPS[s]
                t = time.process_time()
                res = simulate(fleet(a.nodes, a.kv_tokens, locality, affinity), w, policy, seed,
                               router_overrides=overrides)
                m = run_metrics(res, slo, warmup=max(0.2, a.warm_fraction + 0.05))
                m.update({"setup": s, "load": load, "seed": seed,
                          "cpu_s": time.process_time() - t})
                doc["runs"].append(m)
            line = "  ".join(f"{r['setup']} {r['ttft_p90']:.0f}" for r in doc["runs"]
                             if r["load"] == load and r["seed"] == seed)
            print(f"load {load:g} seed {seed}: p90 TTFT ms  {line}", flush=True)
        (out / "prefix-sim.json").write_text(json.dumps(doc), encoding="utf-8")
    md = markdown(doc, setups, loads)
    (out / "prefix-sim.md").write_text(md, encoding="utf-8")
    print(md)
    return 0


def _mean(doc: dict[str, Any], s: str, load: float, key: str) -> float:
    xs = [r[key] for r in doc["runs"] if r["setup"] == s and r["load"] == load]
    return statistics.fmean(xs) if xs else float("nan")


def _spread(doc: dict[str, Any], s: str, load: float, key: str) -> tuple[float, float]:
    xs = [r[key] for r in doc["runs"] if r["setup"] == s and r["load"] == load]
    return (min(xs), max(xs)) if xs else (float("nan"), float("nan"))


def markdown(doc: dict[str, Any], setups: list[str], loads: list[float]) -> str:
    a = doc["args"]
    lines = [f"least_request capacity: {doc['capacity_req_per_s']:.1f} req/s; "
             f"{a['seeds']} seeds x {a['requests']} requests per cell; TTFT in ms, mean over "
             "seeds [min-max]"
             + (f"; router settings: {', '.join(a.get('router') or [])}" if a.get("router")
                else ""), "",
             "| load | " + " | ".join(f"{s} p90 TTFT" for s in setups)
             + " | precise / least_request |", "|" + "---|" * (len(setups) + 2)]
    for ld in loads:
        cells = []
        for s in setups:
            lo, hi = _spread(doc, s, ld, "ttft_p90")
            cells.append(f"{_mean(doc, s, ld, 'ttft_p90'):.0f} [{lo:.0f}-{hi:.0f}]")
        ratio = (_mean(doc, "precise", ld, "ttft_p90") / _mean(doc, "least_request", ld, "ttft_p90")
                 if "precise" in setups and "least_request" in setups else float("nan"))
        lines.append(f"| {ld:g} | " + " | ".join(cells) + f" | {ratio:.3f} |")
    slo = a["slo_ttft_ms"]
    lines += ["", f"Throughput at SLO (p90 TTFT <= {slo:g} ms): completed req/s at the highest "
              "load that holds it", "", "| setup | req/s at SLO | x least_request |",
              "|---|---|---|"]
    best = {}
    for s in setups:
        ok = [ld for ld in loads if _mean(doc, s, ld, "ttft_p90") <= slo]
        best[s] = max((_mean(doc, s, ld, "throughput") for ld in ok), default=0.0)
    for s in setups:
        base = best.get("least_request") or float("nan")
        lines.append(f"| {s} | {best[s]:.1f} | {best[s] / base:.2f} |")
    return "\n".join(lines) + "\n"
