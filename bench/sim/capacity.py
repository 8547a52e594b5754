"""Capacity planning: which fleet holds an SLO at which request rate.

For each fleet, the trace (or a named workload) is replayed at increasing mean rates
(``rates``, requests per simulated second; by default a sweep up to 1.2x the fleet's measured
saturation throughput), each rate over ``seeds`` seeds with the chosen policy. A rate *holds*
the SLO when the lower bound of the 95 % CI of the fraction of requests meeting it (TTFT and
TPOT, ``metrics.SLOSpec``) is at least ``attainment`` (default 0.99) and, when given, the
mean p99 latencies stay under their limits. The answer per fleet is the highest rate that
holds (rates above a failing one are not credited), and one PNG plots SLO attainment against
rate for every fleet.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumesh_bench.sim import workloads as wl
from gpumesh_bench.sim.core import simulate
from gpumesh_bench.sim.fleets import FleetSpec
from gpumesh_bench.sim.grid import capacity
from gpumesh_bench.sim.metrics import SLOSpec, aggregate, run_metrics


@dataclass(frozen=True)
class PlanPoint:
    rate: float
    slo_frac: tuple[float, float]     # mean, CI half-width
    ttft_p99: tuple[float, float]
    e2e_p99: tuple[float, float]
    holds: bool


def _workload(trace: wl.Workload | None, workload: str, fleet: FleetSpec, n: int,
              rate: float, seed: int) -> wl.Workload:
    """The run's requests: the trace's first ``n`` (0 = all) at ``rate``, or ``n`` (0 =
    5,000) of the named workload drawn from ``seed``."""
    if trace is not None:
        return wl.rescale(wl.head(trace, n or None), rate)
    return wl.build(workload, n or 5000, rate, seed, [x.node_id for x in fleet.nodes],
                    fleet.fastest)


def plan(fleet: FleetSpec, slo: SLOSpec, *, trace: wl.Workload | None = None,
         workload: str = "lognormal", rates: Sequence[float] = (), policy: str =
         "predicted_latency", seeds: Sequence[int] = (1, 2, 3), n: int | None = None,
         attainment: float = 0.99, ttft_p99_ms: float = math.inf,
         e2e_p99_ms: float = math.inf) -> tuple[list[PlanPoint], float]:
    """The sweep and the highest rate that holds (0 when none does). ``n``: requests per run
    (a trace: its first ``n``, default all of it; a named workload: default 5,000)."""
    if not rates:
        cap = (trace_capacity(fleet, trace) if trace is not None
               else capacity(fleet, workload))
        rates = [round(cap * f, 2) for f in (0.3, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0,
                                             1.1, 1.2)]
    points: list[PlanPoint] = []
    best = 0.0
    failed = False
    for rate in sorted(rates):
        per = []
        for s in seeds:
            w = _workload(trace, workload, fleet, n or 0, rate, s)
            per.append(run_metrics(simulate(fleet, w, policy, s), slo))
        a = aggregate(per)
        lo = a["slo_frac"][0] - (0 if math.isnan(a["slo_frac"][1]) else a["slo_frac"][1])
        holds = (lo >= attainment and a["ttft_p99"][0] <= ttft_p99_ms
                 and a["e2e_p99"][0] <= e2e_p99_ms)
        points.append(PlanPoint(rate, tuple(a["slo_frac"]), tuple(a["ttft_p99"]),  # type: ignore[arg-type]
                                tuple(a["e2e_p99"]), holds))  # type: ignore[arg-type]
        if holds and not failed:
            best = rate
        failed = failed or not holds
    return points, best


def trace_capacity(fleet: FleetSpec, trace: wl.Workload) -> float:
    """Saturation throughput of ``fleet`` on the trace's request mix (closed loop through
    ``least_request``, ``max_num_seqs`` outstanding per node, completions per second between
    the 20th and 80th percentile of completion times, as ``grid.capacity``)."""
    conc = sum(x.engine.max_num_seqs for x in fleet.nodes)
    arr = trace.arrivals[: max(3000, 4 * conc)]
    r = simulate(fleet, wl.Workload(trace.name, arr, []), "least_request", 1000,
                 closed_concurrency=conc)
    ends = sorted(x.end_s for x in r.records if not x.error)
    lo, hi = int(0.2 * len(ends)), int(0.8 * len(ends))
    return (hi - lo) / (ends[hi] - ends[lo])


def markdown(results: dict[str, tuple[list[PlanPoint], float]], slo: SLOSpec,
             attainment: float) -> str:
    lines = [f"SLO: TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms for at least "
             f"{attainment:.1%} of requests (lower 95 % CI bound)", "",
             "| fleet | highest rate that holds (req/s) |", "|---|---|"]
    lines += [f"| {name} | {best:g} |" for name, (_, best) in results.items()]
    lines += ["", "| fleet | rate | in SLO % | TTFT p99 ms | e2e p99 ms | holds |",
              "|---|---|---|---|---|---|"]
    for name, (pts, _) in results.items():
        for p in pts:
            lines.append(f"| {name} | {p.rate:g} | {p.slo_frac[0] * 100:.2f} | "
                         f"{p.ttft_p99[0]:.0f} | {p.e2e_p99[0]:.0f} | "
                         f"{'yes' if p.holds else 'no'} |")
    return "\n".join(lines)


def plot(results: dict[str, tuple[list[PlanPoint], float]], attainment: float,
         out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (pts, best) in results.items():
        xs = [p.rate for p in pts]
        ys = [p.slo_frac[0] * 100 for p in pts]
        err = [0 if math.isnan(p.slo_frac[1]) else p.slo_frac[1] * 100 for p in pts]
        line = ax.errorbar(xs, ys, yerr=err, marker="o", capsize=2, label=f"{name} (holds to "
                           f"{best:g} req/s)")
        if best:
            ax.axvline(best, color=line[0].get_color(), ls=":", lw=1)
    ax.axhline(attainment * 100, color="k", ls="--", lw=1, label="target")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("requests within SLO (%)")
    ax.set_title("gpumesh sim: SLO attainment by rate")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def as_json(results: dict[str, tuple[list[PlanPoint], float]]) -> dict[str, Any]:
    return {name: {"best_rate": best, "points": [p.__dict__ for p in pts]}
            for name, (pts, best) in results.items()}
