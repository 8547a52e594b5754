"""Routing profiles: filters -> scorers -> picker, selected by ``RouterConfig.policy``.

- ``weighted_least_load`` (default): the weighted sum of ``expected_wait``, ``kv_headroom`` and
  ``least_request`` (weights from config), max wins, random tie-break. The expected_wait
  score is taken of the node's expected wait plus the request's admission wait and its own
  expected service time there (``WaitModel.admission_weight``, ``service_weight``); see
  ``scorers`` for the formulas. Default weights: expected_wait 1, least_request 8.
- ``least_request``: the fewest of this router's in-flight requests per unit of capacity weight
  (nginx ``least_conn`` with weights); random tie-break.
- ``power_of_two``: two candidates drawn at random, the one with fewer in-flight (weighted) wins;
  random tie-break.
- ``round_robin``: rotates over the candidates in node-id order, one cursor per model (the
  only policy with state, and it is explicit and per profile instance).

A profile is called with candidates that already passed the filters (``select`` below runs
them). Profiles do no I/O; the clock is implicit in the candidates, the RNG is injected.

Large fleets (``select_from`` with ``sample_size`` d): a profile with ``samplable = True``
(all but round_robin) is given a uniform random sample of d of the model's nodes (the injected
RNG; power-of-d choices) instead of all of them, so a decision costs O(d), not O(nodes). Up to
d nodes it is exact (every node scored, the same picks as ``select``). Filters keep their
semantics: when the sample's verdict may differ from the fleet's (nothing eligible or free in
the sample, or ``kv_below`` found no node under its threshold in the sample) the decision
falls back to filtering every node, then samples d of the eligible ones. The price of sampling
is balance: the pick is the best of d random nodes, not the best of all, i.e. a node in the
best ~1/(d+1) of the fleet on average (tested in tests/router/test_sampling.py). A request
whose prompt prefix some nodes hold in their KV cache (``RequestInfo.cached_tokens``) has up
to d of those nodes, longest prefix first, added to the sample; a request whose routing key
last went to a node (``RequestInfo.session_node``) has that node added.

``Decision.considered`` keeps full per-scorer scores for the best ``KEEP_SCORES`` candidates
(the chosen one included), for the trace span; totals of the others are not kept.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

from gpumesh.router.scheduling import scorers
from gpumesh.router.scheduling.filters import Filter, healthy, kv_below, run_filters
from gpumesh.router.scheduling.picker import TIE_EPSILON, pick_max
from gpumesh.router.scheduling.scorers import WaitModel
from gpumesh.router.scheduling.types import (
    Candidate,
    CandidateScore,
    CandidateSource,
    Decision,
    ListCandidates,
    RequestInfo,
)

KEEP_SCORES = 3   # candidates whose raw scores a Decision keeps (telemetry.TOP_N shows 3)


class Profile(Protocol):
    name: str
    samplable: bool   # may be given a random sample of the candidates (see select_from)

    def pick(self, candidates: Sequence[Candidate], request: RequestInfo,
             rng: random.Random) -> Decision: ...


def _choose(name: str, candidates: Sequence[Candidate], totals: Sequence[float],
            rng: random.Random, detail: Callable[[Candidate], CandidateScore],
            sampled_from: int = 0) -> Decision:
    """The max total wins, ties broken uniformly by ``rng`` over the tied in node-id order
    (exactly ``picker.pick_max``'s rule); ``detail`` builds full scores for the kept few."""
    if not candidates:
        raise ValueError("a pick needs at least one candidate")
    best = max(totals)
    tied = sorted((c for c, t in zip(candidates, totals) if t >= best - TIE_EPSILON),
                  key=lambda c: c.node_id)
    chosen = tied[0] if len(tied) == 1 else rng.choice(tied)
    if len(candidates) <= KEEP_SCORES:
        kept = list(candidates)
    else:
        order = sorted(range(len(candidates)), key=lambda i: -totals[i])[:KEEP_SCORES]
        kept = [candidates[i] for i in order]
        if not any(k is chosen for k in kept):
            kept[-1] = chosen
    return Decision(name, chosen.node_id, len(candidates), tuple(detail(c) for c in kept),
                    tie_size=len(tied), sampled_from=sampled_from)


class WeightedLeastLoad:
    """The per-node part of a total (the wait, the KV and least-request scores) is memoised
    on the Candidate object: the registry hands back the same object until one of its inputs
    changes, so an unchanged node is not re-estimated. The request's own service time
    (``scorers.expected_service_s``, weighted by ``WaitModel.service_weight``) is added to
    the wait per request."""

    name = "weighted_least_load"
    samplable = True

    def __init__(self, weights: Mapping[str, float], wait_model: WaitModel) -> None:
        self.weights = MappingProxyType(dict(weights))
        self.wait_model = wait_model
        self._w = (self.weights.get("expected_wait", 0.0), self.weights.get("kv_headroom", 0.0),
                   self.weights.get("least_request", 0.0))
        self._memo: dict[str, tuple[Candidate, float, float, float]] = {}

    def _base(self, c: Candidate) -> tuple[float, float, float]:
        """(wait, weighted KV part, weighted least-request part of the total) for ``c``,
        memoised."""
        hit = self._memo.get(c.node_id)
        if hit is not None and hit[0] is c:
            return hit[1], hit[2], hit[3]
        m = self.wait_model
        _, wk, wl = self._w
        wait = scorers.expected_wait_s(c, m)
        kv = wk * scorers.kv_headroom(c, m) if wk else 0.0
        lr = wl * scorers.least_request(c) if wl else 0.0
        if len(self._memo) > 65_536:
            self._memo.clear()   # departed nodes' entries; the cache refills as it is read
        self._memo[c.node_id] = (c, wait, kv, lr)
        return wait, kv, lr

    def cost_s(self, c: Candidate, request: RequestInfo) -> float:
        """The estimate the expected_wait score is taken of: the wait plus the weighted
        service time of ``request`` on ``c``."""
        m = self.wait_model
        wait = self._base(c)[0]
        if m.service_weight:
            wait += m.service_weight * scorers.expected_service_s(c, m, request)
        if m.admission_weight:
            wait += m.admission_weight * scorers.expected_admission_s(c, m, request)
        if m.miss_weight and request.cached_tokens:
            wait += m.miss_weight * scorers.expected_miss_s(c, m, request)
        return wait

    def score(self, c: Candidate, request: RequestInfo = RequestInfo("", 0)) -> CandidateScore:
        """Full scores; ``expected_wait_s`` is the wait alone (what a blind credit's hold
        is sized by), the expected_wait score is of the wait plus the service time."""
        m = self.wait_model
        ew = scorers.wait_score(self.cost_s(c, request), m)
        kv, lr = scorers.kv_headroom(c, m), scorers.least_request(c)
        return CandidateScore(c.node_id, self.total(c, request), MappingProxyType(
            {"expected_wait": ew, "kv_headroom": kv, "least_request": lr}), self._base(c)[0])

    def total(self, c: Candidate, request: RequestInfo = RequestInfo("", 0)) -> float:
        """``score(c, request).total`` (the same float), without building the score record."""
        _, kv, lr = self._base(c)
        wait = self.cost_s(c, request)
        # A request whose prefix some node holds, or whose session has a node, is placed
        # without the in-flight count: at low load one request more or less outweighs a whole
        # prefill's saving or the affinity term, while the expected wait already carries every
        # node's load and affinity has its own load bound (docs/routing.md).
        steered = request.cached_tokens or request.session_node
        return (self._w[0] * scorers.wait_score(wait, self.wait_model) + kv
                + (0.0 if steered else lr))

    def pick(self, candidates: Sequence[Candidate], request: RequestInfo,
             rng: random.Random) -> Decision:
        total = self.total
        return _choose(self.name, candidates, [total(c, request) for c in candidates], rng,
                       lambda c: self.score(c, request))


def _least_request_scores(candidates: Sequence[Candidate]) -> list[CandidateScore]:
    return [_least_request_score(c) for c in candidates]


def _least_request_score(c: Candidate) -> CandidateScore:
    s = scorers.least_request(c)
    return CandidateScore(c.node_id, s, MappingProxyType({"least_request": s}))


class LeastRequest:
    name = "least_request"
    samplable = True

    def pick(self, candidates: Sequence[Candidate], request: RequestInfo,
             rng: random.Random) -> Decision:
        lr = scorers.least_request
        return _choose(self.name, candidates, [lr(c) for c in candidates], rng,
                       _least_request_score)


class PowerOfTwo:
    name = "power_of_two"
    samplable = True   # two drawn from a uniform sample are two drawn uniformly

    def pick(self, candidates: Sequence[Candidate], request: RequestInfo,
             rng: random.Random) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.node_id)
        sample = ordered if len(ordered) <= 2 else rng.sample(ordered, 2)
        scored = _least_request_scores(sample)
        best, ties = pick_max(scored, rng)
        return Decision(self.name, best.node_id, len(candidates), tuple(scored), tie_size=ties)


