"""The simulator's engine step times against the bare-engine H200 calibration (raw vLLM,
one H200, CUDA graphs: decode step = elapsed / 256 of B requests decoding together; prefill =
one request's TTFT over the prompt length). The fleet simulator's default shape must match the
decode steps within 10 % and the prefill cost per prompt token (the slope) within 10 %."""

from __future__ import annotations

import pytest

from gpumesh.node.engines.sim import SimEngineConfig
from gpumesh.node.engines.sim.scheduler import SimScheduler

BATCHES = (1, 8, 32, 128, 256, 512)
DECODE_MS = {"0.5b-h200": (2.74, 3.07, 3.70, 6.94, 10.99, 18.98),
             "7b-h200": (4.75, 4.92, 5.29, 6.64, 10.23, 19.89)}
PROMPTS = (128, 512, 2048, 4096, 8192)
PREFILL_TTFT_MS = {"0.5b-h200": (14.4, 15.5, 41.7, 42.4, 65.2),
                   "7b-h200": (16.1, 18.6, 53.6, 105.1, 207.0)}


@pytest.mark.parametrize("shape", sorted(DECODE_MS))
def test_decode_steps_within_10_percent(shape: str) -> None:
    s = SimScheduler(SimEngineConfig.for_shape(shape))
    for b, ms in zip(BATCHES, DECODE_MS[shape]):
        sim_ms = s.step_time_s(b, 0) * 1000
        assert abs(sim_ms / ms - 1) <= 0.10, (shape, b, sim_ms, ms)


@pytest.mark.parametrize("shape", sorted(PREFILL_TTFT_MS))
def test_prefill_slope_within_10_percent(shape: str) -> None:
    """The measured TTFT carries a fixed front-end cost the step model does not (about 12 ms
    at 128 tokens), so the check is on the cost per prompt token between the extremes."""
    s = SimScheduler(SimEngineConfig.for_shape(shape))
    ms = PREFILL_TTFT_MS[shape]
    measured = (ms[-1] - ms[0]) / (PROMPTS[-1] - PROMPTS[0])
    sim = (s.step_time_s(0, PROMPTS[-1]) - s.step_time_s(0, PROMPTS[0])) * 1000 / (
        PROMPTS[-1] - PROMPTS[0])
    assert abs(sim / measured - 1) <= 0.10, (shape, sim, measured)


def test_node_measured_shapes_are_not_the_bare_engine() -> None:
    """The 0.5b default (fitted through a gpumesh node) is ~20 % below the bare engine's
    decode steps: the reason the simulator defaults to the -h200 shapes."""
    s = SimScheduler(SimEngineConfig.for_shape("0.5b"))
    assert s.step_time_s(128, 0) * 1000 < 0.85 * 6.94
