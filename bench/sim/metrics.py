"""Metrics of simulated runs and their confidence intervals over seeds (pure functions).

Per run (``run_metrics``): over the requests after the warm-up (the first ``warmup`` fraction
of arrivals is left out), TTFT p50/p90/p99, TPOT p50/p99 (requests with >= 2 output tokens),
end-to-end p50/p99 (milliseconds), throughput (completions per simulated second from the first
measured arrival to the last measured end), **goodput** (requests meeting both SLO halves per
second of *offered* time: from the first to the last measured arrival, so that one straggler
finishing late cannot set it), the fraction meeting the SLO (SLO attainment, reported beside
goodput), the share of requests per node, ``cut_outputs`` (requests whose output was cut
at the context length, ``RunResult.cut_outputs``) and ``disaggregated`` (the share whose
prefill ran on a prefill node).

Over seeds (``aggregate``): each metric's mean and the half-width of its 95 % confidence
interval, Student's t over the per-seed values (seeds are independent replications).
Percentiles interpolate linearly between closest ranks (``gpumesh_bench.stats.percentile``).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpumesh_bench.sim.core import RequestRecord, RunResult
from gpumesh_bench.stats import percentile

# two-sided 95 % Student t quantiles by degrees of freedom
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}

METRICS = ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50", "e2e_p99",
           "throughput", "goodput", "slo_frac")


@dataclass(frozen=True)
class SLOSpec:
    """TTFT and TPOT bounds in milliseconds (simulated time)."""

    ttft_ms: float = 100.0
    tpot_ms: float = 15.0

    def met(self, r: RequestRecord) -> bool:
        if r.error:
            return False
        tpot = r.tpot_s
        return r.ttft_s * 1000 <= self.ttft_ms and (tpot is None or tpot * 1000 <= self.tpot_ms)


def t95(dof: int) -> float:
    if dof <= 0:
        return math.nan
    keys = [k for k in _T95 if k <= dof]
    return _T95[max(keys)] if dof <= 30 else 1.96


def run_metrics(result: RunResult, slo: SLOSpec, warmup: float = 0.05) -> dict[str, Any]:
    recs = result.records
    skip = int(len(recs) * warmup)
    measured = recs[skip:]
    ok = [r for r in measured if not r.error]
    ttft = [r.ttft_s * 1000 for r in ok]
    e2e = [r.e2e_s * 1000 for r in ok]
    tpot = [t * 1000 for r in ok if (t := r.tpot_s) is not None]
    if measured:
        first = min(r.arrival_s for r in measured)
        span = max(max(r.end_s for r in measured) - first, 1e-9)
        offered = max(r.arrival_s for r in measured) - first
    else:
        span = offered = math.nan
    good = sum(1 for r in ok if slo.met(r))
    share = Counter(r.node_id for r in ok)
    return {
        "requests": len(measured), "errors": len(measured) - len(ok),
        "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90),
        "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
        "e2e_p50": percentile(e2e, 50), "e2e_p99": percentile(e2e, 99),
        "throughput": len(ok) / span,
        # NaN when the measured requests all arrive at once (no offered time to divide by)
        "goodput": good / offered if offered > 0 else math.nan, "offered_s": offered,
        "slo_frac": good / len(measured) if measured else math.nan,
        "share": {n: share.get(n, 0) / max(len(ok), 1) for n in result.node_ids},
        "preemptions": result.preemptions, "sim_s": result.sim_s,
        "cut_outputs": result.cut_outputs,
        # disaggregated serving: the share of measured requests whose prefill ran elsewhere
        "disaggregated": sum(1 for r in ok if r.prefill_node) / max(len(ok), 1),
    }


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95 % CI); half-width NaN for one value."""
    xs = [v for v in values if not math.isnan(v)]
    if not xs:
        return math.nan, math.nan
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, math.nan
    return m, t95(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def aggregate(per_seed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean and CI half-width of each metric over seeds (``{"ttft_p99": [mean, ci], ...}``),
    plus the mean per-node share."""
    out: dict[str, Any] = {m: list(mean_ci([s[m] for s in per_seed])) for m in METRICS}
    nodes = per_seed[0]["share"].keys() if per_seed else ()
    out["share"] = {n: statistics.fmean(s["share"].get(n, 0.0) for s in per_seed)
                    for n in nodes}
    out["seeds"] = len(per_seed)
    return out


def ratio_ci(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean of the per-seed ratios a/b (paired: same seed, same trace) and its CI
    half-width."""
    return mean_ci([x / y for x, y in zip(a, b) if y and not math.isnan(x)])