class RoundRobin:
    name = "round_robin"
    samplable = False   # its cursor walks the whole ordered fleet

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
           rng: random.Random, filters: Sequence[Filter], sample_size: int = 0) -> Decision:
    """The whole pipeline: filters, then the capacity check, then the profile's pick.

    Raises NoCandidate. Capacity is checked after the other filters so that "every eligible
    node is at its max concurrency" (queue) is told apart from "no eligible node" (fail).
    ``sample_size`` d > 0 with a samplable profile: the profile scores d of the free
    candidates drawn at random (all of them when there are no more than d)."""
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
    sampled_from = 0
    if 0 < sample_size < len(free) and getattr(profile, "samplable", False):
        sampled_from = len(free)
        idx = sorted(rng.sample(range(len(free)), sample_size))
        free = [free[i] for i in idx]
    d = profile.pick(free, request, rng)
    return Decision(d.policy, d.node_id, d.candidates, d.considered,
                    MappingProxyType(dropped), d.tie_size, sampled_from or d.sampled_from)


def _with_holders(picked: list[int], source: CandidateSource, request: RequestInfo,
                  limit: int) -> list[int]:
    """Prefix locality: the nodes holding the longest cached prefixes of the request (at most
    ``limit`` of them) join the random sample, so that sampling never hides the node whose
    cache would spare the prefill; the estimate then weighs them against the others."""
    index_of = source.index_of  # type: ignore[attr-defined]
    best = sorted(request.cached_tokens.items(), key=lambda kv: -kv[1])[:limit]
    more = {i for nid, _ in best if (i := index_of(nid)) is not None}
    return list(more.union(picked))


