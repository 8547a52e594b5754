"""Large-fleet decisions: power-of-d sampling (``select_from``) and the registry's per-node
candidate cache, table-driven with an injected RNG and clock (no servers)."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import pytest

from gpumesh.router.fleet import Credit, Registry
from gpumesh.router.scheduling import (
    Candidate,
    ListCandidates,
    NodeState,
    RequestInfo,
    NoCandidate,
    RoutingSettings,
    build_policy,
    default_filters,
    select,
    select_from,
)
from gpumesh.router.scheduling.policies.predicted import PredictedLatency, _cost
from gpumesh.types import LoadReport, ModelSpec, Registration, RouterAccount

REQ = RequestInfo("m", 100)
POLICIES = ["predicted_latency", "least_request", "power_of_two", "round_robin"]
FILTERS = default_filters(0.92)


def cand(i: int, *, pending: int = 0, kv: float = 0.0, in_flight: int = 0,
         state: NodeState = NodeState.HEALTHY, max_concurrency: int = 0,
         weight: float = 1.0) -> Candidate:
    return Candidate(node_id=f"n{i:04d}", address=f"n{i}:1", state=state,
                     capacity_weight=weight, max_concurrency=max_concurrency,
                     report=LoadReport(pending_prefill_tokens=pending, kv_cache_usage=kv,
                                       draining=state is NodeState.DRAINING),
                     report_age_s=0.1, kv_cache_usage=kv, router_in_flight=in_flight,
                     outstanding_prompt_tokens=0, outstanding_requests=0,
                     unreported_prompt_tokens=0, unreported_requests=0)


def random_fleet(n: int, seed: int) -> list[Candidate]:
    rng = random.Random(seed)
    return [cand(i, pending=rng.randrange(20_000), kv=rng.random() * 0.9,
                 in_flight=rng.randrange(8), weight=rng.choice((0.5, 1.0, 2.0)))
            for i in range(n)]


# ---------------------------------------------------------------- sampling: exactness


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("n, d", [(1, 32), (8, 32), (32, 32), (50, 0), (64, 64)])
def test_small_fleets_are_exact(policy: str, n: int, d: int) -> None:
    """Up to d nodes (or d = 0) select_from makes the very decisions select makes."""
    cs = random_fleet(n, seed=n)
    a, b = build_policy(RoutingSettings(policy=policy)), build_policy(RoutingSettings(policy=policy))
    ra, rb = random.Random(3), random.Random(3)
    for _ in range(50):
        da = select(a, cs, REQ, ra, FILTERS)
        db = select_from(b, ListCandidates(cs), REQ, rb, FILTERS, d)
        assert (da.node_id, da.tie_size, da.sampled_from) == (db.node_id, db.tie_size, 0)


def test_round_robin_is_never_sampled() -> None:
    cs = random_fleet(100, seed=1)
    p = build_policy(RoutingSettings(policy="round_robin"))
    picks = [select_from(p, cs, REQ, random.Random(0), FILTERS, 8).node_id for _ in range(100)]
    assert picks == [c.node_id for c in cs]


# ---------------------------------------------------------------- sampling: fairness, quality


@pytest.mark.parametrize("policy", ["predicted_latency", "least_request", "power_of_two"])
def test_sampling_is_fair_under_equal_load(policy: str) -> None:
    """256 identical nodes, d = 32: every node is picked about equally often (the predictive
    policy breaks ties by the request's key, so the requests differ by routing key)."""
    cs = [cand(i) for i in range(256)]
    p = build_policy(RoutingSettings(policy=policy))
    rng = random.Random(42)
    n = 256 * 60
    picks = Counter(select_from(p, cs, RequestInfo("m", 100, f"k{i}"), rng, FILTERS,
                                32).node_id for i in range(n))
    assert len(picks) == 256
    assert max(picks.values()) < 100 and min(picks.values()) > 25, picks.most_common(3)


@pytest.mark.parametrize("n, d", [(256, 32), (1024, 32), (1024, 8)])
def test_sampled_pick_is_near_the_best(n: int, d: int) -> None:
    """The pick is the best of d uniform draws: its rank among all n by exact total is about
    n / (d + 1) on average, and the exact pick (d = 0) has rank 0."""
    cs = random_fleet(n, seed=n + d)
    p = build_policy(RoutingSettings(policy="predicted_latency"))
    assert isinstance(p, PredictedLatency)
    cost = {c.node_id: _cost(q, "max_slo_attainment", 0.0)
            for c, q in zip(cs, p.predictions(cs, REQ))}
    ranked = sorted(cs, key=lambda c: cost[c.node_id])
    rank = {c.node_id: i for i, c in enumerate(ranked)}
    rng = random.Random(9)
    ranks = [rank[select_from(p, cs, REQ, rng, FILTERS, d).node_id] for _ in range(2000)]
    expected = n / (d + 1)
    assert 0.8 * expected <= sum(ranks) / len(ranks) <= 1.2 * expected
    assert rank[select_from(p, cs, REQ, rng, FILTERS, 0).node_id] == 0


def _balance(n: int, d: int, steps: int, seed: int) -> int:
    """A closed system: each step one arrival (charged at once) and, per node, a completion
    with probability 1/2 when it has work. Returns the largest in-flight count seen."""
    rng, done = random.Random(seed), random.Random(seed + 1)
    load = [0] * n
    p = build_policy(RoutingSettings(policy="predicted_latency"))
    worst = 0
    for _ in range(steps):
        cs = [cand(i, in_flight=load[i], pending=100 * load[i]) for i in range(n)]
        i = int(select_from(p, cs, REQ, rng, FILTERS, d).node_id[1:])
        load[i] += 1
        worst = max(worst, load[i])
        for j in range(n):
            if load[j] and done.random() < 0.02:
                load[j] -= 1
    return worst


def test_sampling_costs_little_balance() -> None:
    """The balancing price of d = 16 on 64 nodes at ~80 % load: the busiest node is at most 1
    request busier than with every node scored (d = 2 shows what a poor sample costs)."""
    exact = _balance(64, 0, 1500, seed=5)
    sampled = _balance(64, 16, 1500, seed=5)
    two = _balance(64, 2, 1500, seed=5)
    assert sampled <= exact + 1, (exact, sampled)
    assert two >= sampled, (two, sampled)


# ---------------------------------------------------------------- sampling: filter semantics


@pytest.mark.parametrize("case, expect", [
    # (fleet builder, expected: set of allowed picks or the NoCandidate busy flag)
    ("one_under_kv", {"n0077"}),
    ("all_over_kv", "any"),
    ("one_free", {"n0123"}),
    ("all_busy", True),
    ("all_draining", False),
    ("one_not_draining", {"n0005"}),
])
def test_sampled_decisions_keep_filter_semantics(case: str, expect: object) -> None:
    n = 200
    if case == "one_under_kv":
        cs = [cand(i, kv=0.5 if i == 77 else 0.95) for i in range(n)]
    elif case == "all_over_kv":
        cs = [cand(i, kv=0.95) for i in range(n)]
    elif case == "one_free":
        cs = [cand(i, max_concurrency=1, in_flight=0 if i == 123 else 1) for i in range(n)]
    elif case == "all_busy":
        cs = [cand(i, max_concurrency=1, in_flight=1) for i in range(n)]
    elif case == "all_draining":
        cs = [cand(i, state=NodeState.DRAINING) for i in range(n)]
    else:
        cs = [cand(i, state=NodeState.HEALTHY if i == 5 else NodeState.DRAINING)
              for i in range(n)]
    p = build_policy(RoutingSettings(policy="predicted_latency"))
    rng = random.Random(1)
    for _ in range(50):
        if isinstance(expect, bool):
            with pytest.raises(NoCandidate) as e:
                select_from(p, cs, REQ, rng, FILTERS, 16)
            assert e.value.busy is expect
        else:
            d = select_from(p, cs, REQ, rng, FILTERS, 16)
            assert expect == "any" or d.node_id in expect  # type: ignore[operator]


def test_sampled_decision_keeps_top_scores_and_the_chosen() -> None:
    cs = random_fleet(300, seed=2)
    p = build_policy(RoutingSettings(policy="predicted_latency"))
    d = select_from(p, cs, REQ, random.Random(4), FILTERS, 32)
    assert d.sampled_from == 300 and d.candidates == 32
    assert d.node_id == d.considered[0].node_id and len(d.considered) == 3
    assert set(d.considered[0].scores) == {"ttft_s", "completion_s", "imposed_s"}
    assert d.considered[0].total == max(s.total for s in d.considered)


# ---------------------------------------------------------------- registry: the per-node cache


RID = "r1"


def _reference(r: Registry, model: str, credits: Sequence[Credit] = ()) -> list[Candidate]:
    """The candidates as the uncached registry built them (every field but report_age_s).
    ``credits``: every credit the test dispatched and has not finished (the in-flight part of
    ``decode_delta`` is recomputed from them; how many the last report held is the ledger's)."""
    now = r.clock()
    out = []
    snap = r.snapshot(model)
    for e in (snap.nodes if snap is not None else ()):
        if now - e.last_seen > r.lease_ttl_s:
            continue
        ledger = r.ledger(e.node_id)
        ledger.housekeep(now)
        state, _ = r.state_of(e, now)
        spec = next(m for m in e.registration.models if m.name == model)
        unrep = [c for o, c in ledger._pending.items() if o > ledger._cutoff]  # from scratch
        tokens, requests = sum(c.tokens for c in unrep), len(unrep)
        live = [c for c in credits if c.ledger is ledger and c.slot and c.slot_until_finish]
        live_rep = sum(1 for c in live if c.ordinal <= ledger._cutoff)
        blind = sum(1 for c in unrep if not c.slot_until_finish)
        fresh = e.report is not None and state is not NodeState.STALE
        out.append(Candidate(
            node_id=e.node_id, address=e.registration.address, state=state,
            capacity_weight=spec.capacity_weight,
            max_concurrency=e.registration.max_concurrency or r.max_concurrency_default,
            report=e.report.load if fresh and e.report is not None else None,
            report_age_s=0.0,
            kv_cache_usage=e.report.load.kv_cache_usage if e.report is not None else 0.0,
            router_in_flight=ledger.in_flight, outstanding_prompt_tokens=ledger.pending_tokens,
            outstanding_requests=ledger.pending_requests,
            unreported_prompt_tokens=tokens, unreported_requests=requests,
            decode_delta=len(live) - live_rep + min(0, live_rep - ledger._held) + blind,
            peer_factor=r.peers.factor))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_cached_candidates_match_a_full_rebuild(seed: int) -> None:
    """Random sequences of joins, heartbeats (with accounts), dispatches (proxy / blind),
    first tokens, finishes (admitted or not), drains, leaves and clock steps across the
    freshness, lease and credit time bounds: after every event the cached candidates (all,
    and read one by one) equal a rebuild from scratch."""
    rng = random.Random(seed)
    t = [1000.0]
    r = Registry(RID, lease_ttl_s=3.0, freshness_s=1.0, clock=lambda: t[0])
    nodes = [f"n{i}" for i in range(6)]
    streams: dict[str, int] = {}
    seqs: Counter[str] = Counter()
    admitted: Counter[str] = Counter()
    first: Counter[str] = Counter()
    finished: Counter[str] = Counter()
    credits: list = []
    next_stream = iter(range(1, 10**6))
    for _step in range(600):
        op = rng.random()
        n = rng.choice(nodes)
        if op < 0.08 or n not in streams:
            streams[n] = next(next_stream)
            inc = "i1" if rng.random() < 0.8 else f"i{rng.randrange(9)}"
            r.register(Registration(n, f"{n}:1", (ModelSpec("m", capacity_weight=rng.choice(
                (1.0, 2.0))),), inc, max_concurrency=rng.choice((0, 3))), streams[n])
        elif op < 0.35:
            seqs[n] += 1
            admitted[n] += rng.randrange(3)
            first[n] += rng.randrange(3)
            finished[n] += rng.randrange(3)
            r.heartbeat(n, streams[n], seqs[n], 0, LoadReport(
                num_running=rng.randrange(9), pending_prefill_tokens=rng.randrange(5000),
                kv_cache_usage=rng.random(), kv_capacity_tokens=rng.choice((0, 8192)),
                draining=rng.random() < 0.05,
                router_accounts=(RouterAccount(RID, admitted[n], 0, first[n], 0, finished[n]
                                               if rng.random() < 0.5 else None),)))
        elif op < 0.6:
            if r.entry(n) is not None:
                blind = rng.random() < 0.5
                credits.append(r.charge(n, rng.randrange(1, 800), blind=blind,
                                        hold_s=rng.uniform(0.1, 4.0),
                                        slot_until_finish=rng.random() < 0.5))
        elif op < 0.7 and credits:
            credits[rng.randrange(len(credits))].first_token()
        elif op < 0.8 and credits:
            credits.pop(rng.randrange(len(credits))).finish(admitted=rng.random() < 0.8)
        elif op < 0.83:
            r.drain(n)
        elif op < 0.86:
            r.deregister(n, streams.pop(n))
        elif op < 0.9:
            r.expire()
        else:
            t[0] += rng.choice((0.05, 0.3, 0.9, 1.2, 2.5))
        cached = [replace(c, report_age_s=0.0) for c in r.candidates("m")]
        src = r.candidate_source("m")
        one_by_one = [replace(c, report_age_s=0.0) for i in range(len(src))
                      if (c := src.at(i)) is not None]
        expected = _reference(r, "m", credits)
        assert cached == expected, _step
        assert one_by_one == expected, _step


def test_candidate_is_reused_until_an_input_changes() -> None:
    t = [1000.0]
    r = Registry(RID, lease_ttl_s=3.0, freshness_s=1.0, clock=lambda: t[0])
    r.register(Registration("a", "a:1", (ModelSpec("m"),), "i1"), 1)
    r.heartbeat("a", 1, 1, 0, LoadReport(pending_prefill_tokens=10))
    (c1,) = r.candidates("m")
    (c2,) = r.candidates("m")
    assert c1 is c2                                  # nothing changed: the same object
    credit = r.charge("a", 100)
    (c3,) = r.candidates("m")
    assert c3 is not c2 and c3.unreported_prompt_tokens == 100
    credit.first_token()
    (c4,) = r.candidates("m")
    assert c4.unreported_prompt_tokens == 0 and c4.router_in_flight == 1
    t[0] += 1.5                                      # the report goes stale by time alone
    (c5,) = r.candidates("m")
    assert c5.state is NodeState.STALE and c5.report is None
    t[0] += 2.0                                      # and the lease ends
    assert r.candidates("m") == []
    assert math.isinf(r.candidate_source("m")._slots[0].valid_until)


def test_heartbeat_is_constant_time_in_fleet_size() -> None:
    """A heartbeat updates its node's slot in place: no per-model rebuild."""
    r = Registry(RID, lease_ttl_s=3.0, freshness_s=1.0, clock=lambda: 1000.0)
    for i in range(50):
        r.register(Registration(f"n{i}", "x:1", (ModelSpec("m"),), "i1"), i + 1)
    slots_before = r.candidate_source("m")._slots
    r.heartbeat("n7", 8, 1, 0, LoadReport(pending_prefill_tokens=5))
    assert r.candidate_source("m")._slots is slots_before
    (n7,) = [c for c in r.candidates("m") if c.node_id == "n7"]
    assert n7.report is not None and n7.report.pending_prefill_tokens == 5


def test_a_join_keeps_the_other_nodes_cached_candidates() -> None:
    r = Registry(RID, lease_ttl_s=3.0, freshness_s=1.0, clock=lambda: 1000.0)
    for i in range(3):
        r.register(Registration(f"n{i}", "x:1", (ModelSpec("m"),), "i1"), i + 1)
    before = {c.node_id: c for c in r.candidates("m")}
    r.register(Registration("n9", "x:1", (ModelSpec("m"),), "i1"), 10)
    after = {c.node_id: c for c in r.candidates("m")}
    assert set(after) == {"n0", "n1", "n2", "n9"}
    assert all(after[n] is before[n] for n in before)
    r.drain("n1")                                    # its entry changed: rebuilt
    assert {c.node_id: c for c in r.candidates("m")}["n1"].state is NodeState.DRAINING
