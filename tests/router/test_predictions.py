"""Prediction feedback (router.fleet.predictions): the per-node scale converges to the
observed / predicted TTFT ratio under a policy that applies it, ignores outliers, stays within
its bounds; errors are medians of what was predicted; drift shows; spans carry predictions."""

from __future__ import annotations

import math
import random

import pytest

from gpumesh.router.fleet.predictions import PredictionTracker, relative_error
from gpumesh.router.scheduling.types import Decision
from gpumesh.router.telemetry import decision_attributes


def decision(ttft: float | None, completion: float | None = None, *,
             scale: float = 0.0) -> Decision:
    return Decision("p", "n", 1, predicted_ttft_s=ttft, predicted_completion_s=completion,
                    prediction_scale=scale)


def run(tracker: PredictionTracker, node: str, raw_s: float, observed: list[float]) -> None:
    """A policy predicting ``raw_s`` scaled by the tracker's current scale, then the
    observation."""
    for obs in observed:
        scale = tracker.scale(node)
        tracker.observe(node, decision(raw_s * scale, scale=scale), ttft_s=obs)


def test_scale_converges_to_the_observed_ratio_and_errors_fall() -> None:
    t = PredictionTracker(window=16, min_samples=4)
    rng = random.Random(1)
    observed = [0.2 * (1 + rng.uniform(-0.05, 0.05)) for _ in range(40)]
    run(t, "slow", 0.1, observed[:3])
    assert t.scale("slow") == 1.0                    # fewer than min_samples: untouched
    run(t, "slow", 0.1, observed[3:])
    assert t.scale("slow") == pytest.approx(2.0, rel=0.05)
    s = t.stats("slow")
    assert s.samples == 16 and s.ttft_error_p50 < 0.06 and s.drifting   # 2x the profile
    assert t.scale("other") == 1.0 and t.stats("other").samples == 0


def test_one_outlier_does_not_move_the_scale_and_bounds_hold() -> None:
    t = PredictionTracker(window=9, min_samples=3, min_scale=0.25, max_scale=4.0)
    run(t, "n", 1.0, [1.0] * 8)
    assert t.scale("n") == pytest.approx(1.0)
    run(t, "n", 1.0, [60.0])                         # one request met a huge stall
    assert t.scale("n") == pytest.approx(1.0)
    assert not t.stats("n").drifting
    run(t, "n", 1.0, [100.0] * 20)
    assert t.scale("n") == 4.0                       # bounded
    run(t, "n", 1.0, [1e-4] * 40)
    assert t.scale("n") == 0.25


@pytest.mark.parametrize(("decided", "ttft", "completion", "samples", "completion_err"), [
    (decision(None, None), 0.1, 1.0, 0, 0.0),        # a policy that does not predict
    (decision(0.1, 1.0), None, None, 0, 0.0),        # nothing observed
    (decision(0.1, 1.0), 0.1, None, 1, 0.0),         # a stream's first chunk
    (decision(0.1, 1.0), None, 2.0, 0, 0.5),         # its end: completion only
    (decision(0.1, 1.0), float("nan"), -1.0, 0, 0.0),  # garbage observations are ignored
    (decision(0.0, 0.0), 0.1, 1.0, 0, 0.0),          # no usable prediction
])
def test_what_counts_as_an_observation(decided: Decision, ttft: float | None,
                                       completion: float | None, samples: int,
                                       completion_err: float) -> None:
    t = PredictionTracker()
    t.observe("n", decided, ttft_s=ttft, completion_s=completion)
    s = t.stats("n")
    assert s.samples == samples and s.completion_error_p50 == completion_err


def test_listeners_get_each_relative_error_and_forget_drops_history() -> None:
    t = PredictionTracker()
    seen: list[tuple[str, str, float]] = []
    t.add_listener(lambda n, k, e: seen.append((n, k, e)))
    t.observe("n", decision(0.1, 1.0), ttft_s=0.2)
    t.observe("n", decision(0.1, 1.0), completion_s=0.5)
    assert seen == [("n", "ttft", 0.5), ("n", "completion", 1.0)]
    assert relative_error(0.0, 0.0) == 0.0 and math.isfinite(relative_error(1.0, 0.0))
    t.forget("n")
    assert t.stats("n").samples == 0 and len(t) == 0


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        PredictionTracker(min_scale=2.0)
    with pytest.raises(ValueError):
        PredictionTracker(window=0)


def test_span_attributes_carry_the_prediction() -> None:
    attrs = decision_attributes(decision(0.25, 3.5), 0.1, 0.0)
    assert attrs["gpumesh.predicted_ttft_s"] == 0.25
    assert attrs["gpumesh.predicted_completion_s"] == 3.5
    plain = decision_attributes(decision(None, None), 0.1, 0.0)
    assert "gpumesh.predicted_ttft_s" not in plain
    assert "gpumesh.predicted_completion_s" not in plain


def test_a_node_not_chosen_for_a_while_takes_its_models_typical_scale() -> None:
    """A scale learned from a slow start must not lock a node out: once its samples are
    older than max_age_s it is predicted with the scale of the nodes that have recent ones
    (1.0 when none has), and its next observation is unscaled by the scale in effect."""
    now = [0.0]
    t = PredictionTracker(window=8, min_samples=2, max_age_s=30.0, clock=lambda: now[0])
    run(t, "cold", 0.1, [0.4] * 4)                   # its first requests: 4x the profile
    assert t.scale("cold") == pytest.approx(4.0)
    run(t, "warm", 0.1, [0.15] * 4)
    now[0] = 10.0
    assert t.scale("cold", 9.9) == pytest.approx(4.0)        # still its own: recent
    now[0] = 31.0                                    # cold's samples age out; warm's too
    assert t.typical_scale(["cold", "warm"]) == 1.0
    run(t, "warm", 0.1, [0.15] * 2)
    typical = t.typical_scale(["cold", "warm"])
    assert typical == pytest.approx(1.5)
    assert t.scale("cold", typical) == typical
    # cold is chosen again with the typical scale in effect: its new samples are unscaled by
    # that scale, and the old ones no longer count
    for _ in range(2):
        t.observe("cold", decision(0.1 * typical, scale=typical), ttft_s=0.12)
    assert t.scale("cold", typical) == pytest.approx(1.2)
