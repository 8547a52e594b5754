"""Fitting an engine profile's step model (gpumesh.profiles) to measurements.

:func:`fit_samples` fits ``a_ms``, ``b_decode_ms``, ``c_decode_ms``, ``b_prefill_ms``, the
context terms ``b_decode_context_ms`` and ``c_prefill_ms``, and ``request_overhead_ms`` jointly to decode and prefill samples by least squares on relative
residuals (each row weighted by 1 / measured, so that a 3 ms step and a 60 ms TTFT count
alike), with every coefficient kept >= 0 (a negative cost term is dropped and the rest
refitted). Rows:

- decode sample of batch B, each sequence L tokens long on average:
  ``step = a + b_decode * B + c_decode * B**2 + b_decode_context * B * L``;
- prefill sample of P prompt tokens, C of them cached: the uncached ``U = max(P - C, 1)``
  tokens run in ``n`` chunks of at most ``max_num_batched_tokens`` attending over ``Q``
  (token, earlier token) pairs in all, so
  ``ttft = request_overhead + n * a + b_prefill * U + c_prefill * Q``.

:func:`fit_steps` fits the step model alone to per-step observations
``(decode_tokens, prefill_tokens, step_ms)``; :class:`OnlineStepFit` fits it, as a running
engine goes, to busy spans of its steps (what a node reports as its ``StepModel``).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence

import numpy as np

from gpumesh.profiles import EngineProfile, Sample
from gpumesh.types import StepModel

# column order of the design matrix
COEFFS = ("a_ms", "b_decode_ms", "c_decode_ms", "b_prefill_ms", "request_overhead_ms",
          "b_decode_context_ms", "c_prefill_ms")


def nonneg_lstsq(x: np.ndarray, y: np.ndarray, free: list[bool]) -> np.ndarray:
    """Least squares of ``x @ c ~ y`` with ``c >= 0``: columns that come out negative are
    dropped one at a time (the most negative first); dropped and non-free columns are 0."""
    active = list(free)
    while True:
        cols = [i for i, on in enumerate(active) if on]
        coef = np.zeros(x.shape[1])
        if cols:
            sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            coef[cols] = sol
        worst = min(cols, key=lambda i: coef[i], default=None)
        if worst is None or coef[worst] >= 0:
            return coef
        active[worst] = False


def _row(s: Sample, base: EngineProfile) -> list[float]:
    if s.kind == "decode":
        b = float(s.batch)
        return [1.0, b, b * b, 0.0, 0.0, b * s.context_tokens, 0.0]
    chunks = base.prefill_chunks(s.prompt_tokens, s.cached_tokens)
    return [float(len(chunks)), 0.0, 0.0, float(sum(n for n, _ in chunks)), 1.0, 0.0,
            float(sum(p for _, p in chunks))]


def fit_samples(base: EngineProfile, samples: Sequence[Sample], *,
                quadratic: bool = True, context: bool = True) -> EngineProfile:
    """``base`` with its step model and ``request_overhead_ms`` fitted to the samples not
    ``held_out``, and ``samples`` recorded with each one's ``fit_ms`` (held-out ones
    predicted, not fitted). ``quadratic=False`` keeps ``c_decode_ms`` at 0, ``context=False``
    the context terms (``b_decode_context_ms``, ``c_prefill_ms``). Needs at least
    two decode batches and one prefill sample in the fit (``ValueError`` otherwise)."""
    used = [s for s in samples if not s.held_out]
    decode_batches = {s.batch for s in used if s.kind == "decode"}
    if len(decode_batches) < 2 or not any(s.kind == "prefill" for s in used):
        raise ValueError("the fit needs decode samples at >= 2 batch sizes and a prefill sample")
    x = np.array([_row(s, base) for s in used])
    y = np.array([s.measured_ms for s in used])
    w = 1.0 / y
    contexts = {s.context_tokens for s in used if s.kind == "decode"}
    free = [True, True, quadratic and len(decode_batches) >= 3, True, True,
            context and len(contexts) >= 2, context and bool(np.ptp(x[:, 6]) > 0)]
    coef = nonneg_lstsq(x * w[:, None], y * w, free)
    fitted = dataclasses.replace(base, **{k: float(round(v, 9)) for k, v in zip(COEFFS, coef)},
                                 samples=())
    if fitted.a_ms + fitted.b_decode_ms + fitted.b_prefill_ms <= 0:
        raise ValueError("the fit found no cost at all (are the samples all equal?)")
    rows = tuple(dataclasses.replace(s, fit_ms=round(fitted.predict(s), 4)) for s in samples)
    return dataclasses.replace(fitted, samples=rows)


def fit_steps(observations: Sequence[tuple[float, float, float]],
              quadratic: bool = False) -> tuple[float, float, float, float] | None:
    """``(a_ms, b_decode_ms, c_decode_ms, b_prefill_ms)`` fitted (relative residuals, every
    term >= 0) to ``(decode_tokens, prefill_tokens, step_ms)`` observations; None when they
    cannot separate the terms (fewer than 3, or one kind of step only)."""
    if len(observations) < 3:
        return None
    obs = np.asarray(observations, dtype=float)
    d, p, y = obs[:, 0], obs[:, 1], obs[:, 2]
    if np.any(y <= 0) or np.ptp(d) == 0 and np.ptp(p) == 0:
        return None
    x = np.column_stack([np.ones_like(d), d, d * d, p])
    w = 1.0 / y
    free = [True, bool(np.ptp(d) > 0), quadratic and len(np.unique(d)) >= 3,
            bool(np.ptp(p) > 0)]
    coef = nonneg_lstsq(x * w[:, None], y * w, free)
    return float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3])


class OnlineStepFit:
    """The step model of a running engine, fitted to its own recent steps (windowed least
    squares, linear: ``a_ms``, ``b_decode_ms``, ``b_prefill_ms``).

    ``step(now, busy, decode_tokens, prefill_tokens)`` is called when a step ends at ``now``
    (engine clock, seconds) with what it scheduled; ``busy`` = the previous step left
    requests running, so the interval since the previous call is this step's length. Busy
    steps are summed into spans of at least ``span_s`` seconds; a span is one observation
    ``(steps, decode tokens, prefill tokens) -> span ms`` (a span absorbs a stats reader's
    bursts, when it catches up with queued steps and timestamps them back to back). An idle
    gap closes the open span (kept if it is long enough). The fit uses the last ``window``
    spans, on relative errors, every term >= 0; a term whose tokens did not vary across the
    spans (say, no prefill seen) is reported as 0. ``model()`` is None until ``min_spans``
    spans; it is cached until the next span. O(1) per step; the fit O(window) per span.
    """

    def __init__(self, span_s: float = 0.25, window: int = 240, min_spans: int = 8) -> None:
        self._span_s = span_s
        self._min = min_spans
        self._spans: deque[tuple[int, int, int, float]] = deque(maxlen=window)
        self._last_t: float | None = None
        self._open = [0, 0, 0]    # steps, decode tokens, prefill tokens of the open span
        self._open_s = 0.0
        self._cached: StepModel | None = None
        self._dirty = False

    def step(self, now: float, busy: bool, decode_tokens: int, prefill_tokens: int) -> None:
        last, self._last_t = self._last_t, now
        if last is None or not busy or now < last:
            self._close(force=False)
            return
        o = self._open
        o[0] += 1
        o[1] += max(decode_tokens, 0)
        o[2] += max(prefill_tokens, 0)
        self._open_s += now - last
        if self._open_s >= self._span_s:
            self._close(force=True)

    def _close(self, force: bool) -> None:
        if self._open[0] and (force or self._open_s >= self._span_s):
            steps, dec, pre = self._open
            self._spans.append((steps, dec, pre, self._open_s * 1000.0))
            self._dirty = True
        self._open = [0, 0, 0]
        self._open_s = 0.0

    def model(self) -> StepModel | None:
        """The current fit (None until ``min_spans`` spans, or when they cannot be fitted)."""
        if not self._dirty:
            return self._cached
        self._dirty = False
        if len(self._spans) < self._min:
            return self._cached
        obs = np.asarray(self._spans, dtype=float)
        n, d, p, y = obs[:, 0], obs[:, 1], obs[:, 2], obs[:, 3]
        if np.any(y <= 0):
            return self._cached
        x = np.column_stack([n, d, p])
        w = 1.0 / y
        free = [True, bool(np.ptp(d / n) >= 1.0), bool(np.ptp(p / n) >= 1.0)]
        coef = nonneg_lstsq(x * w[:, None], y * w, free)
        rel = (x @ coef) / y - 1.0
        self._cached = StepModel(a_ms=float(coef[0]), b_decode_ms=float(coef[1]),
                                 b_prefill_ms=float(coef[2]), spans=len(self._spans),
                                 rms_error=float(np.sqrt(np.mean(rel * rel))))
        return self._cached
