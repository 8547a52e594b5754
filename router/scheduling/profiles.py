"""Routing profiles: filters -> scorers -> picker, selected by ``RouterConfig.policy``.

- ``weighted_least_load`` (default): the weighted sum of ``expected_wait``, ``kv_headroom`` and
  ``least_request`` (weights from config), max wins, random tie-break. See ``scorers`` for the
  expected-wait formula.
- ``least_request``: the fewest of this router's in-flight requests per unit of capacity weight
  (nginx ``least_conn`` with weights); random tie-break.
- ``power_of_two``: two candidates drawn at random, the one with fewer in-flight (weighted) wins;
  random tie-break.
- ``round_robin``: rotates over the candidates in node-id order, one cursor per model (the
  only policy with state, and it is explicit and per profile instance).

A profile is called with candidates that already passed the filters (``select`` below runs
them). Profiles do no I/O; the clock is implicit in the candidates, the RNG is injected.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

from router.scheduling import scorers
from router.scheduling.filters import Filter, healthy, kv_below, run_filters
from router.scheduling.picker import pick_max
from router.scheduling.scorers import WaitModel
from router.scheduling.types import Candidate, CandidateScore, Decision, RequestInfo


class Profile(Protocol):
    name: str

    def pick(self, candidates: Sequence[Candidate], request: RequestInfo,
             rng: random.Random) -> Decision: ...


class WeightedLeastLoad:
    name = "weighted_least_load"

    def __init__(self, weights: Mapping[str, float], wait_model: WaitModel) -> None:
        self.weights = MappingProxyType(dict(weights))
        self.wait_model = wait_model

    def score(self, c: Candidate) -> CandidateScore:
        wait = scorers.expected_wait_s(c, self.wait_model)
        parts = {
            "expected_wait": scorers.wait_score(wait, self.wait_model),
            "kv_headroom": scorers.kv_headroom(c),
            "least_request": scorers.least_request(c),
        }
        total = sum(self.weights.get(k, 0.0) * v for k, v in parts.items())
        return CandidateScore(c.node_id, total, MappingProxyType(parts), wait)

    def pick(self, candidates: Sequence[Candidate], request: RequestInfo,
             rng: random.Random) -> Decision:
        scored = [self.score(c) for c in candidates]
        best, ties = pick_max(scored, rng)
        return Decision(self.name, best.node_id, len(scored), tuple(scored), tie_size=ties)


def _least_request_scores(candidates: Sequence[Candidate]) -> list[CandidateScore]:
    out = []
    for c in candidates:
        s = scorers.least_request(c)
        out.append(CandidateScore(c.node_id, s, MappingProxyType({"least_request": s})))
    return out


class LeastRequest:
    name = "least_request"

    def pick(self, candidates: Sequence[Candidate], request: RequestInfo,
             rng: random.Random) -> Decision:
        scored = _least_request_scores(candidates)
        best, ties = pick_max(scored, rng)
        return Decision(self.name, best.node_id, len(scored), tuple(scored), tie_size=ties)


class PowerOfTwo:
    name = "power_of_two"

    def pick(self, candidates: Sequence[Candidate], request: RequestInfo,
             rng: random.Random) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.node_id)
        sample = ordered if len(ordered) <= 2 else rng.sample(ordered, 2)
        scored = _least_request_scores(sample)
        best, ties = pick_max(scored, rng)
        return Decision(self.name, best.node_id, len(candidates), tuple(scored), tie_size=ties)


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._cursor: dict[str, int] = {}

    def pick(self, candidates: Sequence[Candidate], request: RequestInfo,
             rng: random.Random) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.node_id)
        i = self._cursor.get(request.model, 0)
        self._cursor[request.model] = i + 1
        chosen = ordered[i % len(ordered)]
        return Decision(self.name, chosen.node_id, len(ordered))


def build_profile(policy: str, weights: Mapping[str, float], wait_model: WaitModel) -> Profile:
    if policy == "weighted_least_load":
        return WeightedLeastLoad(weights, wait_model)
    if policy == "least_request":
        return LeastRequest()
    if policy == "power_of_two":
        return PowerOfTwo()
    if policy == "round_robin":
        return RoundRobin()
    raise ValueError(f"unknown policy {policy!r}")


def default_filters(kv_hard_threshold: float) -> tuple[Filter, ...]:
    return (healthy, kv_below(kv_hard_threshold))


class NoCandidate(Exception):
    """No node can take the request. ``busy`` is True when nodes exist but all are at their
    max concurrency (the caller queues), False when none is eligible at all."""

    def __init__(self, busy: bool, filtered: Mapping[str, str]) -> None:
        super().__init__("all eligible nodes are busy" if busy else "no eligible node")
        self.busy = busy
        self.filtered = dict(filtered)


def select(profile: Profile, candidates: Sequence[Candidate], request: RequestInfo,
           rng: random.Random, filters: Sequence[Filter]) -> Decision:
    """The whole pipeline: filters, then the capacity check, then the profile's pick.

    Raises NoCandidate. Capacity is checked after the other filters so that "every eligible
    node is at its max concurrency" (queue) is told apart from "no eligible node" (fail)."""
    eligible, dropped = run_filters(candidates, filters)
    if not eligible:
        raise NoCandidate(False, dropped)
    free = [c for c in eligible if not c.at_capacity]
    if not free:
        dropped.update({c.node_id: f"at max concurrency {c.max_concurrency}" for c in eligible})
        raise NoCandidate(True, dropped)
    for c in eligible:
        if c.at_capacity:
            dropped[c.node_id] = f"at max concurrency {c.max_concurrency}"
    d = profile.pick(free, request, rng)
    return Decision(d.policy, d.node_id, d.candidates, d.considered,
                    MappingProxyType(dropped), d.tie_size)
