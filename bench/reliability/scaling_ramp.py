"""The scaling signal on a traffic ramp, in the fleet simulator (``gpumesh_bench.sim``), with
an autoscaler acting on it.

Traffic rises from ``lo`` to ``hi`` requests/s and falls back (Poisson arrivals, thinned) over
``duration_s``. The router's own ``router.fleet.saturation.SaturationTracker`` samples router
0's registry at every sweep of the simulation (0.5 s of virtual time), as the router's sweeper
does. Two runs of the same arrivals:

- **fixed**: ``start_nodes`` nodes throughout — the SLO breaks (the ramp is a real one), and
  the run records when the signal first asked for more nodes;
- **scaled**: the same start, and an autoscaler that does what a Kubernetes HPA does with
  ``nodes_wanted``: nodes it asks for join ``provision_s`` later (a pod's start), up to
  ``max_nodes``; it removes nodes only when the most it asked for over the last
  ``stabilize_s`` is below the current count (the HPA's scale-down stabilisation window).

Checks: on the fixed fleet the signal asks for more nodes before the first window
(``window_s`` of arrivals) whose p90 TTFT breaks ``slo_ttft_s``; on the scaled fleet every
window's p90 TTFT stays within the SLO, the fleet grows past ``start_nodes`` on the way up and
shrinks again on the way down.

Run: ``gpumesh bench scaling-ramp [--out bench/reliability/results/scaling_ramp.json]``. The
simulator is deterministic: a run is a pure function of its arguments and seed. The
autoscaler steers the simulation through its event queue (``Simulation._push`` of fleet
join/leave events), the one place this module reaches into the simulator.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from gpumesh.router.fleet.saturation import SaturationPolicy, SaturationTracker
from gpumesh_bench.sim import core, fleets, workloads


@dataclass(frozen=True)
class Ramp:
    start_nodes: int = 2
    max_nodes: int = 16
    lo: float = 20.0           # requests/s at the start and the end
    hi: float = 300.0          # requests/s at the peak (the middle of the run)
    duration_s: float = 160.0
    slo_ttft_s: float = 1.0
    target: float = 0.8
    provision_s: float = 10.0
    stabilize_s: float = 30.0
    window_s: float = 4.0
    lengths: str = "lognormal"
    seed: int = 1


@dataclass
class Run:
    samples: list[tuple[float, int, float, int]] = field(default_factory=list)  # t, wanted, sat, nodes
    windows: list[tuple[float, float]] = field(default_factory=list)            # t, p90 TTFT


@dataclass
class RampResult:
    ramp: Ramp
    slots_per_node: int
    fixed: Run
    scaled: Run
    first_ask_s: float | None = None
    first_breach_s: float | None = None
    checks: dict[str, bool] = field(default_factory=dict)


def ramp_arrivals(r: Ramp, node_ids: list[str]) -> workloads.Workload:
    """Arrivals at rate lo -> hi -> lo (linear up over the first half, down over the second),
    by thinning a Poisson process at ``hi``; lengths from the simulator's ``lengths`` mix."""
    rng = random.Random(r.seed)
    times, t = [], 0.0
    half = r.duration_s / 2
    while True:
        t += rng.expovariate(r.hi)
        if t >= r.duration_s:
            break
        rate = r.lo + (r.hi - r.lo) * (1 - abs(t - half) / half)
        if rng.random() * r.hi < rate:
            times.append(t)
    base = workloads.build(r.lengths, len(times), r.hi, r.seed, node_ids)
    arrivals = [replace(a, arrival_s=ts) for a, ts in zip(base.arrivals, times)]
    return workloads.Workload(f"ramp-{r.lengths}", arrivals, [])


def _fleet(n: int) -> fleets.FleetSpec:
    return fleets.from_dict({"name": f"homo{n}",
                             "group": [{"count": n, "speed": 1.0, "prefix": "n"}]})


