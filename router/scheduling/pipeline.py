"""The routing pipeline: filters -> the capacity check -> the policy's pick.

``select`` runs it over a list of candidates; ``select_from`` over a ``CandidateSource``,
predicting only a sample of ``sample_size`` nodes on a model with more (power-of-d choices):
a uniform random sample, plus the nodes holding the longest cached prefixes of the request
(up to d of them, so sampling never hides the node whose cache spares the prefill) and the
node of its session (``RequestInfo.session_node``). A deterministic policy
(``predicted_latency``) draws the sample from the request's key (``policies.base.
request_key``) when the request has a routing key or prefix blocks, so replicas sample
alike; otherwise, and for the baselines, the injected RNG draws it. Up to d nodes the
decision is exact (every node considered; the same as ``select``). Filters keep their
semantics: when a filter says the sample's verdict may differ from the fleet's
(``sample_conclusive``), or nothing in the sample is free, every node is filtered again.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from gpumesh.router.scheduling.filters import Filter, healthy, kv_below, run_filters
from gpumesh.router.scheduling.policies.base import Policy, request_key
from gpumesh.router.scheduling.types import (
    Candidate,
    CandidateSource,
    Decision,
    ListCandidates,
    RequestInfo,
)


def default_filters(kv_hard_threshold: float) -> tuple[Filter, ...]:
    """Draining nodes out, nodes over the KV threshold out while another is under it. Which
    nodes a request's legs may use by role (prefill/decode/both) is the dispatcher's
    disaggregation rule (``router.dispatch.disagg``), which excludes the others;
    ``filters.whole_request`` keeps "both" nodes only."""
    return (healthy, kv_below(kv_hard_threshold))


class NoCandidate(Exception):
    """No node can take the request. ``busy`` is True when nodes exist but all are at their
    max concurrency (the caller queues), False when none is eligible at all."""

    def __init__(self, busy: bool, filtered: Mapping[str, str]) -> None:
        super().__init__("all eligible nodes are busy" if busy else "no eligible node")
        self.busy = busy
        self.filtered = dict(filtered)


def _with_dropped(d: Decision, dropped: Mapping[str, str], sampled_from: int) -> Decision:
    return Decision(d.policy, d.node_id, d.candidates, d.considered, MappingProxyType(dict(dropped)),
                    d.tie_size, sampled_from or d.sampled_from, d.predicted_ttft_s,
                    d.predicted_completion_s)


def select(policy: Policy, candidates: Sequence[Candidate], request: RequestInfo,
           rng: random.Random, filters: Sequence[Filter]) -> Decision:
    """Filters, then the capacity check, then the policy's pick over every candidate.

    Raises NoCandidate. Capacity is checked after the other filters so that "every eligible
    node is at its max concurrency" (queue) is told apart from "no eligible node" (fail)."""
    eligible, dropped = run_filters(candidates, filters)
    if not eligible:
        raise NoCandidate(False, dropped)
    free = [c for c in eligible if not c.at_capacity]
    busy = {c.node_id: f"at max concurrency {c.max_concurrency}"
            for c in eligible if c.at_capacity}
    dropped.update(busy)
    if not free:
        raise NoCandidate(True, dropped)
    return _with_dropped(policy.pick(free, request, rng), dropped, 0)


def _sample(policy: Policy, source: CandidateSource, request: RequestInfo,
            rng: random.Random, d: int) -> list[int]:
    """Indexes of the sample (module doc): d drawn, the prefix holders and the session's
    node added."""
    n = len(source)
    keyed = policy.deterministic and bool(request.routing_key or request.prefix_hashes)
    draw = random.Random(request_key(request)) if keyed else rng
    picked = set(draw.sample(range(n), d))
    holders = sorted(request.cached_tokens.items(), key=lambda kv: (-kv[1], kv[0]))[:d]
    for node_id in [nid for nid, _ in holders] + [request.session_node]:
        if node_id and (i := source.index_of(node_id)) is not None:
            picked.add(i)
    return sorted(picked)


def select_from(policy: Policy, source: CandidateSource | Sequence[Candidate],
                request: RequestInfo, rng: random.Random, filters: Sequence[Filter],
                sample_size: int = 0) -> Decision:
    """``select`` over a candidate source, considering a sample of ``sample_size`` nodes when
    the model has more (module doc). Exact -- the same as ``select`` over every candidate --
    when it has no more than ``sample_size``, when ``sample_size`` is 0, and for policies
    that are not samplable. Raises NoCandidate exactly when ``select`` over every candidate
    would (a sample that cannot decide falls back to every candidate)."""
    if isinstance(source, Sequence):
        source = ListCandidates(source)
    n = len(source)
    if sample_size <= 0 or n <= sample_size or not policy.samplable:
        return select(policy, source.all(), request, rng, filters)
    at = source.at
    sample = [c for i in _sample(policy, source, request, rng, sample_size)
              if (c := at(i)) is not None]
    kept, dropped = sample, {}
    for f in filters:
        kept, more = f(kept)
        dropped.update(more)
        check = getattr(f, "sample_conclusive", None)
        if check is not None and not check(kept):
            return select(policy, source.all(), request, rng, filters)
    free = [c for c in kept if not c.at_capacity]
    if not free:
        return select(policy, source.all(), request, rng, filters)
    dropped.update({c.node_id: f"at max concurrency {c.max_concurrency}"
                    for c in kept if c.at_capacity})
    return _with_dropped(policy.pick(free, request, rng), dropped, n)
