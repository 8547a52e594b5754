"""Registry membership and accounting, plus fleet-level routing behaviour over the registry's
snapshots with an injected clock and RNG (no servers)."""

from __future__ import annotations

import logging
import random
from collections import Counter

import grpc
import pytest

from gpumesh.router.errors import RouterError
from gpumesh.router.fleet import Registry
from gpumesh.router.scheduling import (
    Candidate,
    NodeState,
    RequestInfo,
    RoutingSettings,
    build_policy,
    default_filters,
    select,
)
from gpumesh.router.scheduling.policies import PredictedLatency
from gpumesh.types import LoadReport, ModelSpec, Registration, RouterAccount
from tests.clock import ManualClock

RID = "r1"


def predicted_ttft(c: Candidate) -> float:
    """The default policy's predicted time to first token of a 100-token request on ``c``."""
    return PredictedLatency(RoutingSettings()).predictions([c], RequestInfo("m", 100))[0].ttft_s


def reg(node_id: str, model: str = "m", *, weight: float = 1.0, incarnation: str = "i1",
        aliases: tuple[str, ...] = (), max_concurrency: int = 0) -> Registration:
    return Registration(node_id, f"{node_id}:1", (ModelSpec(model, aliases,
                                                                capacity_weight=weight),),
                            incarnation, max_concurrency=max_concurrency)


def make(clock: ManualClock, **kw) -> Registry:  # type: ignore[no-untyped-def]
    return Registry(RID, lease_ttl_s=kw.pop("lease_ttl_s", 3.0),
                    freshness_s=kw.pop("freshness_s", 1.0), clock=clock, **kw)


def hb(r: Registry, node_id: str, stream: int, seq: int, *, pending: int = 0, kv: float = 0.0,
       admitted: int = 0, first: int = 0, running: int = 0, draining: bool = False) -> bool:
    return r.heartbeat(node_id, stream, seq, 0,
                       LoadReport(num_running=running, pending_prefill_tokens=pending,
                                  kv_cache_usage=kv, draining=draining,
                                  router_accounts=(RouterAccount(RID, admitted, 0, first, 0),
                                                   RouterAccount("other-router", 99, 0, 99, 0))))


# ---------------------------------------------------------------- membership


def test_register_resolve_alias_and_empty_model() -> None:
    r = make(ManualClock())
    r.register(reg("a", "llama", aliases=("l",)), 1)
    assert r.resolve("llama") == "llama" and r.resolve("l") == "llama" and r.resolve("") == "llama"
    r.register(reg("b", "qwen"), 2)
    with pytest.raises(RouterError) as e:
        r.resolve("")
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(RouterError) as e:
        r.resolve("gpt")   # within a lease of the start: nodes may still be re-registering
    assert e.value.code is grpc.StatusCode.UNAVAILABLE and e.value.retry_after_s > 0
    r.clock.t += 3.0   # type: ignore[attr-defined]
    with pytest.raises(RouterError) as e:
        r.resolve("gpt")
    assert e.value.code is grpc.StatusCode.NOT_FOUND and "llama, qwen" in e.value.message


def test_seq_ordering_ignores_duplicates_and_out_of_order() -> None:
    c = ManualClock()
    r = make(c)
    r.register(reg("a"), 1)
    assert hb(r, "a", 1, 5, pending=50)
    assert not hb(r, "a", 1, 5, pending=999)   # duplicate
    assert not hb(r, "a", 1, 3, pending=999)   # out of order
    assert hb(r, "a", 1, 6, pending=60)
    (cand,) = r.candidates("m")
    assert cand.report is not None and cand.report.pending_prefill_tokens == 60


def test_heartbeat_from_another_stream_is_ignored() -> None:
    r = make(ManualClock())
    r.register(reg("a"), 1)
    assert not hb(r, "a", 2, 1)
    assert not hb(r, "zz", 1, 1)


