"""Prediction feedback: how far each node's predicted times are from what happened.

A predictive policy puts the chosen node's predicted time to first token and to the last token
on its ``Decision`` (seconds from the decision, already multiplied by that node's
``Candidate.prediction_scale``). The dispatcher reports what it then observed on the node
(``PredictionTracker.observe``: the time from the dispatch to the first chunk of a stream, and
to its end or the unary answer), and the tracker keeps per node:

- ``scale``: the node's observed / predicted TTFT ratio, what the registry puts into
  ``Candidate.prediction_scale`` so the policy's next predictions for the node come out right.
  Each sample is the ratio against the unscaled prediction (the prediction divided by the scale
  in effect), clipped to [``min_scale``, ``max_scale``]; the scale is the median of the last
  ``window`` samples from the last ``max_age_s`` seconds (an outlier, such as one request
  that met a long prefill, moves it by nothing), always within the clip bounds. A node with
  fewer than ``min_samples`` samples from the last ``max_age_s`` seconds — new, or not
  chosen for a while — takes the median scale of the model's nodes that have them (1.0 when
  none has): a scale learned from a slow start (an engine's first requests, a burst) never
  locks a node out, since a node the policy stops choosing gets no samples to correct it.
- ``ttft_error_p50`` / ``completion_error_p50``: the median absolute relative error
  |predicted - observed| / observed of the last ``window`` predictions as they were made (0.2
  = 20 %): how good the predictions the policy acted on were.
- ``drifting``: enough samples and a scale outside [1/``drift_scale``, ``drift_scale``] or a
  TTFT error above ``drift_error``: the profile no longer describes the node (``gpumesh
  status`` marks it).

Listeners (``add_listener``) get every sample's relative error, ``(node_id, kind, error)``
with kind "ttft" or "completion": the router's telemetry records them in a histogram.

Who calls it: the dispatcher (``observe``, on the event loop, in the same step as the credit
change that makes the node's cached candidate rebuild, so the next decision reads the new
scale), the registry (``scale`` when it builds a candidate, ``forget`` when a node leaves),
``GetFleet`` (``stats``). A policy that does not predict leaves both predictions None: nothing
is recorded. Requests the router does not see through (lookaside Pick) and unary calls' TTFT
are not observed.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gpumesh.router.scheduling.types import Decision
from gpumesh.status import DRIFT_ERROR, DRIFT_SCALE

# (node id, "ttft" | "completion", |predicted - observed| / observed)
ErrorListener = Callable[[str, str, float], None]

MIN_OBSERVED_S = 1e-3   # relative errors are taken against at least a millisecond


@dataclass(frozen=True)
class PredictionStats:
    """One node's prediction quality (``PredictionTracker.stats``)."""

    scale: float                 # observed / predicted TTFT (1.0 until min_samples)
    ttft_error_p50: float        # 0 = no sample
    completion_error_p50: float  # 0 = no sample
    samples: int                 # TTFT samples in the window
    drifting: bool


class _Node:
    __slots__ = ("completion_errors", "log_ratios", "scale", "stamps", "ttft_errors")

    def __init__(self, window: int) -> None:
        self.log_ratios: deque[float] = deque(maxlen=window)
        self.stamps: deque[float] = deque(maxlen=window)   # when each log ratio was taken
        self.ttft_errors: deque[float] = deque(maxlen=window)
        self.completion_errors: deque[float] = deque(maxlen=window)
        self.scale = 1.0


def relative_error(predicted_s: float, observed_s: float) -> float:
    """|predicted - observed| / observed (observed taken as at least ``MIN_OBSERVED_S``)."""
    return abs(predicted_s - observed_s) / max(observed_s, MIN_OBSERVED_S)


