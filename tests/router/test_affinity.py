"""Session affinity: the routing-key table (fleet.sessions) and the prediction's treatment
of a session's node as an expected prefix hit (scheduling.predictor), table-driven with an
injected clock and RNG (no servers)."""

from __future__ import annotations

import random

import pytest

from gpumesh.router.fleet.sessions import SessionTable
from gpumesh.router.scheduling import (
    Candidate,
    NodeState,
    RequestInfo,
    RoutingSettings,
    build_policy,
    default_filters,
    select,
)
from gpumesh.types import LoadReport
from tests.clock import ManualClock

FILTERS = default_filters(0.92)


def cand(i: int, *, running: int = 0, pending: int = 0) -> Candidate:
    return Candidate(node_id=f"n{i}", address=f"n{i}:1", state=NodeState.HEALTHY,
                     capacity_weight=1.0, max_concurrency=0,
                     report=LoadReport(num_running=running, pending_prefill_tokens=pending),
                     report_age_s=0.1, kv_cache_usage=0.0, router_in_flight=running,
                     outstanding_prompt_tokens=0, outstanding_requests=0,
                     unreported_prompt_tokens=0, unreported_requests=0)


def profile():  # noqa: ANN201  (the default policy)
    return build_policy(RoutingSettings())


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


@pytest.mark.parametrize("session_load, other_load, expect", [
    ({}, {}, "n0"),                                  # idle: the session's node
    ({"running": 1}, {}, "n0"),                      # one stream there: still worth the hit
    ({"pending": 40_000}, {}, "n1"),                 # 5 s of queue: not worth half a prompt
    ({}, {"pending": 40_000}, "n0"),
])
def test_the_sessions_node_trades_its_expected_hit_against_load(session_load, other_load,
                                                                 expect) -> None:
    cs = [cand(0, **session_load), cand(1, **other_load)]
    info = RequestInfo("m", 2000, "k", session_node="n0")
    assert select(profile(), cs, info, random.Random(1), FILTERS).node_id == expect
    # without the session, the idle fleet's pick is the request's own tie order, not n0's
    plain = {select(profile(), [cand(0), cand(1)], RequestInfo("m", 2000, f"k{i}"),
                    random.Random(1), FILTERS).node_id for i in range(20)}
    assert plain == {"n0", "n1"}
