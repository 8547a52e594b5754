"""Filters: one-method plugins that drop candidates a request must not go to.

Each takes the candidates and returns (kept, dropped) where dropped maps node id -> reason.
They run in order (``run_filters``); the reasons end up in ``Decision.filtered``.

A filter whose verdict depends on the whole candidate set (``kv_below``: "while some candidate
is under it") has a ``sample_conclusive(kept)`` method: given what survived filtering a random
sample, it says whether its verdict on the sample is the one it would give on the whole fleet;
when it is not, a sampled decision falls back to filtering every candidate. Filters without the
method judge each candidate alone, so a sample's verdict always holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpumesh.router.scheduling.types import Candidate, NodeState, RequestInfo

Filter = Callable[[Sequence[Candidate]], tuple[list[Candidate], dict[str, str]]]


def healthy(candidates: Sequence[Candidate]) -> tuple[list[Candidate], dict[str, str]]:
    """Drops draining nodes. STALE nodes stay: they are routable, scored from router counts."""
    kept = [c for c in candidates if c.state is not NodeState.DRAINING]
    return kept, {c.node_id: "draining" for c in candidates if c.state is NodeState.DRAINING}


class kv_below:  # a filter factory, called like the function it replaced
    """Drops nodes whose fresh report shows KV usage >= threshold, but only while at least one
    candidate is under it (a full fleet still serves). Nodes without a fresh report pass:
    their KV is unknown."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def over(self, c: Candidate) -> bool:
        return c.report is not None and c.report.kv_cache_usage >= self.threshold

    def __call__(self, candidates: Sequence[Candidate]) -> tuple[list[Candidate], dict[str, str]]:
        over = self.over
        kept = [c for c in candidates if not over(c)]
        if not kept:
            return list(candidates), {}
        return kept, {c.node_id: f"kv {c.report.kv_cache_usage:.2f} >= {self.threshold:.2f}"
                      for c in candidates if over(c) and c.report is not None}

    def sample_conclusive(self, kept: Sequence[Candidate]) -> bool:
        """False when an over-threshold node survived: the sample had none under the threshold,
        which the fleet may well have (then only a full scan can tell)."""
        return not any(self.over(c) for c in kept)


def run_filters(candidates: Sequence[Candidate], filters: Sequence[Filter]
                ) -> tuple[list[Candidate], dict[str, str]]:
    kept, dropped = list(candidates), {}
    for f in filters:
        kept, more = f(kept)
        dropped.update(more)
    return kept, dropped


class fresh_first:  # a filter factory, like kv_below
    """Drops STALE nodes (no report within the freshness window: hung, partitioned or
    overloaded) while at least one candidate has a fresh report: no new work for a node
    whose heartbeats stopped, unless nothing else serves the model."""

    def __call__(self, candidates: Sequence[Candidate]) -> tuple[list[Candidate], dict[str, str]]:
        kept = [c for c in candidates if c.state is not NodeState.STALE]
        if not kept or len(kept) == len(candidates):
            return list(candidates), {}
        return kept, {c.node_id: "stale (no recent heartbeat)"
                      for c in candidates if c.state is NodeState.STALE}

    @staticmethod
    def sample_conclusive(kept: Sequence[Candidate]) -> bool:
        """False when a STALE node survived (the sample had no fresh one; the fleet may)."""
        return not any(c.state is NodeState.STALE for c in kept)


class serves_adapter:  # a filter factory, like kv_below
    """Drops candidates whose registration does not list the LoRA adapter (such a node would
    answer NOT_FOUND). Judges each candidate alone, so a sampled decision's verdict holds
    for the fleet. The router answers NOT_FOUND itself when no node of the model lists it."""

    def __init__(self, adapter: str) -> None:
        self.adapter = adapter

    def __call__(self, candidates: Sequence[Candidate]
                 ) -> tuple[list[Candidate], dict[str, str]]:
        a = self.adapter
        kept = [c for c in candidates if a in c.adapters]
        return kept, {c.node_id: f"does not serve adapter {a!r}"
                      for c in candidates if a not in c.adapters}


def request_filters(request: RequestInfo) -> tuple[Filter, ...]:
    """Filters that depend on the request: ``serves_adapter`` for an adapter request."""
    return (serves_adapter(request.adapter),) if request.adapter else ()


def whole_request(candidates: Sequence[Candidate]) -> tuple[list[Candidate], dict[str, str]]:
    """Drops nodes that serve one leg of a disaggregated request only (``Candidate.role``
    "prefill" or "decode"): a policy placing a whole request considers "both" nodes."""
    kept = [c for c in candidates if c.role == "both"]
    return kept, {c.node_id: f"role {c.role} (serves one leg only)"
                  for c in candidates if c.role != "both"}