def _windows(records: list[core.RequestRecord], window_s: float) -> list[tuple[float, float]]:
    by: dict[int, list[float]] = {}
    for rec in records:
        if rec.first_s >= 0 and not rec.error:
            by.setdefault(int(rec.arrival_s // window_s), []).append(rec.ttft_s)
    out = []
    for k in sorted(by):
        xs = sorted(by[k])
        out.append(((k + 1) * window_s, xs[min(len(xs) - 1, int(0.9 * len(xs)))]))
    return out


class _Autoscaler:
    """What an HPA does with nodes_wanted: joins after ``provision_s``, removals only below
    the most wanted over ``stabilize_s``."""

    def __init__(self, sim: core.Simulation, r: Ramp) -> None:
        self.sim, self.r = sim, r
        self.order = list(sim.nodes)         # nodes join in this order, leave in reverse
        self.pending: list[str] = []
        self.recent: list[tuple[float, int]] = []

    def present(self) -> list[str]:
        return [n for n in self.order if self.sim.nodes[n].present and n not in self.pending]

    def act(self, now: float, wanted: int) -> None:
        r, sim = self.r, self.sim
        self.pending = [n for n in self.pending if not sim.nodes[n].present]
        up = [n for n in self.order if sim.nodes[n].present]
        count = len(up) + len(self.pending)
        desired = max(r.start_nodes, min(wanted, r.max_nodes))   # HPA min/max replicas
        if desired > count:
            idle = [n for n in self.order if not sim.nodes[n].present and n not in self.pending]
            for n in idle[:desired - count]:
                self.pending.append(n)
                sim._push(now + r.provision_s, core._FLEET,
                          workloads.FleetEvent(0.0, "join", n))
        self.recent = [(t, w) for t, w in self.recent if t > now - r.stabilize_s]
        self.recent.append((now, desired))
        keep = max(w for _, w in self.recent)
        if keep < len(up) and not self.pending:
            for n in up[keep:]:
                sim._fleet_event(workloads.FleetEvent(0.0, "leave", n))


def _run(r: Ramp, scaled: bool) -> tuple[Run, int]:
    fleet = _fleet(r.max_nodes if scaled else r.start_nodes)
    wl = ramp_arrivals(r, [x.node_id for x in fleet.nodes])
    if scaled:   # only start_nodes are up when the traffic starts
        wl = workloads.Workload(wl.name, wl.arrivals, [
            workloads.FleetEvent(0.0, "leave", n.node_id) for n in fleet.nodes[r.start_nodes:]])
    sim = core.Simulation(fleet, wl, "predicted_latency", r.seed)
    slots = fleet.nodes[0].engine.max_num_seqs   # the engine's batch limit is the node's
    policy = SaturationPolicy(slo_ttft_s=r.slo_ttft_s, target=r.target, default_slots=slots,
                              half_life_s=10.0)
    router = sim.routers[0]
    tracker = SaturationTracker(policy, router.registry.fleet, router.admission.queue_length)
    scaler = _Autoscaler(sim, r) if scaled else None
    run = Run()
    expire = router.registry.expire

    def expire_and_sample() -> list[str]:   # the sweep, then the router's sample
        gone = expire()
        s = tracker.sample(sim.now).get(core.MODEL)
        if s is not None:
            run.samples.append((sim.now, s.nodes_wanted, s.saturation, s.nodes))
            if scaler is not None:
                scaler.act(sim.now, s.nodes_wanted)
        return gone

    router.registry.expire = expire_and_sample  # type: ignore[method-assign]
    res = sim.run()
    t0 = sim.now - res.sim_s   # sample times relative to the first arrival, like records
    run.samples = [(t - t0, w, s, n) for t, w, s, n in run.samples]
    run.windows = _windows(res.records, r.window_s)
    return run, slots


def check(r: Ramp) -> RampResult:
    fixed, slots = _run(r, scaled=False)
    scaled, _ = _run(r, scaled=True)
    out = RampResult(r, slots, fixed, scaled)
    out.first_ask_s = next((t for t, w, _, _ in fixed.samples if w > r.start_nodes and t >= 0),
                           None)
    out.first_breach_s = next((t for t, p in fixed.windows if p > r.slo_ttft_s), None)
    nodes = [(t, n) for t, _, _, n in scaled.samples if t >= 0]
    peak = max((n for _, n in nodes), default=0)
    peak_t = next((t for t, n in nodes if n == peak), 0.0)
    last = nodes[-1][1] if nodes else 0
    out.checks = {
        "slo_breaks_on_the_fixed_fleet": out.first_breach_s is not None,
        "asks_before_the_slo_breaks": (out.first_ask_s is not None
                                       and out.first_breach_s is not None
                                       and out.first_ask_s < out.first_breach_s),
        "the_scaled_fleet_meets_the_slo": all(p <= r.slo_ttft_s for _, p in scaled.windows),
        "grows_on_the_way_up": peak > r.start_nodes and peak_t <= r.duration_s * 0.75,
        "shrinks_on_the_way_down": last < peak,
    }
    return out


def summary(res: RampResult) -> dict[str, Any]:
    def run(x: Run) -> dict[str, Any]:
        return {"samples_t_wanted_saturation_nodes": [[round(t, 2), w, round(s, 4), n]
                                                      for t, w, s, n in x.samples],
                "windows_p90_ttft_s": [[round(t, 2), round(p, 4)] for t, p in x.windows],
                "worst_window_p90_ttft_s": max((p for _, p in x.windows), default=None),
                "peak_nodes": max((n for t, _, _, n in x.samples if t >= 0), default=0)}

    return {"ramp": asdict(res.ramp), "slots_per_node": res.slots_per_node,
            "first_ask_s": res.first_ask_s, "first_breach_s": res.first_breach_s,
            "checks": res.checks, "fixed": run(res.fixed), "scaled": run(res.scaled)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpumesh_bench.reliability.scaling_ramp",
                                description=__doc__.split("\n\n")[0])
    for name, default in asdict(Ramp()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    p.add_argument("--out", help="write the result (JSON) here")
    args = vars(p.parse_args(argv))
    out_path = args.pop("out")
    res = check(Ramp(**args))
    doc = summary(res)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(doc, f, indent=1)
    brief = {k: v for k, v in doc.items() if k not in ("fixed", "scaled")}
    for name in ("fixed", "scaled"):
        brief[name] = {k: doc[name][k] for k in ("worst_window_p90_ttft_s", "peak_nodes")}
    print(json.dumps(brief))
    return 0 if all(res.checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
