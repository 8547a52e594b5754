"""The router's prediction telemetry: what a predictive policy predicted, what happened, and
how far apart they were (on top of ``router.telemetry``'s spans and ``gpumesh.telemetry``).

Span attributes (on ``gpumesh.router.generate`` and each ``gpumesh.router.attempt``), for a
decision that carried a prediction for the chosen node:
``gpumesh.predicted_ttft_s`` / ``gpumesh.predicted_completion_s`` (seconds from the dispatch),
and, on the request span, what happened: ``gpumesh.observed_ttft_s`` (dispatch -> first
chunk) and ``gpumesh.observed_completion_s`` (dispatch -> the end of a request that
succeeded). The router learns from the difference (``router.fleet.predictions``).

Metric: the histogram ``gpumesh.router.prediction.error`` (|predicted - observed| / observed,
per ``node`` and ``kind`` "ttft" or "completion"), one sample per observation the prediction
feedback takes (``PredictionErrorMetric`` listens to the registry's ``PredictionTracker``).

Who calls it: ``router.telemetry`` (``predicted_attributes`` per decision,
``observed_attributes`` when a request's span ends, ``PredictionErrorMetric`` when the
router's telemetry is built).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from gpumesh import telemetry as gt

if TYPE_CHECKING:
    from gpumesh.router.fleet.predictions import PredictionTracker
    from gpumesh.router.scheduling.types import Decision

# relative prediction errors (0.1 = 10 %)
PREDICTION_ERROR_BUCKETS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)


def predicted_attributes(decision: Decision) -> dict[str, float]:
    """The decision's finite predictions for its chosen node, as span attributes (pure)."""
    attrs: dict[str, float] = {}
    for key, value in (("gpumesh.predicted_ttft_s", decision.predicted_ttft_s),
                       ("gpumesh.predicted_completion_s", decision.predicted_completion_s)):
        if value is not None and math.isfinite(value):
            attrs[key] = value
    return attrs


def observed_attributes(sent: float | None, first: float | None, end: float,
                        succeeded: bool) -> dict[str, Any]:
    """What the last attempt's node did, from its dispatch at ``sent`` (perf-counter seconds;
    None: no attempt), its first chunk at ``first`` (None: none) and the request's ``end``;
    completion only for a request that ``succeeded`` (pure)."""
    if sent is None or first is None or first < sent:
        return {}
    attrs: dict[str, Any] = {"gpumesh.observed_ttft_s": first - sent}
    if succeeded:
        attrs["gpumesh.observed_completion_s"] = end - sent
    return attrs


class PredictionErrorMetric:
    """The ``gpumesh.router.prediction.error`` histogram, fed by a ``PredictionTracker``'s
    listener (``attach``) or directly (``sample``)."""

    __slots__ = ("_record",)

    def __init__(self, metrics: gt.Metrics) -> None:
        self._record = metrics.histogram(
            "gpumesh.router.prediction.error", unit="1",
            description="Relative error |predicted - observed| / observed of the router's "
                        "predictions, per node and kind (ttft, completion)",
            buckets=PREDICTION_ERROR_BUCKETS)

    def attach(self, predictions: PredictionTracker) -> None:
        predictions.add_listener(self.sample)

    def sample(self, node_id: str, kind: str, error: float) -> None:
        """One relative prediction error (``router.fleet.predictions``' listener)."""
        self._record(error, {"node": node_id, "kind": kind})
