"""``power_of_two``: two candidates drawn at random, the one with fewer in-flight requests
per unit of weight wins; random tie-break. A baseline."""

from __future__ import annotations

import random
from collections.abc import Sequence

from gpumesh.router.scheduling.policies.base import TIE_EPSILON
from gpumesh.router.scheduling.policies.least_request import least_request_score
from gpumesh.router.scheduling.types import Candidate, Decision, RequestInfo


class PowerOfTwo:
    name = "power_of_two"
    samplable = True   # two drawn from a uniform sample are two drawn uniformly
    deterministic = False

    def pick(self, candidates: Sequence[Candidate], request: RequestInfo,
             rng: random.Random) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.node_id)
        sample = ordered if len(ordered) <= 2 else rng.sample(ordered, 2)
        scored = [least_request_score(c) for c in sample]
        best = max(s.total for s in scored)
        tied = sorted((s for s in scored if s.total >= best - TIE_EPSILON),
                      key=lambda s: s.node_id)
        chosen = tied[0] if len(tied) == 1 else rng.choice(tied)
        return Decision(self.name, chosen.node_id, len(candidates), tuple(scored),
                        tie_size=len(tied))
