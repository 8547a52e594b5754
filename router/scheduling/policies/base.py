"""The one small interface every routing policy implements, and the helpers they share.

A policy is handed the candidates that passed the filters and have a free slot (``select``,
``select_from``) and returns a ``Decision``. It does no I/O; the RNG is injected (only the
baselines draw from it), and the clock is implicit in the candidates.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from typing import Protocol

from gpumesh.router.scheduling.types import Candidate, CandidateScore, Decision, RequestInfo

KEEP_SCORES = 3   # candidates whose scores a Decision keeps (telemetry.TOP_N shows 3)
TIE_EPSILON = 1e-9
_MASK = (1 << 64) - 1


class Policy(Protocol):
    """``name``: the ``routing.policy`` value; ``samplable``: may be handed a sample of the
    candidates on a large fleet (``pipeline.select_from``); ``deterministic``: its pick is
    a function of the request and the candidates alone (no RNG), so its sample is drawn
    from the request's key too."""

    name: str
    samplable: bool
    deterministic: bool

    def pick(self, candidates: Sequence[Candidate], request: RequestInfo,
             rng: random.Random) -> Decision: ...


def request_key(request: RequestInfo) -> int:
    """A number derived from the request alone (its routing key, else its first prefix
    block, else its model and sizes), the same on every router replica: the predictive
    policy breaks ties and draws its large-fleet sample with it."""
    if request.routing_key:
        text = "k:" + request.routing_key
    elif request.prefix_hashes:
        text = f"p:{request.prefix_hashes[0]}"
    else:
        text = f"m:{request.model}:{request.prompt_tokens}:{request.output_tokens}"
    return zlib.crc32(text.encode())


def node_rank(key: int, node_id: str) -> int:
    """The tie order of ``node_id`` for a request of ``key`` (rendezvous hashing: each
    request has its own order of the nodes, and every replica computes the same)."""
    x = ((zlib.crc32(node_id.encode()) << 32) | key) * 0x9E3779B97F4A7C15 & _MASK
    x ^= x >> 29
    return (x * 0xBF58476D1CE4E5B9) & _MASK


def best_by_rng(name: str, candidates: Sequence[Candidate], totals: Sequence[float],
                rng: random.Random, detail: Callable[[Candidate], CandidateScore]) -> Decision:
    """The max total wins, ties broken uniformly by ``rng`` over the tied in node-id order;
    ``detail`` builds the scores of the kept few (the baselines' rule)."""
    if not candidates:
        raise ValueError("a pick needs at least one candidate")
    best = max(totals)
    tied = sorted((c for c, t in zip(candidates, totals) if t >= best - TIE_EPSILON),
                  key=lambda c: c.node_id)
    chosen = tied[0] if len(tied) == 1 else rng.choice(tied)
    kept = kept_few(candidates, totals, chosen)
    return Decision(name, chosen.node_id, len(candidates), tuple(detail(c) for c in kept),
                    tie_size=len(tied))


def kept_few(candidates: Sequence[Candidate], totals: Sequence[float],
             chosen: Candidate) -> list[Candidate]:
    """The ``KEEP_SCORES`` best candidates by total, ``chosen`` always among them."""
    if len(candidates) <= KEEP_SCORES:
        return list(candidates)
    order = sorted(range(len(candidates)), key=lambda i: -totals[i])[:KEEP_SCORES]
    kept = [candidates[i] for i in order]
    if not any(k is chosen for k in kept):
        kept[-1] = chosen
    return kept


def per_weight_load(c: Candidate) -> float:
    """This router's in-flight requests on ``c`` per unit of capacity weight."""
    weight = c.capacity_weight if c.capacity_weight > 0 else 1.0
    return c.router_in_flight / weight
