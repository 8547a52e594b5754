"""Table-driven tests of filters, the pipeline and the baseline policies over in-memory
candidates (injected RNG); the predictive policy has its own (test_predicted.py)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gpumesh.router.scheduling import (
    Candidate,
    NoCandidate,
    NodeState,
    RequestInfo,
    RoutingSettings,
    build_policy,
    default_filters,
    select,
)
from gpumesh.router.scheduling.filters import healthy, kv_below
from gpumesh.router.scheduling.policies.least_request import least_request_score
from gpumesh.types import LoadReport

REQ = RequestInfo("m", 100)


def cand(node_id: str = "n", *, weight: float = 1.0, pending: int = 0, kv: float = 0.0,
         tps: float = 0.0, running: int = 0, state: NodeState = NodeState.HEALTHY,
         in_flight: int = 0, outstanding: int = 0, unreported: int = 0, unreported_n: int = 0,
         max_concurrency: int = 0, stale: bool = False, capacity: float = 0.0) -> Candidate:
    report = None if stale else LoadReport(num_running=running, pending_prefill_tokens=pending,
                                           kv_cache_usage=kv, prompt_tokens_per_s=tps,
                                           draining=state is NodeState.DRAINING,
                                           prefill_capacity_tokens_per_s=capacity)
    return Candidate(node_id=node_id, address=f"{node_id}:1",
                     state=NodeState.STALE if stale else state, capacity_weight=weight,
                     max_concurrency=max_concurrency, report=report,
                     report_age_s=10.0 if stale else 0.1, kv_cache_usage=kv,
                     router_in_flight=in_flight, outstanding_prompt_tokens=outstanding,
                     outstanding_requests=0, unreported_prompt_tokens=unreported,
                     unreported_requests=unreported_n)


@pytest.mark.parametrize("c, score", [
    (cand(in_flight=0), 1.0), (cand(in_flight=1), 0.5), (cand(in_flight=2, weight=2.0), 0.5),
    (cand(in_flight=3), 0.25)])
def test_least_request_curve(c: Candidate, score: float) -> None:
    assert least_request_score(c).total == pytest.approx(score)


# ---------------------------------------------------------------- filters


def test_kv_filter_avoids_full_node_while_others_have_room() -> None:
    cs = [cand("a", kv=0.95), cand("b", kv=0.5), cand("c", kv=0.2)]
    kept, dropped = kv_below(0.92)(cs)
    assert [c.node_id for c in kept] == ["b", "c"] and "a" in dropped
    profile = build_policy(RoutingSettings(policy="predicted_latency"))
    rng = random.Random(1)
    picks = Counter(select(profile, cs, REQ, rng, default_filters(0.92)).node_id
                    for _ in range(200))
    assert picks["a"] == 0


def test_kv_filter_keeps_everyone_when_all_are_full() -> None:
    cs = [cand("a", kv=0.95), cand("b", kv=0.97)]
    kept, dropped = kv_below(0.92)(cs)
    assert len(kept) == 2 and not dropped


def test_kv_filter_lets_stale_nodes_through() -> None:
    kept, _ = kv_below(0.92)([cand("a", kv=0.99, stale=True), cand("b", kv=0.1)])
    assert {c.node_id for c in kept} == {"a", "b"}


def test_draining_dropped_and_stale_kept() -> None:
    cs = [cand("a", state=NodeState.DRAINING), cand("b", stale=True), cand("c")]
    kept, dropped = healthy(cs)
    assert [c.node_id for c in kept] == ["b", "c"] and dropped == {"a": "draining"}


def test_select_distinguishes_busy_from_none() -> None:
    profile = build_policy(RoutingSettings(policy="least_request"))
    with pytest.raises(NoCandidate) as e:
        select(profile, [cand("a", state=NodeState.DRAINING)], REQ, random.Random(0),
               default_filters(0.92))
    assert not e.value.busy
    with pytest.raises(NoCandidate) as e:
        select(profile, [cand("a", max_concurrency=1, in_flight=1)], REQ, random.Random(0),
               default_filters(0.92))
    assert e.value.busy


# ---------------------------------------------------------------- policies


@pytest.mark.parametrize("policy", ["least_request", "power_of_two", "round_robin"])
def test_tie_break_is_fair(policy: str) -> None:
    profile = build_policy(RoutingSettings(policy=policy))
    cs = [cand(f"n{i}") for i in range(4)]
    rng = random.Random(42)
    n = 4000
    picks = Counter(select(profile, cs, REQ, rng, default_filters(0.92)).node_id
                    for _ in range(n))
    assert set(picks) == {c.node_id for c in cs}
    for count in picks.values():
        assert abs(count - n / 4) < 0.1 * n / 4, picks


def test_decision_keeps_the_predictions() -> None:
    profile = build_policy(RoutingSettings(policy="predicted_latency"))
    d = select(profile, [cand("a", pending=1000), cand("b", kv=0.5)], REQ, random.Random(0),
               default_filters(0.92))
    by_node = {s.node_id: s for s in d.considered}
    assert d.node_id == "b" and d.policy == "predicted_latency" and d.candidates == 2
    assert set(by_node["a"].scores) == {"ttft_s", "completion_s", "imposed_s"}
    assert by_node["a"].expected_wait_s == by_node["a"].scores["ttft_s"] > \
        by_node["b"].scores["ttft_s"] == d.predicted_ttft_s
    assert by_node["b"].total > by_node["a"].total


def test_power_of_two_prefers_less_loaded_of_sample() -> None:
    profile = build_policy(RoutingSettings(policy="power_of_two"))
    cs = [cand("busy", in_flight=10), cand("idle")]
    picks = Counter(select(profile, cs, REQ, random.Random(3), ()).node_id for _ in range(50))
    assert picks == {"idle": 50}


def test_least_request_honours_weight() -> None:
    profile = build_policy(RoutingSettings(policy="least_request"))
    d = select(profile, [cand("big", weight=2.0, in_flight=3), cand("small", in_flight=2)], REQ,
               random.Random(0), ())
    assert d.node_id == "big"   # 3/2 < 2/1
