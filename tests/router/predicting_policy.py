"""TEST FIXTURE, not a gpumesh routing policy: a predicting policy whose predictions the tests
set, so prediction feedback and SLO admission can be tested before (and independently of)
the real predictive policy.

``FixturePredictor`` picks the node with the fewest of this router's requests in flight and
predicts, like a real predictive policy, in seconds from the decision and multiplied by the
node's ``Candidate.prediction_scale``: time to first token ``base_s + per_request_s x
router_in_flight``, and completion that plus ``output_tokens x tpot_s``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from gpumesh.router.scheduling.types import Candidate, CandidateScore, Decision, RequestInfo


@dataclass
class FixturePredictor:
    base_s: float
    per_request_s: float = 0.0
    tpot_s: float = 0.0
    name: str = "test_fixture_predictor"
    samplable: bool = False

    def ttft(self, c: Candidate) -> float:
        return (self.base_s + self.per_request_s * c.router_in_flight) * c.prediction_scale

    def pick(self, candidates: Sequence[Candidate], request: RequestInfo,
             rng: random.Random) -> Decision:
        best = min(candidates, key=lambda c: (c.router_in_flight, c.node_id))
        ttft = self.ttft(best)
        return Decision(self.name, best.node_id, len(candidates),
                        (CandidateScore(best.node_id, -ttft, {"ttft": ttft}),),
                        predicted_ttft_s=ttft,
                        predicted_completion_s=ttft + request.output_tokens * self.tpot_s)