def select_from(profile: Profile, source: CandidateSource | Sequence[Candidate],
                request: RequestInfo, rng: random.Random, filters: Sequence[Filter],
                sample_size: int = 0) -> Decision:
    """``select`` over a candidate source, scoring a random sample of ``sample_size`` nodes
    when the model has more (module doc). Exact -- the same as ``select`` over every
    candidate -- when it has no more than ``sample_size``, when ``sample_size`` is 0, and
    for profiles that are not samplable. Raises NoCandidate exactly when ``select`` over every
    candidate would (a sample that cannot decide falls back to every candidate)."""
    if not hasattr(source, "at"):
        source = ListCandidates(source)  # type: ignore[arg-type]
    n = len(source)
    if sample_size <= 0 or n <= sample_size or not getattr(profile, "samplable", False):
        return select(profile, source.all(), request, rng, filters)
    at = source.at
    picked = rng.sample(range(n), sample_size)
    if request.cached_tokens and hasattr(source, "index_of"):
        picked = _with_holders(picked, source, request, sample_size)
    if request.session_node and hasattr(source, "index_of"):
        # routing-key affinity (scorers.affinity): the key's last node joins the sample too
        i = source.index_of(request.session_node)  # type: ignore[attr-defined]
        if i is not None and i not in picked:
            picked = [*picked, i]
    sample = [c for i in sorted(picked) if (c := at(i)) is not None]
    kept, dropped = sample, {}
    conclusive = True
    for f in filters:
        kept, more = f(kept)
        dropped.update(more)
        check = getattr(f, "sample_conclusive", None)
        if check is not None and not check(kept):
            conclusive = False
            break
    free = [c for c in kept if not c.at_capacity]
    if not conclusive or not free:
        return select(profile, source.all(), request, rng, filters, sample_size)
    for c in kept:
        if c.at_capacity:
            dropped[c.node_id] = f"at max concurrency {c.max_concurrency}"
    d = profile.pick(free, request, rng)
    return Decision(d.policy, d.node_id, d.candidates, d.considered,
                    MappingProxyType(dropped), d.tie_size, n)
