"""Capacity measurement and the policy grid: fleets x workloads x loads x policies x seeds.

Capacity of a (fleet, workload): a closed-loop saturation run through ``least_request``
(a fixed baseline, so that a change to the default policy does not move the load levels;
``max_num_seqs`` requests outstanding per node, so every node has a
full batch and a queue), completions per simulated second between the 20th and the 80th
percentile of completion times (ramp-up and drain left out). The ``large`` fleet is 128
copies of ``hetero-speed``'s mix, so its capacity is taken as 128 x that one's.

A cell (fleet, workload, load): for each seed one trace at load x capacity, run under every
policy (the same requests and arrival times for all: paired), ``metrics.run_metrics`` per run,
aggregated over seeds. Results are written cell by cell to ``OUT/grid.jsonl`` (one JSON
record per cell, with every seed's metrics), so an interrupted grid keeps what it finished.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpumesh_bench.sim import fleets as fleets_mod
from gpumesh_bench.sim import workloads as wl
from gpumesh_bench.sim.core import simulate
from gpumesh_bench.sim.metrics import SLOSpec, aggregate, run_metrics

POLICIES = ("weighted_least_load", "least_request", "power_of_two", "round_robin")


def capacity(fleet: fleets_mod.FleetSpec, workload: str, seed: int = 1000,
             router: dict[str, Any] | None = None) -> float:
    """Completions per simulated second at saturation (module docstring)."""
    if fleet.name == "large":
        return 128 * capacity(fleets_mod.builtin("hetero-speed"), workload, seed, router)
    conc = sum(n.engine.max_num_seqs for n in fleet.nodes)
    n = max(3000, 4 * conc)
    w = wl.build(workload, n, 1.0, seed, [x.node_id for x in fleet.nodes], fleet.fastest)
    w = wl.Workload(w.name, w.arrivals, [])   # capacity of the unchanged fleet
    r = simulate(fleet, w, "least_request", seed, closed_concurrency=conc,
                 router_overrides=router)
    ends = sorted(x.end_s for x in r.records if not x.error)
    lo, hi = int(0.2 * len(ends)), int(0.8 * len(ends))
    return (hi - lo) / (ends[hi] - ends[lo])


def run_cell(fleet: fleets_mod.FleetSpec, workload: str, rate: float, policies: Iterable[str],
             seeds: Iterable[int], n: int, slo: SLOSpec,
             router: dict[str, Any] | None = None,
             trace: wl.Workload | None = None) -> dict[str, Any]:
    """Every policy on the same per-seed traces; returns per-policy per-seed metrics and
    their aggregates, plus the CPU seconds of one run (the first)."""
    per: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    cpu: list[float] = []
    for seed in seeds:
        if trace is not None:
            w = trace
        else:
            w = wl.build(workload, n, rate, seed, [x.node_id for x in fleet.nodes],
                         fleet.fastest)
        for p in per:
            t = time.process_time()
            res = simulate(fleet, w, p, seed, router_overrides=router)
            cpu.append(time.process_time() - t)
            per[p].append(run_metrics(res, slo))
    return {"runs": per, "agg": {p: aggregate(v) for p, v in per.items()},
            "cpu_s_per_run": cpu}


def grid(fleet_names: list[str], workloads: list[str], loads: list[float],
         policies: list[str], seeds: list[int], n: int, slo: SLOSpec, out: Path,
         log: Any = print) -> Path:
    """Runs the grid cell by cell, appending to ``out/grid.jsonl``; returns that path.
    Cells already in the file (same fleet, workload, load, requests, seeds) are skipped."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "grid.jsonl"
    done = set()
    caps: dict[str, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            c = json.loads(line)
            done.add((c["fleet"], c["workload"], c["load"], c["requests"], tuple(c["seeds"])))
            caps[f'{c["fleet"]}/{c["workload"]}'] = c["capacity"]
    for fname in fleet_names:
        fleet = fleets_mod.resolve(fname)
        for w in workloads:
            key = f"{fleet.name}/{w}"
            for load in loads:
                if (fleet.name, w, load, n, tuple(seeds)) in done:
                    continue
                if key not in caps:
                    caps[key] = capacity(fleet, w)
                    log(f"capacity {key}: {caps[key]:.1f} req/s")
                t0 = time.time()
                cell = run_cell(fleet, w, load * caps[key], policies, seeds, n, slo)
                rec = {"fleet": fleet.name, "workload": w, "load": load, "requests": n,
                       "seeds": seeds, "capacity": caps[key], "rate": load * caps[key],
                       "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
                       "nodes": [x.node_id for x in fleet.nodes],
                       "speeds": [x.engine.speed for x in fleet.nodes], **cell}
                with open(path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(rec) + "\n")
                log(f"{key} load {load}: {time.time() - t0:.0f} s wall, "
                    f"{max(cell['cpu_s_per_run']):.1f} s CPU per run at most")
    return path
