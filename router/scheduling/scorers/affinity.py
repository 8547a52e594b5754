"""The ``session_affinity`` scorer: keep a session (``GenerateRequest.routing_key``) on the node
that served it last, within a bounded load.

The curve, for candidate n and a request whose key last went to node s
(``RequestInfo.session_node``, from ``fleet.sessions``)::

    score(n) = 1   if n is s and s is within its bound
               0   otherwise (any other node; s over its bound; no key; key unknown)

A step, not a slope: affinity is a preference for one node, and the profile's weight says how
much of the load score it may override (weight >= 1: within the bound the session node
always wins, since every load score is in [0, 1]; below 1 it wins only when its load score is
within that weight of the best other node's).

The bounded-load rule (consistent hashing with bounded loads, Mirrokni, Thorup and
Zadimoghaddam 2018), with L_n this router's requests in flight on n, w_n n's capacity
weight, the sums over the decision's candidates::

    fair(s)  = (sum L + 1) * w_s / sum w          # s's share of the load including this one
    within   = L_s + 1 <= ceil((1 + epsilon) * fair(s))

So affinity never puts a node above ceil((1 + epsilon) x its fair share): past it, the
session node scores 0 like every other node and the request goes where load alone sends it
(and the session then moves with it: the dispatcher remembers the new node). epsilon is
``RouterConfig.affinity_epsilon``. The ceiling lets an idle fleet's first request
stick (fair share < 1). In-flight counts are this router's own, exact at every decision, so
the bound holds per router; with a sampled decision (``decision_sample_size``) the sums are
over the sample, an unbiased estimate of the fleet's mean load per unit of weight.

Pure: a function of the candidates and the request; the profile computes ``AffinityBound``
once per decision and the per-node score from it in O(1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpumesh.router.scheduling.types import Candidate, RequestInfo


def _weight(c: Candidate) -> float:
    return c.capacity_weight if c.capacity_weight > 0 else 1.0


@dataclass(frozen=True)
class AffinityBound:
    """One decision's affinity: the session node and whether it is within its bound."""

    session_node: str
    within: bool
    load: int            # L_s: this router's requests in flight on the session node
    bound: int           # ceil((1 + epsilon) * fair(s)); 0 when the node is not a candidate

    def score(self, c: Candidate) -> float:
        """1 for the session node within its bound, else 0 (module doc)."""
        return 1.0 if self.within and c.node_id == self.session_node else 0.0


NO_AFFINITY = AffinityBound("", False, 0, 0)


def affinity_bound(candidates: Sequence[Candidate], request: RequestInfo,
                   epsilon: float) -> AffinityBound:
    """The bounded-load verdict for ``request.session_node`` among ``candidates`` (module
    doc). ``NO_AFFINITY`` when the request has no session node or it is not a candidate
    (left the fleet, filtered out, at its concurrency limit, or not in the sample)."""
    node = request.session_node
    if not node:
        return NO_AFFINITY
    total_load = 0
    total_weight = 0.0
    session: Candidate | None = None
    for c in candidates:
        total_load += c.router_in_flight
        total_weight += _weight(c)
        if c.node_id == node:
            session = c
    if session is None:
        return NO_AFFINITY
    fair = (total_load + 1) * _weight(session) / total_weight
    # a hair under the ceiling: (1 + eps) * fair lands on an integer up to rounding
    bound = math.ceil((1.0 + epsilon) * fair - 1e-9)
    load = session.router_in_flight
    return AffinityBound(node, load + 1 <= bound, load, bound)


def session_affinity(c: Candidate, candidates: Sequence[Candidate], request: RequestInfo,
                     epsilon: float) -> float:
    """The score of one candidate (module doc); O(candidates): a profile scoring many
    candidates computes ``affinity_bound`` once and calls its ``score``."""
    return affinity_bound(candidates, request, epsilon).score(c)
