"""Request-dependent terms on top of the load profile: session affinity and LoRA adapters.

``Steered`` wraps the ``weighted_least_load`` profile (``profiles.WeightedLeastLoad``). For a
request that names neither a known session (``RequestInfo.session_node``) nor an adapter it
is that profile, unchanged (same totals, same picks, same memoisation); with
``affinity_weight`` 0 a session node is dropped from the request first, so a request with a
routing key is placed exactly as one without. Otherwise each
candidate's total is the profile's total plus::

    w_affinity * session_affinity(n)   +   w_adapter * adapter(n)

(``scorers.affinity``, ``scorers.adapter``; weights ``session_affinity`` and ``adapter`` from
``RouterConfig.scorer_weights``), the max wins with the profile's tie-break, and the raw
scores of both terms join the kept candidates' scores (the trace span shows them).

Profiles without per-candidate totals (least_request, power_of_two, round_robin) are not
wrapped: they ignore sessions and adapter loading (the ``serves_adapter`` filter still keeps
an adapter request on nodes that can serve it; see ``request_filters``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from gpumesh.router.scheduling.filters import Filter
from gpumesh.router.scheduling.profiles import Profile, _choose
from gpumesh.router.scheduling.scorers.adapter import adapter_score, serves_adapter
from gpumesh.router.scheduling.scorers.affinity import affinity_bound
from gpumesh.router.scheduling.types import Candidate, CandidateScore, Decision, RequestInfo


@dataclass(frozen=True)
class SteeringModel:
    """The request terms' parameters (from ``RouterConfig``)."""

    affinity_weight: float = 1.0
    epsilon: float = 0.25            # affinity_epsilon
    adapter_weight: float = 1.0
    adapter_load_s: float = 1.0      # assumed load time where a node measured none
    wait_scale_s: float = 0.5        # the expected-wait score's scale, shared by the adapter's


def request_filters(request: RequestInfo) -> tuple[Filter, ...]:
    """Filters that depend on the request: ``serves_adapter`` for an adapter request."""
    return (serves_adapter(request.adapter),) if request.adapter else ()


class Steered:
    """A profile with the request terms added (module doc). ``inner`` must have per-candidate
    ``total(c, request)`` and ``score(c, request)`` (``WeightedLeastLoad``)."""

    def __init__(self, inner: Any, model: SteeringModel) -> None:
        self.inner = inner
        self.model = model
        self.name: str = inner.name
        self.samplable: bool = inner.samplable

    def _active(self, request: RequestInfo) -> bool:
        m = self.model
        return bool((request.session_node and m.affinity_weight > 0)
                    or (request.adapter and m.adapter_weight > 0))

    def pick(self, candidates: Sequence[Candidate], request: RequestInfo,
             rng: random.Random) -> Decision:
        m = self.model
        if request.session_node and m.affinity_weight <= 0:
            # affinity off: the key's last node means nothing to the load profile either
            # (which places a request with a session node without its least_request term)
            request = replace(request, session_node="")
        if not self._active(request):
            return self.inner.pick(candidates, request, rng)
        bound = affinity_bound(candidates, request, m.epsilon)
        adapter = request.adapter
        total, score = self.inner.total, self.inner.score

        def extra(c: Candidate) -> tuple[float, float]:
            return (bound.score(c),
                    adapter_score(c, adapter, m.adapter_load_s, m.wait_scale_s))

        def total_of(c: Candidate) -> float:
            aff, ad = extra(c)
            return total(c, request) + m.affinity_weight * aff + m.adapter_weight * ad

        def detail(c: Candidate) -> CandidateScore:
            base = score(c, request)
            aff, ad = extra(c)
            scores: Mapping[str, float] = MappingProxyType(
                {**base.scores, "session_affinity": aff, "adapter": ad})
            return CandidateScore(c.node_id, total_of(c), scores, base.expected_wait_s)

        return _choose(self.name, candidates, [total_of(c) for c in candidates], rng, detail)


def steer(profile: Profile, model: SteeringModel) -> Profile:
    """``profile`` with the request terms when it has per-candidate totals, else as is."""
    if callable(getattr(profile, "total", None)) and callable(getattr(profile, "score", None)):
        return Steered(profile, model)
    return profile
