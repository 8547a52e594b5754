"""``predicted_latency`` (the default): one prediction in seconds per candidate
(``scheduling.predictor``), the node chosen by the configured objective.

Objectives (``RoutingSettings.objective``), with ttft, completion and imposed the
predictor's and the SLO the request's ``ttft_slo_s`` (0 = none: every node meets it)::

    slo_then_completion  among the nodes whose ttft meets the SLO, the least
                         completion + imposed; if none meets it, the least ttft
    min_ttft             the least ttft
    max_slo_attainment   among the nodes that meet the SLO, the least ttft + imposed (the
                         delay the choice costs: the request's own wait and what it adds
                         to the node's running requests), then the least completion; if
                         none meets it, the least ttft (the default)

Prefix locality, sessions and adapters are inside the prediction (a holder's shorter
prefill, the session node's expected hit, a missing adapter's load time, the stall and the
eviction a miss imposes), so the objective compares like with like and no term undoes
another.

Determinism: predictions closer than their resolution (``SESSION_S`` seconds or ``SESSION_REL`` of
the best) keep a request on its session node; exact ties (``TIE_S``)
go to the node first in the request's rendezvous order
(``base.node_rank`` of ``base.request_key``), never to the RNG, so every router replica that
sees the same fleet state makes the same decision for it, and a key keeps its node while the
fleet is evenly loaded.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from types import MappingProxyType

from gpumesh.profiles import EngineProfile, builtin_names, builtin_profile
from gpumesh.router.scheduling.policies.base import kept_few, node_rank, request_key
from gpumesh.router.scheduling.predictor import (
    Prediction,
    best_held_tokens,
    output_tokens,
    predict,
    prefix_keeper,
    step_cost,
)
from gpumesh.router.scheduling.settings import RoutingSettings
from gpumesh.router.scheduling.types import Candidate, CandidateScore, Decision, RequestInfo

TIE_S = 1e-6     # predictions closer than this (seconds) are ties
SESSION_S = 5e-4     # the session node keeps a request whose prediction is within this
SESSION_REL = 0.02   # (seconds) or this fraction of the best: the prediction's resolution


def _within(x: float, best: float) -> bool:
    return x <= best + TIE_S


def _near(x: float, best: float) -> bool:
    return x <= best + max(SESSION_S, SESSION_REL * abs(best))


def builtin_profile_for(model: str) -> EngineProfile | None:
    """The built-in engine profile of ``model``: the one named so, else the first (by
    name) whose ``model`` is it, case-insensitive; None when none is."""
    key = model.lower()
    names = builtin_names()
    if key in names:
        return builtin_profile(key)
    for name in names:
        p = builtin_profile(name)
        if p.model.lower() == key:
            return p
    return None


def _cost(p: Prediction, objective: str, slo: float) -> tuple[int, float, float]:
    """The sort key of ``p`` under ``objective`` (smaller is better)."""
    meets = 0 if slo <= 0 or p.ttft_s <= slo else 1
    if objective == "min_ttft":
        return 0, p.ttft_s, 0.0
    if meets:
        return 1, p.ttft_s, 0.0
    if objective == "max_slo_attainment":
        return 0, p.ttft_s + p.imposed_s, p.completion_s
    return 0, p.completion_s + p.imposed_s, 0.0


class PredictedLatency:
    name = "predicted_latency"
    samplable = True
    deterministic = True

    def __init__(self, settings: RoutingSettings,
                 profiles: Callable[[str], EngineProfile | None] = builtin_profile_for) -> None:
        self.settings = settings
        self._profiles = profiles
        self._by_model: dict[str, EngineProfile | None] = {}

    def profile(self, model: str) -> EngineProfile | None:
        if model not in self._by_model:
            if len(self._by_model) > 4096:
                self._by_model.clear()
            self._by_model[model] = self._profiles(model)
        return self._by_model[model]

    def predictions(self, candidates: Sequence[Candidate],
                    request: RequestInfo) -> list[Prediction]:
        """Every candidate's prediction for ``request``, in the candidates' order."""
        s = self.settings
        profile = self.profile(request.model)
        out = output_tokens(request, s.output_tokens_default, s.output_tokens_cap)
        best = best_held_tokens(request)
        keeper = prefix_keeper(candidates, request, best)
        return [predict(c, request, step_cost(c, profile), out=out, best_held=best,
                        out_default=s.output_tokens_default, adapter_load_s=s.adapter_load_s,
                        keeper=keeper)
                for c in candidates]

    def pick(self, candidates: Sequence[Candidate], request: RequestInfo,
             rng: random.Random) -> Decision:
        if not candidates:
            raise ValueError("a pick needs at least one candidate")
        preds = self.predictions(candidates, request)
        objective = self.settings.objective
        slo = request.ttft_slo_s or self.settings.ttft_slo_s
        costs = [_cost(p, objective, slo) for p in preds]
        group = min(k[0] for k in costs)
        first = min(k[1] for k in costs if k[0] == group)
        close = [i for i, k in enumerate(costs) if k[0] == group and _within(k[1], first)]
        second = min(costs[i][2] for i in close)
        tied = [i for i in close if _within(costs[i][2], second)]
        session = [j for j, c in enumerate(candidates) if request.session_node
                   and c.node_id == request.session_node and costs[j][0] == group
                   and _near(costs[j][1], first) and _near(costs[j][2], second)]
        if session:   # the session's node, when its prediction is as good as resolution tells
            i = session[0]
        else:
            key = request_key(request)
            i = min(tied, key=lambda j: node_rank(key, candidates[j].node_id))
        chosen, p = candidates[i], preds[i]
        totals = [-(k[0] * 1e9 + k[1]) for k in costs]
        pred_of = {id(c): q for c, q in zip(candidates, preds)}
        total_of = {id(c): t for c, t in zip(candidates, totals)}
        considered = tuple(_score(c, pred_of[id(c)], total_of[id(c)])
                           for c in kept_few(candidates, totals, chosen))
        return Decision(self.name, chosen.node_id, len(candidates), considered,
                        tie_size=len(tied), predicted_ttft_s=p.ttft_s,
                        predicted_completion_s=p.completion_s,
                        prediction_scale=chosen.prediction_scale)


def _score(c: Candidate, p: Prediction, total: float) -> CandidateScore:
    """A kept candidate's prediction for the span (seconds; ``total`` = minus its cost)."""
    return CandidateScore(c.node_id, total, MappingProxyType(
        {"ttft_s": p.ttft_s, "completion_s": p.completion_s, "imposed_s": p.imposed_s}),
        expected_wait_s=p.ttft_s)
