"""The decode term in each node's own measured step time (router/scheduling/scorers.py).

With the prefill capacity as T, a running request costs ``decode_steps_per_request`` (1) of the
node's measured decode step (the running count averaged over reports / generation_tokens_per_s,
derived in ``Registry.heartbeat``) instead of the constant ``decode_s_per_request`` per unit of declared
weight; a node that never had a measurable step falls back to the constant.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from gpumesh.router.config import RouterConfig
from gpumesh.router.fleet import Registry
from gpumesh.router.fleet.speed import STEP_AVERAGE_S
from gpumesh.router.scheduling import (
    Candidate,
    NodeState,
    RequestInfo,
    WaitModel,
    build_profile,
    default_filters,
    expected_wait_s,
    select,
)
from gpumesh.types import LoadReport, ModelSpec, Registration, RouterAccount
from tests.clock import ManualClock

RID = "r1"
# Measured terms on (capacity T, step-time decode term), KV off so the decode term shows.
WM = WaitModel(reference_prompt_tokens_per_s=8000.0, kv_penalty_s=0.0,
               decode_s_per_request=0.002, prefill_from_capacity=True,
               decode_steps_per_request=1.0)


def registry(*nodes: tuple[str, float], from_report: bool = True) -> tuple[Registry, ManualClock]:
    clock = ManualClock()
    r = Registry(RID, lease_ttl_s=3.0, freshness_s=1.0, step_from_report=from_report,
                 clock=clock)
    for i, (node_id, weight) in enumerate(nodes, 1):
        r.register(Registration(node_id, f"{node_id}:1",
                                (ModelSpec("m", capacity_weight=weight),), "i1"), i)
    return r, clock


def beat(r: Registry, node_id: str, stream: int, seq: int, *, running: int = 0,
         gen: float = 0.0, capacity: float = 50_000.0, reported: float = 0.0) -> None:
    assert r.heartbeat(node_id, stream, seq, 0,
                       LoadReport(num_running=running, generation_tokens_per_s=gen,
                                  prefill_capacity_tokens_per_s=capacity,
                                  decode_step_s=reported,
                                  router_accounts=(RouterAccount(RID, 0, 0, 0, 0, 0),)))


def settle(r: Registry, clock: ManualClock, node_id: str, stream: int, seq: int, **kw: float) -> None:
    """A report long after the last one: the running average is then the reported count."""
    clock.t += 100.0
    beat(r, node_id, stream, seq, **kw)  # type: ignore[arg-type]


def candidate(r: Registry, node_id: str) -> Candidate:
    found = [c for c in r.candidates("m") if c.node_id == node_id]
    assert len(found) == 1
    return found[0]


def report(r: Registry, node_id: str) -> LoadReport:
    c = candidate(r, node_id)
    assert c.report is not None
    return c.report


def test_registry_derives_the_step_time_and_keeps_it_while_the_node_is_idle() -> None:
    r, clock = registry(("a", 1.0))
    beat(r, "a", 1, 1)                                    # never busy: not measured
    assert candidate(r, "a").step_s == 0.0
    settle(r, clock, "a", 1, 2, running=20, gen=2000.0)   # 20 tokens a step, 2000/s: 10 ms
    assert candidate(r, "a").step_s == pytest.approx(0.010)
    settle(r, clock, "a", 1, 3, running=0, gen=0.0)       # idle: the last measurement holds
    assert candidate(r, "a").step_s == pytest.approx(0.010)
    settle(r, clock, "a", 1, 4, running=10, gen=2000.0)   # re-measured: 5 ms
    assert candidate(r, "a").step_s == pytest.approx(0.005)


def test_a_reported_step_time_is_used_as_reported() -> None:
    """A node that times its own steps (LoadReport.decode_step_s) is taken at its word, in
    place of average running / rate (which would read 20 ms here, and swings when a wave of
    requests moves the count and the rate at different moments)."""
    r, clock = registry(("a", 1.0))
    settle(r, clock, "a", 1, 1, running=20, gen=1000.0, reported=0.008)
    assert candidate(r, "a").step_s == pytest.approx(0.008)
    clock.t += 0.25
    beat(r, "a", 1, 2, running=200, gen=1000.0, reported=0.009)   # no lag, no averaging
    assert candidate(r, "a").step_s == pytest.approx(0.009)
    clock.t += 0.25
    beat(r, "a", 1, 3, running=0, gen=0.0)       # an older node's report: inferred / kept
    assert candidate(r, "a").step_s == pytest.approx(0.009)
    # Off (RouterConfig.step_from_report): inferred from the same reports.
    r2, clock2 = registry(("a", 1.0), from_report=False)
    settle(r2, clock2, "a", 1, 1, running=20, gen=1000.0, reported=0.008)
    assert candidate(r2, "a").step_s == pytest.approx(0.020)


def test_step_from_report_is_a_router_setting() -> None:
    assert RouterConfig().step_from_report is True
    assert RouterConfig.load(env={"GPUMESH_ROUTER_STEP_FROM_REPORT": "0"}).step_from_report is False


def test_step_time_uses_the_running_count_averaged_like_the_rate() -> None:
    """The rate is a few seconds' average, so a momentary jump in the running count must not
    read as a slower step: the count is averaged over reports (time constant 2 s) first."""
    r, clock = registry(("a", 1.0))
    settle(r, clock, "a", 1, 1, running=4, gen=400.0)     # steady: 10 ms
    assert candidate(r, "a").step_s == pytest.approx(0.010)
    clock.t += 0.25
    beat(r, "a", 1, 2, running=20, gen=400.0)             # 5x the count 250 ms later
    w = 1 - math.exp(-0.25 / STEP_AVERAGE_S)
    assert candidate(r, "a").step_s == pytest.approx((4 + w * 16) / 400.0)   # ~14 ms, not 50


def test_faster_measured_step_gets_the_lower_wait_for_the_same_running_count() -> None:
    """Same declared weight, same running count, same capacity: only the measured step
    differs (5 ms vs 20 ms), and the faster node is cheaper and is picked. With the constant
    decode term the two tied."""
    r, clock = registry(("fast", 1.0), ("slow", 1.0))
    settle(r, clock, "fast", 1, 1, running=20, gen=4000.0)
    beat(r, "slow", 2, 1, running=20, gen=1000.0)
    fast, slow = candidate(r, "fast"), candidate(r, "slow")
    assert expected_wait_s(fast, WM) == pytest.approx(0.005 * 20)
    assert expected_wait_s(slow, WM) == pytest.approx(0.020 * 20)
    profile = build_profile("weighted_least_load", {"expected_wait": 1.0}, WM)
    picks = {select(profile, r.candidates("m"), RequestInfo("m", 32), random.Random(s),
                    default_filters(0.92)).node_id for s in range(20)}
    assert picks == {"fast"}


def test_measured_step_holds_the_speed_so_weight_does_not_divide_it() -> None:
    r, clock = registry(("a", 2.0))
    settle(r, clock, "a", 1, 1, running=10, gen=1000.0)   # 10 ms steps
    assert expected_wait_s(candidate(r, "a"), WM) == pytest.approx(0.010 * 10)


def cand(*, running: int, step_s: float = 0.0, capacity: float = 0.0, weight: float = 1.0,
         pending: int = 0, tps: float = 0.0) -> Candidate:
    load = LoadReport(num_running=running, pending_prefill_tokens=pending,
                      prompt_tokens_per_s=tps, prefill_capacity_tokens_per_s=capacity)
    return Candidate(node_id="n", address="n:1", state=NodeState.HEALTHY,
                     capacity_weight=weight, max_concurrency=0, report=load, report_age_s=0.1,
                     kv_cache_usage=0.0, router_in_flight=running,
                     outstanding_prompt_tokens=0, outstanding_requests=0,
                     unreported_prompt_tokens=0, unreported_requests=0, step_s=step_s)


@pytest.mark.parametrize("c, expected", [
    # capacity and a measured step: 800 / 40,000 s + one 10 ms step per running request
    (cand(running=10, step_s=0.010, capacity=40_000.0, pending=800), 0.02 + 0.1),
    # capacity, never a measured step (never busy): the constant per unit of weight
    (cand(running=10, capacity=40_000.0, weight=2.0), 0.002 * 10 / 2),
    # no capacity (a foreign node, a vLLM node before its first prefill): the floor formula,
    # a measured step notwithstanding
    (cand(running=10, step_s=0.010, pending=800, weight=2.0), (0.1 + 0.002 * 10) / 2),
    (cand(running=10, step_s=0.010, pending=800, tps=16_000.0), 0.05 + 0.002 * 10),
])
def test_fallbacks_without_a_capacity_or_a_measured_step(c: Candidate, expected: float) -> None:
    assert expected_wait_s(c, WM) == pytest.approx(expected)


def test_zero_steps_per_request_keeps_the_constant_decode_term() -> None:
    c = cand(running=10, step_s=0.010, capacity=40_000.0, weight=2.0)
    assert expected_wait_s(c, replace(WM, decode_steps_per_request=0.0)) == \
        pytest.approx(0.002 * 10 / 2)


def test_without_prefill_from_capacity_the_step_time_is_not_used() -> None:
    c = cand(running=10, step_s=0.010, capacity=40_000.0, pending=800)
    assert expected_wait_s(c, replace(WM, prefill_from_capacity=False)) == \
        pytest.approx(0.1 + 0.002 * 10)


def test_wait_model_defaults_are_the_router_config_defaults() -> None:
    cfg, wm = RouterConfig(router_id="x"), WaitModel()
    assert wm.prefill_from_capacity is cfg.prefill_from_capacity
    assert wm.decode_steps_per_request == cfg.decode_steps_per_request
    assert wm.decode_s_per_request == cfg.decode_s_per_request


def test_decode_steps_per_request_from_env_and_refused_below_zero() -> None:
    cfg = RouterConfig.load(env={"GPUMESH_ROUTER_DECODE_STEPS_PER_REQUEST": "0.25"})
    assert cfg.decode_steps_per_request == 0.25
    with pytest.raises(ValueError, match="decode_steps_per_request"):
        RouterConfig(router_id="x", decode_steps_per_request=-1.0)


def test_a_node_never_busy_takes_the_models_measured_speed_scaled_by_weight() -> None:
    """Two idle nodes, one measured (10 ms steps, 50k prompt tokens/s) and one never busy (a
    vLLM node reports no capacity before its first prefill): the unmeasured one is scored with
    the measured step and capacity (per its weight), not the floor and the 2 ms constant, so a
    burst does not all go to it (seen with two real vLLM nodes: 8 of 8 onto the unmeasured)."""
    r, clock = registry(("a", 1.0), ("b", 1.0), ("c", 2.0))
    beat(r, "b", 2, 1, capacity=0.0)
    beat(r, "c", 3, 1, capacity=0.0)
    assert candidate(r, "b").step_s == 0.0                       # nothing measured yet anywhere
    assert report(r, "b").prefill_capacity_tokens_per_s == 0.0
    settle(r, clock, "a", 1, 1, running=20, gen=2000.0)       # a: 10 ms steps
    settle(r, clock, "a", 1, 2, running=0, gen=0.0)           # and idle again
    beat(r, "b", 2, 2, capacity=0.0)
    beat(r, "c", 3, 2, capacity=0.0)
    assert candidate(r, "b").step_s == pytest.approx(0.010)
    assert report(r, "b").prefill_capacity_tokens_per_s == pytest.approx(50_000.0)
    assert candidate(r, "c").step_s == pytest.approx(0.005)      # declared twice as fast
    assert report(r, "c").prefill_capacity_tokens_per_s == pytest.approx(100_000.0)
    a, b = candidate(r, "a"), candidate(r, "b")
    for pending in (0, 3):
        assert expected_wait_s(replace(a, unreported_requests=pending,
                                       unreported_prompt_tokens=32 * pending), WM) == \
            pytest.approx(expected_wait_s(replace(b, unreported_requests=pending,
                                                  unreported_prompt_tokens=32 * pending), WM))
    settle(r, clock, "b", 2, 3, running=10, gen=2000.0, capacity=20_000.0)   # b's own: 5 ms
    assert candidate(r, "b").step_s == pytest.approx(0.005)
    assert report(r, "b").prefill_capacity_tokens_per_s == pytest.approx(20_000.0)
