"""A node's speed as the scorers read it: its decode step time and prefill capacity.

``estimate_step_s`` derives the step time from each accepted report (the registry stores it on
``Report.step_s``). ``ModelSpeeds`` remembers, per model, the latest speed a node measured, so
that a node which has measured nothing yet is scored at that speed scaled by its capacity
weight rather than at the router's floor and constants (those differ several-fold from a real
node's terms, so of two idle nodes, one measured and one not, a burst would all go to the
unmeasured one). How the step time enters a prediction: router/scheduling/predictor.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from gpumesh.types import LoadReport, ModelSpec

if TYPE_CHECKING:
    from gpumesh.router.fleet.entries import Report

# Time constant (seconds) of the running-count average. A node's generation rate covers its
# last few seconds; an exponential average with this constant has about the same mean age,
# so average running / rate is a step time.
STEP_AVERAGE_S = 2.0


def estimate_step_s(load: LoadReport, previous: Report | None, now: float,
                    from_report: bool = True) -> tuple[float, float]:
    """``(step_s, running_avg)`` for a report received at ``now`` (registry clock, seconds).

    ``step_s`` is the node's decode step time in seconds: its own timing (``decode_step_s``,
    the mean interval between its engine's recent steps) where it reports one and
    ``from_report``; otherwise inferred from each running request sampling one token a step:
    step = running / generation rate. The rate is an average over the node's last few seconds
    while ``num_running`` is the count at the report, and their ratio swings widely when a
    node runs a few requests, so the running count is averaged over reports first
    (``running_avg``, time constant ``STEP_AVERAGE_S``). A report without a rate keeps the
    previous step (an idle node keeps its last measured speed); 0 = never measured."""
    if previous is None:
        avg = float(load.num_running)
        prev_step = 0.0
    else:
        w = 1.0 - math.exp(-max(now - previous.received_at, 0.0) / STEP_AVERAGE_S)
        avg = previous.running_avg + w * (load.num_running - previous.running_avg)
        prev_step = previous.step_s
    g = load.generation_tokens_per_s
    if from_report and load.decode_step_s > 0:
        step = load.decode_step_s
    else:
        step = avg / g if g > 0 and avg > 0 else prev_step
    return step, avg


class ModelSpeeds:
    """Per model name, from the latest node that measured them, per unit of its capacity
    weight: its decode step x weight and its prefill capacity / weight."""

    __slots__ = ("_ref",)

    def __init__(self) -> None:
        self._ref: dict[str, tuple[float, float]] = {}   # (step x weight, capacity / weight)

    def observe(self, models: Iterable[ModelSpec], step_s: float,
                prefill_capacity_tokens_per_s: float) -> None:
        """A node serving ``models`` measured these (0 = not measured: the reference keeps
        its previous value)."""
        if step_s <= 0 and prefill_capacity_tokens_per_s <= 0:
            return
        for m in models:
            step, cap = self._ref.get(m.name, (0.0, 0.0))
            w = max(m.capacity_weight, 1e-9)
            self._ref[m.name] = (
                step_s * w if step_s > 0 else step,
                prefill_capacity_tokens_per_s / w if prefill_capacity_tokens_per_s > 0 else cap)

    def fill(self, load: LoadReport, step_s: float, spec: ModelSpec
             ) -> tuple[LoadReport, float]:
        """``(load, step_s)`` with the model's reference step / capacity scaled by this node's
        weight where the node has not measured its own."""
        step, cap = self._ref.get(spec.name, (0.0, 0.0))
        w = max(spec.capacity_weight, 1e-9)
        if step_s <= 0 and step > 0:
            step_s = step / w
        if load.prefill_capacity_tokens_per_s <= 0 and cap > 0:
            load = replace(load, prefill_capacity_tokens_per_s=cap * w)
        return load, step_s
