"""``round_robin``: rotates over the candidates in node-id order, one cursor per model (the
only policy with state, explicit and per instance). A baseline."""

from __future__ import annotations

import random
from collections.abc import Sequence

from gpumesh.router.scheduling.types import Candidate, Decision, RequestInfo


class RoundRobin:
    name = "round_robin"
    samplable = False   # its cursor walks the whole ordered fleet
    deterministic = False

    def __init__(self) -> None:
        self._cursor: dict[str, int] = {}

    def pick(self, candidates: Sequence[Candidate], request: RequestInfo,
             rng: random.Random) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.node_id)
        i = self._cursor.get(request.model, 0)
        self._cursor[request.model] = i + 1
        chosen = ordered[i % len(ordered)]
        return Decision(self.name, chosen.node_id, len(ordered))