def test_lease_expiry(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpumesh.router.fleet.registry")
    c = ManualClock()
    r = make(c, lease_ttl_s=3.0)
    r.register(reg("a"), 1)
    r.register(reg("b"), 2)
    hb(r, "a", 1, 1)
    c.t += 2.0
    hb(r, "b", 2, 1)
    c.t += 1.5   # a: 3.5 s since its heartbeat, b: 1.5 s
    assert [x.node_id for x in r.candidates("m")] == ["b"]   # excluded even before a sweep
    assert r.expire() == ["a"]
    assert len(r) == 1
    # a node that went silent is an operator's concern: WARNING, with how long it was silent
    (rec,) = [x for x in caplog.records if "removed" in x.getMessage()]
    assert rec.levelno == logging.WARNING
    assert "node a removed: lease expired (no heartbeat for 3.5s, lease 3.0s)" in rec.getMessage()
    c.t += 5
    assert r.expire() == ["b"]
    with pytest.raises(RouterError) as e:
        r.resolve("m")   # recently served: UNAVAILABLE, not NOT_FOUND
    assert e.value.code is grpc.StatusCode.UNAVAILABLE


def test_stream_break_removes_at_once_but_old_stream_cannot_remove_new() -> None:
    r = make(ManualClock())
    r.register(reg("a"), 1)
    r.register(reg("a"), 2)          # reconnected on a new stream
    r.stream_closed("a", 1)          # the old stream's close arrives late
    assert len(r) == 1
    r.stream_closed("a", 2)
    assert len(r) == 0


def test_deregister() -> None:
    r = make(ManualClock())
    r.register(reg("a"), 1)
    r.deregister("a", 1, "bye")
    assert len(r) == 0


def test_stale_and_draining_states() -> None:
    c = ManualClock()
    r = make(c, freshness_s=1.0)
    r.register(reg("a"), 1)
    r.register(reg("b"), 2)
    (a, _) = r.candidates("m")
    assert a.state is NodeState.STALE and a.report is None   # never reported
    hb(r, "a", 1, 1)
    hb(r, "b", 2, 1, draining=True)
    states = {x.node_id: x.state for x in r.candidates("m")}
    assert states == {"a": NodeState.HEALTHY, "b": NodeState.DRAINING}
    assert [m.capacity_weight for m in r.models()] == [1.0]   # draining not counted
    c.t += 1.5
    assert r.candidates("m")[0].state is NodeState.STALE


def test_incarnation_change_resets_accounting_same_incarnation_keeps_it() -> None:
    r = make(ManualClock())
    r.register(reg("a", incarnation="i1"), 1)
    r.charge("a", 100)
    r.stream_closed("a", 1)
    r.register(reg("a", incarnation="i1"), 2)     # reconnect: same counts
    assert r.ledger("a").in_flight == 1 and r.ledger("a").pending_tokens == 100
    r.register(reg("a", incarnation="i2"), 3)     # restarted: fresh ledger
    assert r.ledger("a").in_flight == 0 and r.ledger("a").pending_tokens == 0


def test_snapshots_are_replaced_not_mutated() -> None:
    r = make(ManualClock())
    r.register(reg("a"), 1)
    before = r.snapshot("m")
    hb(r, "a", 1, 1, pending=10)
    after = r.snapshot("m")
    assert before is not after and before.nodes[0].report is None
    assert after.nodes[0].report.load.pending_prefill_tokens == 10


def test_models_aggregate_capacity_and_nodes() -> None:
    r = make(ManualClock())
    r.register(reg("a", weight=1.0, aliases=("x",)), 1)
    r.register(reg("b", weight=2.0, aliases=("y",)), 2)
    r.register(reg("c", "other"), 3)
    ms = {m.name: m for m in r.models()}
    assert ms["m"].capacity_weight == 3.0 and ms["m"].node_ids == ("a", "b")
    assert set(ms["m"].aliases) == {"x", "y"} and ms["other"].node_ids == ("c",)


# ---------------------------------------------------------------- accounting


def test_credits_split_by_report_admitted_count() -> None:
    r = make(ManualClock())
    r.register(reg("a"), 1)
    credits = [r.charge("a", 100) for _ in range(5)]
    (c,) = r.candidates("m")
    assert (c.unreported_prompt_tokens, c.outstanding_prompt_tokens) == (500, 500)
    hb(r, "a", 1, 1, pending=300, admitted=3)   # the node has seen the first 3
    (c,) = r.candidates("m")
    assert (c.unreported_prompt_tokens, c.unreported_requests) == (200, 2)
    credits[4].first_token()                     # released one by one, at first tokens
    (c,) = r.candidates("m")
    assert (c.unreported_prompt_tokens, c.outstanding_prompt_tokens) == (100, 400)
    assert c.router_in_flight == 5               # the slot lasts until the stream ends
    credits[4].finish()
    assert r.candidates("m")[0].router_in_flight == 4


def test_rejected_requests_do_not_shift_the_cutoff() -> None:
    r = make(ManualClock())
    r.register(reg("a"), 1)
    c1 = r.charge("a", 10)
    r.charge("a", 10)
    c1.finish(admitted=False)                    # INVALID_ARGUMENT: the node never admitted it
    r.charge("a", 10)
    hb(r, "a", 1, 1, admitted=1)                 # = ordinal 2 (1 was rejected)
    (c,) = r.candidates("m")
    assert (c.unreported_requests, c.outstanding_requests) == (1, 2)


def test_ledger_syncs_to_counters_from_before_it_existed() -> None:
    r = make(ManualClock())
    r.register(reg("a"), 1)
    hb(r, "a", 1, 1, admitted=500, first=500)    # router restarted with the same id
    r.charge("a", 10)
    (c,) = r.candidates("m")
    assert c.unreported_requests == 1
    hb(r, "a", 1, 2, admitted=501)
    assert r.candidates("m")[0].unreported_requests == 0


def test_lookaside_credits_released_by_first_token_count_and_time() -> None:
    c = ManualClock()
    r = make(c, lease_ttl_s=10.0)
    r.register(reg("a"), 1)
    hb(r, "a", 1, 1)
    blind = [r.charge("a", 100, blind=True, hold_s=5.0, slot_until_finish=False)
             for _ in range(4)]
    proxy = r.charge("a", 100)
    proxy.first_token()
    assert r.ledger("a").pending_requests == 4 and r.ledger("a").in_flight == 5
    hb(r, "a", 1, 2, admitted=5, first=3)        # 1 proxy + 2 lookaside first tokens
    assert [b.pending for b in blind] == [False, False, True, True]   # oldest first, not all
    assert r.ledger("a").in_flight == 3
    c.t += 6.0                                   # time bound for the rest
    r.candidates("m")
    assert r.ledger("a").pending_requests == 0 and r.ledger("a").in_flight == 1


def _report(r: Registry, node: str, seq: int, running: int, admitted: int,
            finished: int | None) -> None:
    r.heartbeat(node, 1, seq, 0, LoadReport(num_running=running, router_accounts=(
                RouterAccount(RID, admitted, 0, admitted, 0, finished),)))


def test_finish_seen_after_the_report_that_holds_it_is_not_subtracted_twice() -> None:
    """10 requests running; one ends at the node, the node's next report (running 9) goes out
    before the router sees that request's stream end. With ``finished_requests`` the report
    says it holds 9 of ours, so once the router sees the finish D is 0 (the node has 9, as
    reported). Without it (an older node) the finish counts once in the report and once more
    as "since the report": D = -1, as before."""
    for finished, expect in ((1, 0), (None, -1)):
        r = make(ManualClock())
        r.register(reg("a"), 1)
        credits = [r.charge("a", 10) for _ in range(10)]
        for c in credits:
            c.first_token()
        _report(r, "a", 1, 10, 10, 0 if finished is not None else None)
        assert r.ledger("a").decode_delta() == 0
        _report(r, "a", 2, 9, 10, finished)       # the node already counts it finished
        credits[0].finish()                       # ... the router sees it only now
        assert r.ledger("a").decode_delta() == expect, finished
        credits[1].finish()                       # a finish after the report: once, both ways
        assert r.ledger("a").decode_delta() == expect - 1, finished
        r.charge("a", 10)                         # a dispatch since the report: +1
        assert r.ledger("a").decode_delta() == expect, finished


def test_decode_delta_with_finished_counts_is_in_flight_now_minus_held() -> None:
    """D = requests dispatched since the report + min(0, reported ones still in flight -
    (admitted - finished) at the report), for proxy requests in any order of admission,
    finish and report: a request the node had ended before the report but whose end the
    router has not seen yet is neither held nor a change."""
    r = make(ManualClock())
    r.register(reg("a"), 1)
    credits = [r.charge("a", 10) for _ in range(6)]
    credits[0].first_token()
    _report(r, "a", 1, 4, 4, 1)    # node: 4 admitted (1 of them already ended): holds 3
    assert r.ledger("a").decode_delta() == 2    # the 2 dispatched after it (not 6 - 3)
    credits[0].finish()            # the one it had ended
    credits[5].finish()            # one not yet admitted at the report (ended since)
    assert r.ledger("a").decode_delta() == 4 - 3
    _report(r, "a", 2, 3, 6, 2)
    assert r.ledger("a").decode_delta() == 4 - 4


def test_finished_counts_from_an_earlier_router_process_are_bounded() -> None:
    """The router restarted under the same id while its old requests still run on the node:
    the raw admitted - finished (10) includes requests this ledger never dispatched, so the
    held count is bounded by this router's own reported requests in flight; as the old ones
    end, the counts become exact again."""
    r = make(ManualClock())
    r.register(reg("a"), 1)
    _report(r, "a", 1, 10, 500, 490)
    credits = [r.charge("a", 10) for _ in range(3)]
    assert r.ledger("a").decode_delta() == 3       # not 3 - 10
    _report(r, "a", 2, 13, 503, 490)
    assert r.ledger("a").decode_delta() == 0       # held min(3, 13) = 3
    credits[0].finish()
    assert r.ledger("a").decode_delta() == -1
    _report(r, "a", 3, 2, 503, 501)                # old ones ended; 2 of ours held
    assert r.ledger("a").decode_delta() == 0


def test_lookaside_requests_keep_the_inferred_delta_with_finished_counts() -> None:
    """Lookaside requests are in the node's admitted - finished but their end is never seen
    by the router: with finished counts the estimate is the same as without them."""
    for finished in (0, None):
        r = make(ManualClock(), lease_ttl_s=10.0)
        r.register(reg("a"), 1)
        _report(r, "a", 1, 0, 0, finished)
        for _ in range(4):
            r.charge("a", 10, blind=True, hold_s=5.0, slot_until_finish=False)
        proxy = [r.charge("a", 10) for _ in range(3)]
        assert r.ledger("a").decode_delta() == 7
        _report(r, "a", 2, 7, 7, finished)         # first tokens: the lookaside credits go
        assert r.ledger("a").in_flight == 3 and r.ledger("a").decode_delta() == 0
        proxy[0].finish()
        assert r.ledger("a").decode_delta() == -1, finished


# ---------------------------------------------------------------- fleet behaviour


def _pick(r: Registry, rng: random.Random, policy: str = "predicted_latency") -> str:
    profile = _PROFILES.setdefault(policy, build_policy(RoutingSettings(policy=policy)))
    return select(profile, r.candidates("m"), RequestInfo("m", 100), rng,
                  default_filters(0.92)).node_id


_PROFILES: dict = {}


def test_double_weight_node_takes_twice_the_requests() -> None:
    c = ManualClock()
    r = make(c)
    r.register(reg("big", weight=2.0), 1)
    r.register(reg("small", weight=1.0), 2)
    hb(r, "big", 1, 1)
    hb(r, "small", 2, 1)
    rng = random.Random(5)
    # A burst from equal (idle) load: exactly 2:1.
    burst = Counter(_pick_and_charge(r, rng) for _ in range(300))
    assert burst == {"big": 200, "small": 100}


def test_double_weight_node_takes_twice_the_requests_in_steady_state() -> None:
    c = ManualClock()
    r = make(c)
    r.register(reg("big", weight=2.0), 1)
    r.register(reg("small", weight=1.0), 2)
    hb(r, "big", 1, 1)
    hb(r, "small", 2, 1)
    rng = random.Random(5)
    queues: dict[str, list] = {"big": [], "small": []}
    picks: Counter[str] = Counter()
    for step in range(300):
        for _ in range(3):                       # 3 arrivals per step ...
            n = _pick(r, rng)
            picks[n] += 1
            queues[n].append(r.charge(n, 100))
        for n, served in (("big", 2), ("small", 1)):   # ... served 2:1 by capacity
            for credit in queues[n][:served]:
                credit.first_token()
                credit.finish()
            del queues[n][:served]
    assert 1.9 <= picks["big"] / picks["small"] <= 2.1, picks
    assert max(len(q) for q in queues.values()) <= 4   # neither node builds a backlog


def _waits(r: Registry) -> dict[str, float]:
    return {c.node_id: predicted_ttft(c) for c in r.candidates("m")}


def test_burst_between_heartbeats_spreads_and_next_heartbeat_does_not_herd() -> None:
    c = ManualClock()
    r = make(c)
    nodes = ["a", "b", "c", "d"]
    for i, n in enumerate(nodes, 1):
        r.register(reg(n), i)
        hb(r, n, i, 1)
    rng = random.Random(11)
    credits: dict[str, list] = {n: [] for n in nodes}
    for _ in range(100):                          # no heartbeat arrives during the burst
        n = _pick(r, rng)
        credits[n].append(r.charge(n, 100))
    counts = {n: len(v) for n, v in credits.items()}
    assert all(24 <= v <= 26 for v in counts.values()), counts

    # Node "a" prefilled 10 of its requests (the router saw those first tokens as they came).
    # Then every node reports, each report taken before the last 2 requests reached it.
    for credit in credits["a"][:10]:
        credit.first_token()
    before = _waits(r)
    c.t += 0.25
    for i, n in enumerate(nodes, 1):
        done = 10 if n == "a" else 0
        hb(r, n, i, 2, admitted=counts[n] - 2, first=done,
           pending=(counts[n] - 2 - done) * 100)
    after = _waits(r)
    for n in nodes:                               # the report changes no node's estimate
        assert after[n] == pytest.approx(before[n]), (before, after)
    # The next wave: "a" makes up most of its 10-request prefill deficit (its 10 requests
    # past their first token still decode there), then the wave spreads evenly, no burst
    # onto the node whose report looks idlest.
    wave = Counter(_pick_and_charge(r, rng) for _ in range(50))
    assert 15 <= wave["a"] <= 20 and all(10 <= wave[n] <= 12 for n in "bcd"), wave


def _pick_and_charge(r: Registry, rng: random.Random) -> str:
    n = _pick(r, rng)
    r.charge(n, 100)
    return n


# Every node reports a different KV usage, and this router's requests are the only thing
# that changes.
KV_START = {"a": 0.50, "b": 0.55, "c": 0.60, "d": 0.65}


def _kv_burst(capacity: int) -> tuple[Registry, ManualClock, dict[str, list], random.Random]:
    c = ManualClock()
    r = make(c)
    for i, n in enumerate(KV_START, 1):
        r.register(reg(n), i)
        r.heartbeat(n, i, 1, 0, LoadReport(kv_cache_usage=KV_START[n],
                                           kv_capacity_tokens=capacity,
                                           router_accounts=(RouterAccount(RID, 0, 0, 0, 0),)))
    profile = build_policy(RoutingSettings(policy="predicted_latency"))
    rng = random.Random(3)
    credits: dict[str, list] = {n: [] for n in KV_START}
    for _ in range(100):                          # no heartbeat arrives during the burst
        n = select(profile, r.candidates("m"), RequestInfo("m", 100), rng,
                   default_filters(0.92)).node_id
        credits[n].append(r.charge(n, 100))
    return r, c, credits, rng


def test_a_burst_spreads_when_kv_capacity_is_unknown() -> None:
    """Without the node's KV capacity the prediction cannot see KV fill, but the queued
    prompt tokens of this router's burst still move every node's prediction: no herd."""
    _, _, credits, _ = _kv_burst(capacity=0)
    assert {n: len(v) for n, v in credits.items()} == {"a": 25, "b": 25, "c": 25, "d": 25}


def test_kv_bound_burst_spreads_and_next_heartbeat_does_not_herd() -> None:
    r, c, credits, rng = _kv_burst(capacity=20_000)
    counts = {n: len(v) for n, v in credits.items()}
    # Water-filling: the emptiest node takes the most, every node takes some, none all.
    assert counts["a"] > counts["b"] > counts["c"] > counts["d"] > 0, counts
    assert max(counts.values()) <= 50, counts
    k_eff = {x.node_id: predicted_ttft(x) for x in r.candidates("m")}
    # Levelled: a node's KV wait grows in steps of whole requests.
    assert max(k_eff.values()) - min(k_eff.values()) < 0.15, k_eff

    # Each node reports: its admitted requests now hold KV (prompt + the default output each,
    # as the router assumed), the last 2 not yet admitted. No node's estimate jumps.
    before = k_eff
    c.t += 0.25
    for i, n in enumerate(KV_START, 1):
        admitted = max(counts[n] - 2, 0)
        kv = KV_START[n] + admitted * (100 + 256) / 20_000   # prompt + output_tokens_default
        r.heartbeat(n, i, 2, 0, LoadReport(kv_cache_usage=kv, kv_capacity_tokens=20_000,
                                           pending_prefill_tokens=admitted * 100,
                                           router_accounts=(RouterAccount(RID, admitted, 0, 0,
                                                                          0),)))
    after = {x.node_id: predicted_ttft(x) for x in r.candidates("m")}
    for n in KV_START:
        assert after[n] == pytest.approx(before[n]), (before, after)
    profile = build_policy(RoutingSettings(policy="predicted_latency"))
    nxt: Counter[str] = Counter()
    for _ in range(40):
        n = select(profile, r.candidates("m"), RequestInfo("m", 100), rng,
                   default_filters(0.92)).node_id
        r.charge(n, 100)
        nxt[n] += 1
    assert max(nxt.values()) <= 15 and len(nxt) == 4, nxt          # spreads, no burst


def test_without_router_credits_a_stale_report_would_herd() -> None:
    """Control for the test above: least_request over the same fleet spreads only by count;
    the expected-wait profile also spreads (credits move before any heartbeat)."""
    c = ManualClock()
    r = make(c)
    for i, n in enumerate(["a", "b"], 1):
        r.register(reg(n), i)
    hb(r, "a", 1, 1, pending=0)
    hb(r, "b", 2, 1, pending=2000)               # b reported busy, a idle
    rng = random.Random(2)
    picks = Counter(_pick_and_charge(r, rng) for _ in range(60))
    # a absorbs most of b's 2000-token head start (20 requests), then they alternate.
    assert 33 <= picks["a"] <= 42 and picks["b"] >= 18, picks


def test_stale_node_scored_from_router_counts_only() -> None:
    c = ManualClock()
    r = make(c, freshness_s=1.0, lease_ttl_s=10.0)
    r.register(reg("a"), 1)
    r.register(reg("b"), 2)
    hb(r, "a", 1, 1, pending=50_000, kv=0.9)      # a reported very busy ... long ago
    c.t += 2.0
    hb(r, "b", 2, 1, pending=1000)
    cands = {x.node_id: x for x in r.candidates("m")}
    assert cands["a"].state is NodeState.STALE and cands["a"].report is None
    # the old report is ignored: an idle node's prediction (default step, 8,000 tokens/s)
    assert predicted_ttft(cands["a"]) == pytest.approx(1.5 * 0.02 + 100 / 8000)
    rng = random.Random(0)
    picks = Counter(_pick_and_charge(r, rng) for _ in range(20))
    # a: router's own 100-token credits; b: 1000 reported + credits -> a gets most of 20
    assert 12 <= picks["a"] <= 16, picks
