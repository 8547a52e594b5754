"""The step model a node fits online (gpumesh.profile_fit.OnlineStepFit) from its engine's
per-step stats (the vLLM stats adapter), its trip through the heartbeat, and the router's
check of it."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from gpumesh import wire
from gpumesh.node.engines.vllm.stats import LoadStatLogger
from gpumesh.profile_fit import OnlineStepFit, fit_steps
from gpumesh.types import LoadReport, StepModel
from gpumesh.v1 import control_pb2 as cpb

A, BD, BP = 4.0, 0.15, 0.02   # the engine's true step model, ms


def _steps(n: int, seed: int = 0, noise: float = 0.0) -> list[tuple[int, int, float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = rng.randint(1, 64)
        p = rng.choice((0, 0, 0, rng.randint(16, 1500)))
        out.append((d, p, (A + BD * d + BP * p) * (1 + rng.uniform(-noise, noise))))
    return out


def test_online_fit_recovers_the_step_model() -> None:
    fit = OnlineStepFit(span_s=0.05, min_spans=8)
    t = 0.0
    fit.step(t, False, 0, 0)   # the first step's start is unknown
    assert fit.model() is None
    for d, p, ms in _steps(600, noise=0.05):
        t += ms / 1000
        fit.step(t, True, d, p)
    m = fit.model()
    assert m is not None and m.spans >= 8
    assert m.a_ms == pytest.approx(A, rel=0.1)
    assert m.b_decode_ms == pytest.approx(BD, rel=0.1)
    assert m.b_prefill_ms == pytest.approx(BP, rel=0.1)
    assert 0 <= m.rms_error < 0.05


def test_idle_gaps_are_not_steps_and_a_constant_term_is_not_guessed() -> None:
    fit = OnlineStepFit(span_s=0.02, min_spans=4)
    t = 0.0
    for i in range(400):
        # a 10 s idle gap before every 20th step: an interval that is no step
        busy = i % 20 != 0
        t += (A + BD * 8) / 1000 if busy else 10.0
        fit.step(t, busy, 8, 0)
    m = fit.model()
    assert m is not None
    # 8 decode tokens in every step, no prefill: only the total is identified, as a_ms
    assert (m.b_decode_ms, m.b_prefill_ms) == (0.0, 0.0)
    assert m.a_ms == pytest.approx(A + BD * 8, rel=1e-6)


def test_fit_steps_per_step_observations() -> None:
    got = fit_steps(_steps(200, seed=3))
    assert got is not None
    a, bd, c, bp = got
    assert (a, bd, c, bp) == pytest.approx((A, BD, 0.0, BP), rel=1e-6, abs=1e-9)
    assert fit_steps([(1, 0, 3.0), (1, 0, 3.0)]) is None


def _sched(running: int) -> SimpleNamespace:
    return SimpleNamespace(num_running_reqs=running, num_waiting_reqs=0,
                           num_skipped_waiting_reqs=0, kv_cache_usage=0.1,
                           prefix_cache_stats=None)


def _iter(gen: int, prompt: int) -> SimpleNamespace:
    return SimpleNamespace(num_generation_tokens=gen,
                           prompt_token_stats=SimpleNamespace(computed=prompt))


def test_vllm_stats_adapter_reports_the_fit() -> None:
    now = [100.0]
    s = LoadStatLogger(clock=lambda: now[0], fit_span_s=0.05)
    assert s.snapshot().step_model is None
    s.record(_sched(0), _iter(0, 0))   # idle before: the next interval is no step
    for d, p, ms in _steps(800, seed=5):
        now[0] += ms / 1000
        s.record(_sched(d), _iter(d, p))
    m = s.snapshot().step_model
    assert m is not None
    assert (m.a_ms, m.b_decode_ms, m.b_prefill_ms) == pytest.approx((A, BD, BP), rel=0.05)


def test_vllm_stats_adapter_reports_the_mean_output_of_finished_requests() -> None:
    now = [100.0]
    s = LoadStatLogger(clock=lambda: now[0])
    assert s.snapshot().output_tokens_mean == 0.0
    done = [SimpleNamespace(num_generation_tokens=n) for n in (10, 30)]
    s.record(_sched(2), SimpleNamespace(**vars(_iter(2, 0)), finished_requests=done))
    assert s.snapshot().output_tokens_mean == pytest.approx(20.0)
    now[0] += 31.0      # kept while none finish; the next finish replaces the older ones
    s.record(_sched(1), SimpleNamespace(**vars(_iter(1, 0)), finished_requests=[]))
    assert s.snapshot().output_tokens_mean == pytest.approx(20.0)
    s.record(_sched(1), SimpleNamespace(**vars(_iter(1, 0)),
                                        finished_requests=[SimpleNamespace(num_generation_tokens=50)]))
    assert s.snapshot().output_tokens_mean == pytest.approx(50.0)


def test_step_model_rides_the_heartbeat_and_the_router_checks_it() -> None:
    from gpumesh.router.fleet.validation import InvalidNodeInput, NodeLimits, valid_load

    report = LoadReport(num_running=3, step_model=StepModel(4.0, 0.15, 0.02, 40, 0.03),
                        output_tokens_mean=42.5)
    msg = wire.load_report_to_proto(report)
    assert wire.load_report_from_proto(msg) == report
    assert wire.load_report_from_proto(wire.load_report_to_proto(LoadReport())).step_model is None
    assert valid_load(msg, NodeLimits()).step_model == report.step_model
    bad = cpb.LoadReport()
    bad.CopyFrom(msg)
    bad.step_model.a_ms = float("nan")
    with pytest.raises(InvalidNodeInput, match="step_model.a_ms"):
        valid_load(bad, NodeLimits())
    bad.step_model.a_ms = -1.0
    with pytest.raises(InvalidNodeInput, match="step_model.a_ms"):
        valid_load(bad, NodeLimits())


@pytest.mark.vllm
async def test_the_real_engine_reports_its_fitted_step_model(vllm_engine: object) -> None:
    """A busy real engine (the session's tiny vLLM CPU engine) fits its step model from its
    own per-step stats: after a few seconds of mixed prefill and decode it reports one whose
    prediction of its mean decode step is within a factor of two of the measured figure."""
    import asyncio

    from gpumesh.node.engines.base import EngineRequest, Sampling

    engine = vllm_engine
    rng = random.Random(7)

    async def one(i: str) -> None:
        n = rng.choice((8, 64, 200))
        req = EngineRequest(f"fit-{i}", tuple(rng.randrange(10, 500) for _ in range(n)),
                            Sampling(max_tokens=rng.choice((32, 96)), temperature=0.0,
                                     ignore_eos=True))
        async for _ in engine.generate(req):  # type: ignore[attr-defined]
            pass

    loop = asyncio.get_running_loop()
    # three streams back to back, so the engine stays busy (a fit's spans are busy stretches
    # of at least 0.25 s): at least 4 s, longer (up to 30 s) until the fit has its 8 spans
    t_min, t_max = loop.time() + 4.0, loop.time() + 30.0

    async def stream(k: int) -> None:
        j = 0
        while loop.time() < t_min or (engine.load().step_model is None  # type: ignore[attr-defined]
                                      and loop.time() < t_max):
            await one(f"{k}-{j}")
            j += 1

    await asyncio.gather(*(stream(k) for k in range(3)))
    load = engine.load()  # type: ignore[attr-defined]
    m = load.step_model
    assert m is not None, load
    assert m.spans >= 8 and m.a_ms > 0 and m.rms_error < 1.0, m
    # the decode step the engine timed (mean over its last 3 s, about 3 sequences decoding)
    predicted = (m.a_ms + m.b_decode_ms * max(load.num_running, 3)) / 1000
    assert 0.5 < predicted / load.decode_step_s < 2.0, (m, load.decode_step_s)
    # the mean output of its finished requests, from vLLM's finished-request stats (other
    # tests' requests on the shared engine may count too: only that it is measured)
    assert load.output_tokens_mean > 0, load
