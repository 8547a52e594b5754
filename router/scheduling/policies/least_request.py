"""``least_request``: the fewest of this router's in-flight requests per unit of capacity
weight (nginx ``least_conn`` with weights); random tie-break. A baseline: it predicts
nothing and ignores prefixes, sessions and adapters."""

from __future__ import annotations

import random
from collections.abc import Sequence
from types import MappingProxyType

from gpumesh.router.scheduling.policies.base import best_by_rng, per_weight_load
from gpumesh.router.scheduling.types import Candidate, CandidateScore, Decision, RequestInfo


def least_request_score(c: Candidate) -> CandidateScore:
    """1 / (1 + in_flight / weight): 1 when idle, 0.5 at one request per unit of weight."""
    s = 1.0 / (1.0 + per_weight_load(c))
    return CandidateScore(c.node_id, s, MappingProxyType({"least_request": s}))


class LeastRequest:
    name = "least_request"
    samplable = True
    deterministic = False

    def pick(self, candidates: Sequence[Candidate], request: RequestInfo,
             rng: random.Random) -> Decision:
        return best_by_rng(self.name, candidates,
                           [1.0 / (1.0 + per_weight_load(c)) for c in candidates], rng,
                           least_request_score)
