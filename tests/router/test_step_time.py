"""Each node's measured decode step (``Candidate.step_s``: the node's own timing, or the running
count averaged over reports / generation_tokens_per_s, derived in ``Registry.heartbeat``) and
how the prediction uses it where a node has no fitted step model (scheduling.predictor's
"measured" step cost).
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
    RequestInfo,
    RoutingSettings,
    build_policy,
    default_filters,
    select,
)
from gpumesh.router.scheduling.predictor import predict, step_cost
from gpumesh.types import LoadReport, ModelSpec, Registration, RouterAccount
from tests.clock import ManualClock

RID = "r1"


def wait(c: Candidate) -> float:
    """The predicted time to first token of a one-token request on ``c`` (measured source:
    the node's step and prefill capacity, scheduling.predictor)."""
    return predict(c, RequestInfo("m", 1), step_cost(c, None), out=1, best_held=0,
                   out_default=256, adapter_load_s=1.0).ttft_s


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
    # Off (RouterConfig.membership.step_from_report): inferred from the same reports.
    r2, clock2 = registry(("a", 1.0), from_report=False)
    settle(r2, clock2, "a", 1, 1, running=20, gen=1000.0, reported=0.008)
    assert candidate(r2, "a").step_s == pytest.approx(0.020)


def test_step_from_report_is_a_router_setting() -> None:
    assert RouterConfig().membership.step_from_report is True
    env = {"GPUMESH_ROUTER_MEMBERSHIP__STEP_FROM_REPORT": "0"}
    assert RouterConfig.load(env=env).membership.step_from_report is False


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
    assert wait(fast) == pytest.approx(1.5 * 0.005 + 1 / 50_000)   # the measured step's
    assert wait(slow) == pytest.approx(1.5 * 0.020 + 1 / 50_000)
    profile = build_policy(RoutingSettings(policy="predicted_latency"))
    picks = {select(profile, r.candidates("m"), RequestInfo("m", 32), random.Random(s),
                    default_filters(0.92)).node_id for s in range(20)}
    assert picks == {"fast"}


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
        assert wait(replace(a, unreported_requests=pending,
                            unreported_prompt_tokens=32 * pending)) == \
            pytest.approx(wait(replace(b, unreported_requests=pending,
                                       unreported_prompt_tokens=32 * pending)))
    settle(r, clock, "b", 2, 3, running=10, gen=2000.0, capacity=20_000.0)   # b's own: 5 ms
    assert candidate(r, "b").step_s == pytest.approx(0.005)
    assert report(r, "b").prefill_capacity_tokens_per_s == pytest.approx(20_000.0)