def _usable(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


@dataclass(slots=True, eq=False, kw_only=True)
class PredictionTracker:
    """Per-node prediction feedback (module docstring). Not thread-safe: the router's event
    loop owns it; listeners run on it too."""

    window: int = 32
    min_samples: int = 4
    min_scale: float = 0.25
    max_scale: float = 4.0
    max_age_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    drift_scale: float = DRIFT_SCALE
    drift_error: float = DRIFT_ERROR
    _nodes: dict[str, _Node] = field(init=False, default_factory=dict)
    _listeners: list[ErrorListener] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if (not 0 < self.min_scale <= 1.0 <= self.max_scale or self.window < 1
                or self.min_samples < 1):
            raise ValueError("need 0 < min_scale <= 1 <= max_scale, window and "
                             "min_samples >= 1")

    def add_listener(self, cb: ErrorListener) -> None:
        self._listeners.append(cb)

    # --- the dispatcher's hook --------------------------------------------------------

    def observe(self, node_id: str, decision: Decision, *, ttft_s: float | None = None,
                completion_s: float | None = None) -> None:
        """What happened on ``node_id`` after ``decision`` sent a request there: the seconds
        from the dispatch to its first output (``ttft_s``) and to its end
        (``completion_s``); either may be None (not observed). Called once per observation
        (a stream calls it at its first chunk and again at its end)."""
        if _usable(ttft_s) and _usable(decision.predicted_ttft_s):
            assert ttft_s is not None and decision.predicted_ttft_s is not None
            self._ttft(node_id, decision.predicted_ttft_s, ttft_s, decision.prediction_scale)
        if _usable(completion_s) and _usable(decision.predicted_completion_s):
            assert completion_s is not None and decision.predicted_completion_s is not None
            err = relative_error(decision.predicted_completion_s, completion_s)
            self._node(node_id).completion_errors.append(err)
            self._tell(node_id, "completion", err)

    def _ttft(self, node_id: str, predicted_s: float, observed_s: float,
              in_effect: float) -> None:
        n = self._node(node_id)
        err = relative_error(predicted_s, observed_s)
        n.ttft_errors.append(err)
        # against the unscaled prediction: the policy multiplied it by the scale in effect
        # (the decision's; the node's own where a decision does not say)
        ratio = observed_s * (in_effect if in_effect > 0 else n.scale) / predicted_s
        ratio = min(max(ratio, self.min_scale), self.max_scale)
        n.log_ratios.append(math.log(ratio))
        now = self.clock()
        n.stamps.append(now)
        recent = [r for r, at in zip(n.log_ratios, n.stamps) if at >= now - self.max_age_s]
        if len(recent) >= self.min_samples:
            n.scale = min(max(math.exp(statistics.median(recent)), self.min_scale),
                          self.max_scale)
        self._tell(node_id, "ttft", err)

    def _tell(self, node_id: str, kind: str, err: float) -> None:
        for cb in self._listeners:
            cb(node_id, kind, err)

    def _node(self, node_id: str) -> _Node:
        n = self._nodes.get(node_id)
        if n is None:
            n = self._nodes[node_id] = _Node(self.window)
        return n

    # --- reads ------------------------------------------------------------------------

    def scale(self, node_id: str, fallback: float = 1.0, now: float | None = None) -> float:
        """The node's ``Candidate.prediction_scale``: its own while it has ``min_samples``
        samples from the last ``max_age_s`` seconds (as of ``now``, default the clock), else
        ``fallback`` (``typical_scale`` of its model's nodes)."""
        n = self._nodes.get(node_id)
        if n is None:
            return fallback
        return n.scale if self._current(n, self.clock() if now is None else now) else fallback

    def typical_scale(self, node_ids: Iterable[str]) -> float:
        """The median own scale of those of ``node_ids`` that have recent samples (1.0 when
        none has): what a node without them is predicted with."""
        now = self.clock()
        own = [n.scale for k in node_ids
               if (n := self._nodes.get(k)) is not None and self._current(n, now)]
        return statistics.median(own) if own else 1.0

    def _current(self, n: _Node, now: float) -> bool:
        """``n`` has ``min_samples`` samples from the last ``max_age_s`` seconds."""
        k = self.min_samples
        return len(n.stamps) >= k and n.stamps[-k] >= now - self.max_age_s

    def stats(self, node_id: str) -> PredictionStats:
        n = self._nodes.get(node_id)
        if n is None:
            return PredictionStats(1.0, 0.0, 0.0, 0, False)
        ttft = statistics.median(n.ttft_errors) if n.ttft_errors else 0.0
        completion = statistics.median(n.completion_errors) if n.completion_errors else 0.0
        enough = len(n.log_ratios) >= self.min_samples
        drifting = enough and (not 1 / self.drift_scale <= n.scale <= self.drift_scale
                               or ttft > self.drift_error)
        return PredictionStats(n.scale, ttft, completion, len(n.log_ratios), drifting)

    def forget(self, node_id: str) -> None:
        """The node left the fleet: its history goes with it."""
        self._nodes.pop(node_id, None)

    def __len__(self) -> int:
        return len(self._nodes)
