"""Prefix locality in the fleet simulator: on a shared-prefix workload the precise and
approximate setups beat least_request; without shared prefixes the locality term changes
nothing (the same decisions, the same metrics)."""

from __future__ import annotations

from dataclasses import replace

from gpumesh_bench.prefix_sim import SETUPS, arrivals, fleet
from gpumesh_bench.sim.core import simulate
from gpumesh_bench.sim.metrics import SLOSpec, run_metrics
from gpumesh_bench.sim.workloads import Workload
from gpumesh_bench.tenants import TenantSpec

SPEC = TenantSpec(tenants=16, system_words=2000, turn_words=40, max_tokens=16)


def _run(setup: str, spec: TenantSpec, n: int = 400) -> dict[str, float]:
    policy, locality = SETUPS[setup]
    w = Workload("t", arrivals(spec, n), [])
    res = simulate(fleet(4, 24_000, locality), w, policy, 1)
    assert not any(r.error for r in res.records)
    return run_metrics(res, SLOSpec(1000, float("inf")), warmup=0.2)


def test_locality_cuts_ttft_on_shared_prefixes() -> None:
    spec = replace(SPEC, rate=60.0)
    lr, precise, approx = (_run(s, spec) for s in ("least_request", "precise", "approximate"))
    assert precise["ttft_p90"] < 0.5 * lr["ttft_p90"]
    assert approx["ttft_p90"] < 0.7 * lr["ttft_p90"]


def test_no_shared_prefix_no_change() -> None:
    spec = replace(SPEC, rate=30.0, unique=True)
    assert _run("wll", spec, 200) == _run("precise", spec, 200)
