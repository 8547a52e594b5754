"""Session affinity: the routing-key table (fleet.sessions), the session_affinity scorer's
bounded-load rule (scheduling.scorers.affinity) and the steered profile, table-driven with an
injected clock and RNG (no servers)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from gpumesh.router.fleet.sessions import SessionTable
from gpumesh.router.scheduling import (
    Candidate,
    NodeState,
    RequestInfo,
    WaitModel,
    build_profile,
    default_filters,
    select,
)
from gpumesh.router.scheduling.scorers.affinity import NO_AFFINITY, affinity_bound
from gpumesh.router.scheduling.steering import Steered, SteeringModel, steer
from gpumesh.types import LoadReport
from tests.clock import ManualClock

WM = WaitModel(reference_prompt_tokens_per_s=1000.0, wait_scale_s=0.5)
WEIGHTS = {"expected_wait": 1.0, "kv_headroom": 0.0, "least_request": 0.0}
FILTERS = default_filters(0.92)


def cand(i: int, *, in_flight: int = 0, pending: int = 0, weight: float = 1.0,
         state: NodeState = NodeState.HEALTHY, max_concurrency: int = 0) -> Candidate:
    return Candidate(node_id=f"n{i}", address=f"n{i}:1", state=state, capacity_weight=weight,
                     max_concurrency=max_concurrency,
                     report=LoadReport(pending_prefill_tokens=pending,
                                       draining=state is NodeState.DRAINING),
                     report_age_s=0.1, kv_cache_usage=0.0, router_in_flight=in_flight,
                     outstanding_prompt_tokens=0, outstanding_requests=0,
                     unreported_prompt_tokens=0, unreported_requests=in_flight)


def charged(c: Candidate) -> Candidate:
    """``c`` after one more dispatch of this router (in flight, not yet reported)."""
    return replace(c, router_in_flight=c.router_in_flight + 1,
                   unreported_requests=c.unreported_requests + 1)


def req(session: str = "", key: str = "k") -> RequestInfo:
    return RequestInfo("m", 100, key, session_node=session)


# ---------------------------------------------------------------- the session table


def test_table_remembers_the_last_node_per_model_and_key() -> None:
    t = SessionTable(10, 60.0, ManualClock(0.0))
    assert t.lookup("m", "alice") == ""
    t.remember("m", "alice", "n1")
    t.remember("m", "alice", "n2")          # a retry elsewhere moves the session
    t.remember("other", "alice", "n3")      # the same key for another model is another session
    assert (t.lookup("m", "alice"), t.lookup("other", "alice")) == ("n2", "n3")
    assert t.lookup("m", "") == "" and len(t) == 2
    t.remember("m", "", "n1")               # no key: nothing stored
    assert len(t) == 2


def test_table_is_bounded_lru_and_forgets_after_ttl() -> None:
    clock = ManualClock(0.0)
    t = SessionTable(3, 10.0, clock)
    for k in "abc":
        t.remember("m", k, f"node-{k}")
    assert t.lookup("m", "a") == "node-a"   # touches nothing: lookups do not reorder
    t.remember("m", "a", "node-a")          # a is now the most recent
    t.remember("m", "d", "node-d")          # evicts b, the least recently used
    assert [t.lookup("m", k) for k in "abcd"] == ["node-a", "", "node-c", "node-d"]
    assert len(t) == 3 and t.evictions == 1
    clock.t = 10.5
    assert t.lookup("m", "a") == "" and len(t) == 2   # expired entries are dropped when met


def test_table_with_zero_keys_is_off() -> None:
    t = SessionTable(0, 10.0, ManualClock(0.0))
    t.remember("m", "a", "n1")
    assert t.lookup("m", "a") == "" and len(t) == 0


# ---------------------------------------------------------------- the bounded-load rule


@pytest.mark.parametrize("loads, weights, session, eps, within, bound", [
    # idle fleet: the first request of a session may stick (ceil of a fair share below 1)
    ([0, 0], [1, 1], "n0", 0.25, True, 1),
    # 4 in flight + this one over 2 equal nodes: fair 2.5, bound ceil(3.125) = 4
    ([3, 1], [1, 1], "n0", 0.25, True, 4),
    ([4, 0], [1, 1], "n0", 0.25, False, 4),
    # epsilon 0: exactly the fair share (rounded up)
    ([2, 2], [1, 1], "n0", 0.0, True, 3),
    ([3, 2], [1, 1], "n0", 0.0, False, 3),
    # a node of weight 2 among weight 1 + 1 has half of the fleet's share
    ([4, 1, 1], [2, 1, 1], "n0", 0.25, True, 5),     # fair 3.5
    ([5, 1, 1], [2, 1, 1], "n0", 0.25, False, 5),    # fair 4
    ([1, 3, 1], [2, 1, 1], "n1", 0.25, False, 2),    # fair 1.5
    # a large epsilon lets a session node hold much more than its share
    ([9, 0, 0, 0], [1, 1, 1, 1], "n0", 3.0, True, 10),
])
def test_bounded_load(loads, weights, session, eps, within, bound) -> None:
    cs = [cand(i, in_flight=n, weight=w) for i, (n, w) in enumerate(zip(loads, weights))]
    b = affinity_bound(cs, req(session), eps)
    assert (b.within, b.bound) == (within, bound)
    assert [b.score(c) for c in cs] == [1.0 if within and c.node_id == session else 0.0
                                        for c in cs]


@pytest.mark.parametrize("session", ["", "gone"])
def test_no_session_or_absent_node_scores_nothing(session: str) -> None:
    cs = [cand(0), cand(1)]
    assert affinity_bound(cs, req(session), 0.25) is NO_AFFINITY


# ---------------------------------------------------------------- the steered profile


def profile(**model) -> Steered:
    p = steer(build_profile("weighted_least_load", WEIGHTS, WM), SteeringModel(**model))
    assert isinstance(p, Steered)
    return p


def test_without_session_the_profile_is_unchanged() -> None:
    cs = [cand(0, pending=5000), cand(1, pending=100), cand(2, pending=3000)]
    inner = build_profile("weighted_least_load", WEIGHTS, WM)
    for p in (inner, profile()):
        d = select(p, cs, RequestInfo("m", 100), random.Random(1), FILTERS)
        assert d.node_id == "n1"


@pytest.mark.parametrize("weight, pending, expect", [
    (1.0, 20_000, "n0"),    # weight 1: within the bound the session node wins whatever its wait
    (0.2, 20_000, "n1"),    # a small weight loses to a much shorter queue
    (0.2, 50, "n0"),        # ... and wins against a slightly shorter one
    (0.0, 50, "n1"),        # weight 0: affinity off
])
def test_affinity_weight_trades_with_load(weight, pending, expect) -> None:
    cs = [cand(0, pending=pending), cand(1, pending=0)]
    d = select(profile(affinity_weight=weight), cs, req("n0"), random.Random(1), FILTERS)
    assert d.node_id == expect
    if weight:
        kept = {s.node_id: s.scores["session_affinity"] for s in d.considered}
        assert kept == {"n0": 1.0, "n1": 0.0}


def test_session_node_filtered_out_gets_no_preference() -> None:
    cs = [cand(0, state=NodeState.DRAINING), cand(1, pending=100), cand(2, pending=0)]
    assert select(profile(), cs, req("n0"), random.Random(1), FILTERS).node_id == "n2"
    cs = [cand(0, in_flight=2, max_concurrency=2), cand(1, pending=100), cand(2)]
    assert select(profile(), cs, req("n0"), random.Random(1), FILTERS).node_id == "n2"


@pytest.mark.parametrize("n_nodes, eps", [(2, 0.25), (4, 0.25), (4, 0.0), (8, 1.0)])
def test_one_hot_session_spills_at_the_bound(n_nodes: int, eps: float) -> None:
    """Every request carries the same key and nothing finishes: the session node takes
    requests until it holds ceil((1 + eps) x its fair share), then load decides and the key
    follows; no node ever exceeds the bound because of affinity."""
    table = SessionTable(100, 60.0, ManualClock(0.0))
    p = profile(epsilon=eps)
    cs = {f"n{i}": cand(i) for i in range(n_nodes)}
    rng = random.Random(3)
    for _ in range(20 * n_nodes):
        session = table.lookup("m", "hot")
        d = select(p, list(cs.values()), req(session, "hot"), rng, FILTERS)
        total = sum(c.router_in_flight for c in cs.values())
        chosen = cs[d.node_id]
        if d.node_id == session:   # affinity may have decided: the bound must hold
            assert chosen.router_in_flight + 1 <= math.ceil((1 + eps) * (total + 1) / n_nodes)
        cs[d.node_id] = charged(chosen)
        table.remember("m", "hot", d.node_id)
    loads = sorted(c.router_in_flight for c in cs.values())
    assert loads[-1] <= math.ceil((1 + eps) * 20)   # 20 per node is the fair share
    assert loads[0] >= 1                            # the others took the spill-over


def test_many_sessions_stick_while_the_fleet_is_balanced() -> None:
    """Keys spread by load at first sight, then each stays on its node while loads stay
    within the bound: steady sessions never move."""
    table = SessionTable(1000, 60.0, ManualClock(0.0))
    p = profile()
    cs = {f"n{i}": cand(i) for i in range(4)}
    rng = random.Random(5)
    first: dict[str, str] = {}
    moved = 0
    for turn in range(5):
        for k in range(16):
            key = f"user{k}"
            d = select(p, list(cs.values()), req(table.lookup("m", key), key), rng, FILTERS)
            table.remember("m", key, d.node_id)
            if turn == 0:
                first[key] = d.node_id
                cs[d.node_id] = charged(cs[d.node_id])   # each session holds one open
            elif first[key] != d.node_id:
                moved += 1
    assert moved == 0
    assert sorted(c.router_in_flight for c in cs.values()) == [4, 4, 4, 4]


def test_sampled_decision_includes_the_session_node() -> None:
    """On a fleet larger than the decision sample, the key's last node joins the random
    sample, so affinity holds whatever the sample draws."""
    from gpumesh.router.fleet import Registry
    from gpumesh.router.scheduling import select_from
    from gpumesh.types import ModelSpec, Registration

    reg = Registry("r", lease_ttl_s=10.0, freshness_s=5.0, clock=lambda: 0.0)
    for i in range(200):
        reg.register(Registration(f"n{i:03d}", f"n{i}:1", (ModelSpec("m"),), "inc"),
                     stream_id=i)
    p = profile()
    rng = random.Random(11)
    info = RequestInfo("m", 100, "k", session_node="n150")
    picks = {select_from(p, reg.candidate_source("m"), info, rng, FILTERS, 8).node_id
             for _ in range(50)}
    assert picks == {"n150"}
    free = {select_from(p, reg.candidate_source("m"), RequestInfo("m", 100), rng, FILTERS,
                        8).node_id for _ in range(50)}
    assert len(free) > 10   # without a key: wherever the sample falls


def test_affinity_off_places_a_keyed_request_as_one_without_a_key() -> None:
    # weighted_least_load places a request with a session node without its least_request
    # term; with affinity off (weight 0) the session node must change nothing at all
    weights = {"expected_wait": 1.0, "least_request": 8.0}
    cs = [cand(0, in_flight=3, pending=0), cand(1, in_flight=0, pending=400)]
    p = steer(build_profile("weighted_least_load", weights, WM), SteeringModel(affinity_weight=0))
    plain = select(p, cs, RequestInfo("m", 100), random.Random(1), FILTERS)
    keyed = select(p, cs, req("n0"), random.Random(1), FILTERS)
    assert keyed.node_id == plain.node_id == "n1"
    assert [s.total for s in keyed.considered] == [s.total for s in plain.considered]
    on = steer(build_profile("weighted_least_load", weights, WM), SteeringModel(affinity_weight=1))
    assert select(on, cs, req("n0"), random.Random(1), FILTERS).node_id == "n0"
