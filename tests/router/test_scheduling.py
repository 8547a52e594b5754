"""Table-driven tests of filters, scorers and profiles over in-memory candidates (injected RNG)."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import pytest

from gpumesh.router.scheduling import (
    Candidate,
    NodeState,
    RequestInfo,
    WaitModel,
    build_profile,
    default_filters,
    expected_wait_s,
    scorers,
    select,
)
from gpumesh.router.scheduling.filters import healthy, kv_below
from gpumesh.router.scheduling.profiles import NoCandidate
from gpumesh.types import LoadReport

WM = WaitModel(reference_prompt_tokens_per_s=1000.0, kv_penalty_s=0.25, kv_usage_cap=0.98,
               decode_s_per_request=0.0, wait_scale_s=0.5)
REQ = RequestInfo("m", 100)
WEIGHTS = {"expected_wait": 1.0, "kv_headroom": 0.0, "least_request": 0.0}


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


@pytest.mark.parametrize("c, expected", [
    (cand(), 0.0),
    (cand(pending=1000), 1.0),                      # 1000 tokens at the 1000 tok/s floor
    (cand(pending=1000, tps=4000), 0.25),           # measured throughput above the floor
    (cand(pending=1000, tps=10), 1.0),              # tiny measured throughput -> floor
    (cand(pending=500, unreported=500), 1.0),       # report + router's unreported credits
    (cand(pending=1000, weight=2.0), 0.5),          # capacity weight divides the whole
    (cand(kv=0.5), 0.25),                           # c * k / (1 - k) = 0.25 * 1
    (cand(kv=1.0), 0.25 * 0.98 / 0.02),             # k capped
    (cand(stale=True, pending=0, outstanding=2000, unreported=0), 2.0),  # router counts only
])
def test_expected_wait(c: Candidate, expected: float) -> None:
    assert expected_wait_s(c, WM) == pytest.approx(expected)


@pytest.mark.parametrize("c, expected", [
    (cand(pending=1000, capacity=8000), 0.125),             # capacity replaces the floor ...
    (cand(pending=1000, capacity=8000, tps=100), 0.125),    # ... and the observed rate
    (cand(pending=1000, capacity=500), 2.0),                # a slow node's, below the floor
    (cand(pending=1000, capacity=500, tps=2000), 0.5),      # never below its own throughput
    (cand(pending=500, unreported=500, capacity=4000), 0.25),
    (cand(stale=True, outstanding=2000, capacity=8000), 2.0),  # stale: router counts, floor
    # The capacity holds the node's speed, so w divides only the other terms.
    (cand(pending=1000, capacity=8000, kv=0.5, weight=2.0), 0.125 + 0.25 / 2),
    (cand(pending=1000, kv=0.5, weight=2.0), (1.0 + 0.25) / 2),   # no capacity: w divides all
])
def test_expected_wait_divides_prompt_tokens_by_reported_prefill_capacity(
        c: Candidate, expected: float) -> None:
    assert expected_wait_s(c, replace(WM, prefill_from_capacity=True)) == pytest.approx(expected)


def test_reported_prefill_capacity_is_ignored_when_switched_off() -> None:
    # prefill_from_capacity on by default; off, the floor decides T and the weight divides all.
    assert WM.prefill_from_capacity
    off = replace(WM, prefill_from_capacity=False)
    assert expected_wait_s(cand(pending=1000, capacity=500), off) == pytest.approx(1.0)
    assert expected_wait_s(cand(pending=1000, capacity=8000, kv=0.5, weight=2.0), off) == \
        pytest.approx((1.0 + 0.25) / 2)


def test_prefill_capacity_makes_short_prompts_cheaper_than_the_decode_term() -> None:
    # docs/benchmarks.md section 8: 32-token prompts against the 8000 tok/s floor cost 4 ms
    # each, twice the 2 ms a finish gives back; with a node's capacity (160k) it is 0.2 ms.
    wm = WaitModel(reference_prompt_tokens_per_s=8000.0, decode_s_per_request=0.002,
                   kv_penalty_s=0.0, prefill_from_capacity=True)
    floor = cand(unreported=32, unreported_n=1, tps=300.0)
    known = cand(unreported=32, unreported_n=1, tps=300.0, capacity=160_000.0)
    assert expected_wait_s(floor, wm) == pytest.approx(0.004 + 0.002)
    assert expected_wait_s(known, wm) == pytest.approx(0.0002 + 0.002)


def test_decode_term_counts_running_and_unreported() -> None:
    wm = replace(WM, decode_s_per_request=0.01)
    assert expected_wait_s(cand(running=3, unreported_n=2), wm) == pytest.approx(0.05)
    assert expected_wait_s(cand(stale=True, in_flight=4), wm) == pytest.approx(0.04)


@pytest.mark.parametrize("wait, score", [(0.0, 1.0), (0.5, 0.5), (1.5, 0.25), (1e9, 0.0)])
def test_wait_score_curve(wait: float, score: float) -> None:
    assert scorers.wait_score(wait, WM) == pytest.approx(score, abs=1e-6)


@pytest.mark.parametrize("c, score", [
    (cand(kv=0.0), 1.0), (cand(kv=0.25), 0.75), (cand(kv=1.0), 0.0)])
def test_kv_headroom_curve(c: Candidate, score: float) -> None:
    assert scorers.kv_headroom(c) == pytest.approx(score)


@pytest.mark.parametrize("c, score", [
    (cand(in_flight=0), 1.0), (cand(in_flight=1), 0.5), (cand(in_flight=2, weight=2.0), 0.5),
    (cand(in_flight=3), 0.25)])
def test_least_request_curve(c: Candidate, score: float) -> None:
    assert scorers.least_request(c) == pytest.approx(score)


def test_scores_stay_in_unit_interval() -> None:
    rng = random.Random(7)
    for _ in range(500):
        c = cand(pending=rng.randrange(10**6), kv=rng.random(), tps=rng.random() * 1e5,
                 in_flight=rng.randrange(100), weight=rng.uniform(0.1, 8))
        for s in (scorers.wait_score(expected_wait_s(c, WM), WM), scorers.kv_headroom(c),
                  scorers.least_request(c)):
            assert 0.0 <= s <= 1.0


# ---------------------------------------------------------------- filters


def test_kv_filter_avoids_full_node_while_others_have_room() -> None:
    cs = [cand("a", kv=0.95), cand("b", kv=0.5), cand("c", kv=0.2)]
    kept, dropped = kv_below(0.92)(cs)
    assert [c.node_id for c in kept] == ["b", "c"] and "a" in dropped
    profile = build_profile("weighted_least_load", WEIGHTS, WM)
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
    profile = build_profile("least_request", WEIGHTS, WM)
    with pytest.raises(NoCandidate) as e:
        select(profile, [cand("a", state=NodeState.DRAINING)], REQ, random.Random(0),
               default_filters(0.92))
    assert not e.value.busy
    with pytest.raises(NoCandidate) as e:
        select(profile, [cand("a", max_concurrency=1, in_flight=1)], REQ, random.Random(0),
               default_filters(0.92))
    assert e.value.busy


# ---------------------------------------------------------------- policies


@pytest.mark.parametrize("policy", ["weighted_least_load", "least_request", "power_of_two",
                                    "round_robin"])
def test_tie_break_is_fair(policy: str) -> None:
    profile = build_profile(policy, WEIGHTS, WM)
    cs = [cand(f"n{i}") for i in range(4)]
    rng = random.Random(42)
    n = 4000
    picks = Counter(select(profile, cs, REQ, rng, default_filters(0.92)).node_id
                    for _ in range(n))
    assert set(picks) == {c.node_id for c in cs}
    for count in picks.values():
        assert abs(count - n / 4) < 0.1 * n / 4, picks


def test_decision_keeps_raw_scores() -> None:
    profile = build_profile("weighted_least_load",
                            {"expected_wait": 1.0, "kv_headroom": 0.5, "least_request": 0.0}, WM)
    d = select(profile, [cand("a", pending=1000), cand("b", kv=0.5)], REQ, random.Random(0),
               default_filters(0.92))
    by_node = {s.node_id: s for s in d.considered}
    assert d.node_id == "b" and d.policy == "weighted_least_load" and d.candidates == 2
    # expected_wait_s is the wait alone; the score is of the wait plus the request's own
    # service (its 100 prompt tokens at the 1000 tokens/s floor: 0.1 s)
    assert by_node["a"].expected_wait_s == pytest.approx(1.0)
    assert by_node["a"].scores["expected_wait"] == pytest.approx(1 / (1 + 1.1 / 0.5))
    assert by_node["b"].scores["kv_headroom"] == pytest.approx(0.5)
    assert by_node["b"].total == pytest.approx(1 / (1 + 0.35 / 0.5) + 0.25)


def test_power_of_two_prefers_less_loaded_of_sample() -> None:
    profile = build_profile("power_of_two", WEIGHTS, WM)
    cs = [cand("busy", in_flight=10), cand("idle")]
    picks = Counter(select(profile, cs, REQ, random.Random(3), ()).node_id for _ in range(50))
    assert picks == {"idle": 50}


def test_least_request_honours_weight() -> None:
    profile = build_profile("least_request", WEIGHTS, WM)
    d = select(profile, [cand("big", weight=2.0, in_flight=3), cand("small", in_flight=2)], REQ,
               random.Random(0), ())
    assert d.node_id == "big"   # 3/2 < 2/1


def test_expected_wait_is_finite_and_monotone_in_pending() -> None:
    waits = [expected_wait_s(cand(pending=p, kv=0.3), WM) for p in range(0, 10_000, 500)]
    assert all(math.isfinite(w) for w in waits)
    assert waits == sorted(waits)


# ---------------------------------------------------------------- KV usage moved by credits


def kv_cand(kv: float, capacity: int, unreported: int, unreported_n: int,
            stale: bool = False) -> Candidate:
    c = cand(kv=kv, unreported=unreported, unreported_n=unreported_n, stale=stale)
    if c.report is not None:
        c = replace(c, report=replace(c.report, kv_capacity_tokens=capacity))
    return c


KV_WM = replace(WM, kv_output_allowance_tokens=100)


@pytest.mark.parametrize("c, k_eff", [
    (kv_cand(0.5, 0, 4000, 4), 0.5),                 # capacity unknown: the report alone
    (kv_cand(0.5, 10_000, 0, 0), 0.5),               # nothing unreported
    (kv_cand(0.5, 10_000, 1000, 1), 0.61),           # + (1000 + 100) / 10000
    (kv_cand(0.5, 10_000, 4000, 10), 1.0),           # + (4000 + 1000) / 10000
    (kv_cand(0.7, 10_000, 9000, 3, stale=True), 0.7),  # stale: last known, no credits
])
def test_effective_kv_usage(c: Candidate, k_eff: float) -> None:
    assert scorers.effective_kv_usage(c, KV_WM) == pytest.approx(k_eff)


@pytest.mark.parametrize("c, kv_term", [
    (kv_cand(0.5, 0, 4000, 4), 0.25 * 0.5 / 0.5),
    (kv_cand(0.5, 10_000, 1000, 1), 0.25 * 0.61 / 0.39),
    (kv_cand(0.5, 10_000, 4000, 10), 0.25 * 0.98 / 0.02),   # capped at kv_usage_cap
])
def test_expected_wait_uses_effective_kv(c: Candidate, kv_term: float) -> None:
    prefill = (c.report.pending_prefill_tokens + c.unreported_prompt_tokens) / 1000.0
    assert expected_wait_s(c, KV_WM) == pytest.approx(prefill + kv_term)


def test_kv_headroom_moves_with_credits_when_given_the_model() -> None:
    c = kv_cand(0.5, 10_000, 1000, 1)
    assert scorers.kv_headroom(c) == pytest.approx(0.5)
    assert scorers.kv_headroom(c, KV_WM) == pytest.approx(0.39)


def speed_cand(node_id: str, *, step_s: float, capacity: float, pending: int = 0,
               running: int = 0, weight: float = 1.0) -> Candidate:
    return replace(cand(node_id, pending=pending, running=running, capacity=capacity,
                        weight=weight), step_s=step_s)


@pytest.mark.parametrize("c, req, expected", [
    # measured: prompt / capacity + min(out, cap) x the node's step
    (speed_cand("a", step_s=0.01, capacity=1000.0), RequestInfo("m", 100, output_tokens=50),
     0.1 + 0.5),
    (speed_cand("a", step_s=0.02, capacity=500.0), RequestInfo("m", 100, output_tokens=50),
     0.2 + 1.0),
    # output above the cap counts as the cap (1024)
    (speed_cand("a", step_s=0.001, capacity=1000.0), RequestInfo("m", 0, output_tokens=5000),
     1.024),
    # unknown output (0): the prompt alone
    (speed_cand("a", step_s=0.01, capacity=1000.0), RequestInfo("m", 100), 0.1),
    # capacity but no step measured: decode_s_per_request / w per token
    (speed_cand("a", step_s=0.0, capacity=1000.0, weight=2.0),
     RequestInfo("m", 100, output_tokens=10), 0.1 + 10 * 0.004 / 2),
    # no report (STALE): the floor and the constant, over w
    (replace(cand("a", stale=True, weight=2.0), step_s=0.01),
     RequestInfo("m", 100, output_tokens=10), (100 / 1000 + 10 * 0.004) / 2),
])
def test_expected_service_s(c: Candidate, req: RequestInfo, expected: float) -> None:
    wm = replace(WM, decode_s_per_request=0.004, output_weight=1.0,
                 service_step_from_weight=False)
    assert scorers.expected_service_s(c, wm, req) == pytest.approx(expected)


def test_expected_service_s_defaults() -> None:
    """By default the output term is at the node's declared speed (decode_s_per_request / w,
    not its load-dependent measured step) and weighs output_weight of the whole."""
    wm = replace(WM, decode_s_per_request=0.004)
    assert wm.service_step_from_weight and wm.output_weight == 0.6
    req = RequestInfo("m", 100, output_tokens=50)
    for step in (0.001, 0.05):
        c = speed_cand("a", step_s=step, capacity=1000.0, weight=2.0)
        assert scorers.expected_service_s(c, wm, req) == pytest.approx(
            0.1 + 0.6 * 50 * 0.004 / 2)


def test_expected_admission_s() -> None:
    """A node whose report had requests waiting: (still waiting + unreported + 1) x output x
    step / running; 0 once the reported waiting ones have had their first tokens."""
    base = replace(speed_cand("a", step_s=0.01, capacity=1000.0, running=10),
                   report=LoadReport(num_running=10, num_waiting=4,
                                     prefill_capacity_tokens_per_s=1000.0))
    req = RequestInfo("m", 10, output_tokens=100)
    c = replace(base, outstanding_requests=6, unreported_requests=1)
    assert scorers.expected_admission_s(c, WM, req) == pytest.approx((4 + 1 + 1) * 100 * 0.01
                                                                      / 10)
    drained = replace(base, outstanding_requests=1, unreported_requests=1)
    assert scorers.expected_admission_s(drained, WM, req) == 0.0
    idle = replace(c, report=replace(c.report, num_waiting=0))
    assert scorers.expected_admission_s(idle, WM, req) == 0.0


@pytest.mark.parametrize("output_tokens, service_weight, expected", [
    (1, 1.0, "slow"),      # a one-token request takes the shorter queue
    (500, 1.0, "fast"),    # a long generation goes where it decodes faster
    (500, 0.0, "slow"),    # service term off: the wait alone decides
])
def test_service_time_sends_long_outputs_to_fast_nodes(output_tokens: int, service_weight: float,
                                                      expected: str) -> None:
    # the slow node is idle, the fast one has a short queue (0.05 s of prefill)
    fast = speed_cand("fast", step_s=0.005, capacity=20_000.0, pending=1000)
    slow = speed_cand("slow", step_s=0.02, capacity=5_000.0)
    wm = replace(WM, service_weight=service_weight, output_weight=1.0,
                 service_step_from_weight=False)
    profile = build_profile("weighted_least_load", WEIGHTS, wm)
    d = select(profile, [fast, slow], RequestInfo("m", 32, output_tokens=output_tokens),
               random.Random(0), default_filters(0.92))
    assert d.node_id == expected


def test_prefix_holder_wins_over_in_flight_count_in_the_default_blend() -> None:
    """With the default weights (least_request 8) a request whose 2,000-token prefix node
    ``holder`` has cached goes there although it has one more request in flight; without a
    cached prefix the in-flight count decides."""
    profile = build_profile("weighted_least_load",
                            {"expected_wait": 1.0, "kv_headroom": 0.0, "least_request": 8.0}, WM)
    cs = [cand("holder", in_flight=2), cand("other", in_flight=1)]
    plain = RequestInfo("m", 2000)
    cached = RequestInfo("m", 2000, cached_tokens={"holder": 1984})
    assert select(profile, cs, plain, random.Random(0), ()).node_id == "other"
    assert select(profile, cs, cached, random.Random(0), ()).node_id == "holder"


def test_expected_miss_s() -> None:
    """The prefill of the part of the longest held prefix a node lacks, at its capacity, times
    (1 + its running requests); 0 on the node holding it and when no node holds any."""
    req = RequestInfo("m", 3000, cached_tokens={"holder": 2000, "part": 500})
    holder = speed_cand("holder", step_s=0.01, capacity=1000.0, running=9)
    part = speed_cand("part", step_s=0.01, capacity=1000.0, running=3)
    other = speed_cand("other", step_s=0.01, capacity=4000.0, running=1)
    assert scorers.expected_miss_s(holder, WM, req) == 0.0
    assert scorers.expected_miss_s(part, WM, req) == pytest.approx(1500 / 1000 * (1 + 3))
    assert scorers.expected_miss_s(other, WM, req) == pytest.approx(2000 / 4000 * (1 + 1))
    assert scorers.expected_miss_s(other, WM, RequestInfo("m", 3000)) == 0.0
    # a held prefix longer than the prompt counts as the prompt
    short = RequestInfo("m", 100, cached_tokens={"holder": 2000})
    assert scorers.expected_miss_s(other, WM, short) == pytest.approx(100 / 4000 * 2)
    # no capacity reported (or prefill_from_capacity off): the floor over the weight
    floor = cand("floor", running=4, weight=2.0)
    assert scorers.expected_miss_s(floor, WM, req) == pytest.approx(2000 / 1000 / 2 * 5)
    # no report: this router's in-flight requests stand for the running ones
    stale = cand("stale", stale=True, in_flight=3)
    assert scorers.expected_miss_s(stale, WM, req) == pytest.approx(2000 / 1000 * 4)


def test_miss_price_keeps_a_busy_holder() -> None:
    """A holder with more requests running than an idle node keeps the request once a miss is
    priced by the batch it stalls (miss_weight), and loses it without; without any held
    prefix the price is 0 and the choice is the same either way."""
    holder = speed_cand("holder", step_s=0.01, capacity=20_000.0, running=12)
    idle = speed_cand("idle", step_s=0.01, capacity=20_000.0, running=2)
    cached = RequestInfo("m", 2000, cached_tokens={"holder": 1984})
    picks = {}
    for mw in (0.0, 1.0):
        profile = build_profile("weighted_least_load", WEIGHTS, replace(WM, miss_weight=mw))
        picks[mw] = [select(profile, [holder, idle], r, random.Random(0), ()).node_id
                     for r in (cached, RequestInfo("m", 2000))]
    assert picks[0.0] == ["idle", "idle"]
    assert picks[1.0] == ["holder", "idle"]


def test_wait_model_from_config_takes_every_field() -> None:
    from gpumesh.router.config import RouterConfig

    cfg = RouterConfig(miss_weight=0.5, output_weight=0.3, kv_penalty_s=0.1)
    wm = WaitModel.from_config(cfg)
    assert (wm.miss_weight, wm.output_weight, wm.kv_penalty_s) == (0.5, 0.3, 0.1)
