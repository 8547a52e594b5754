"""Prefix locality in the fleet simulator: on a shared-prefix workload the precise and
approximate setups beat least_request; without shared prefixes the locality term changes
nothing (the same decisions, the same metrics). Session affinity: the router's real
affinity code keeps a conversation's turns (one routing key) on one node."""

from __future__ import annotations

from dataclasses import replace

from gpumesh_bench.locality.sim import SETUPS, arrivals, fleet
from gpumesh_bench.sim.core import RunResult, simulate
from gpumesh_bench.sim.metrics import SLOSpec, run_metrics
from gpumesh_bench.sim.workloads import Arrival, Workload
from gpumesh_bench.tenants import TenantSpec

SPEC = TenantSpec(tenants=16, system_words=2000, turn_words=40, max_tokens=16)


def _simulate(setup: str, w: Workload, overrides: dict[str, float] | None = None
              ) -> RunResult:
    policy, locality, affinity = SETUPS[setup]
    res = simulate(fleet(4, 24_000, locality, affinity), w, policy, 1,
                   router_overrides=overrides)
    assert not any(r.error for r in res.records)
    return res


def _run(setup: str, spec: TenantSpec, n: int = 400) -> dict[str, float]:
    res = _simulate(setup, Workload("t", arrivals(spec, n), []))
    return run_metrics(res, SLOSpec(1000, float("inf")), warmup=0.2)


def _same_node_share(setup: str, arr: list[Arrival],
                     overrides: dict[str, float] | None = None) -> float:
    """Of the turns after a conversation's first, the share served where its previous
    turn was."""
    res = _simulate(setup, Workload("t", arr, []), overrides)
    node = {r.index: r.node_id for r in res.records}
    last: dict[str, str] = {}
    same = total = 0
    for a in sorted(arr, key=lambda a: a.arrival_s):
        prev = last.get(a.routing_key)
        if prev is not None:
            total += 1
            same += node[a.index] == prev
        last[a.routing_key] = node[a.index]
    assert total > 50
    return same / total


def test_affinity_keeps_a_conversation_on_one_node() -> None:
    arr = arrivals(replace(SPEC, rate=20.0), 300)
    assert all(a.routing_key for a in arr)
    # the routing key's node is an expected hit: most later turns go where the previous one
    # went (a loaded node still loses a turn); without the table they spread
    assert _same_node_share("affinity", arr) > 0.7 > 0.4 > _same_node_share("wll", arr)


def test_locality_cuts_ttft_on_shared_prefixes() -> None:
    spec = replace(SPEC, rate=60.0)
    lr, precise, approx = (_run(s, spec) for s in ("least_request", "precise", "approximate"))
    assert precise["ttft_p90"] < 0.5 * lr["ttft_p90"]
    assert approx["ttft_p90"] < 0.7 * lr["ttft_p90"]


def test_no_shared_prefix_no_change() -> None:
    spec = replace(SPEC, rate=30.0, unique=True)
    assert _run("wll", spec, 200) == _run("precise", spec, 200)
