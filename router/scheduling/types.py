"""Frozen inputs and outputs of a routing decision (no proto types, no I/O).

The registry turns its snapshot plus its own per-node counts into ``Candidate`` values (cached
per node, rebuilt when their inputs change); policies read only these. ``Decision`` keeps the
predictions of the best few candidates (the chosen one included) so a trace span can carry
them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from types import MappingProxyType
from typing import Protocol

from gpumesh.types import LoadReport


class NodeState(str, Enum):
    HEALTHY = "healthy"
    STALE = "stale"        # last report older than the freshness window: router counts only
    DRAINING = "draining"


@dataclass(frozen=True)
class Candidate:
    """A node as one decision sees it.

    ``report`` is None when the node is STALE (or has not reported yet): policies then use the
    router's own counts only. Otherwise it is the node's last load report, its
    ``prefill_capacity_tokens_per_s`` filled from the model's reference speed where the node
    has measured none (``fleet.speed.ModelSpeeds``). Token counts are prompt tokens (router
    estimates for its own requests, the node's exact count in
    ``report.pending_prefill_tokens``).
    """

    node_id: str
    address: str
    state: NodeState
    capacity_weight: float
    max_concurrency: int                 # 0 = unlimited
    report: LoadReport | None
    report_age_s: float                  # as of when this view was built; inf: never reported
    kv_cache_usage: float                # last known (0 when never reported)
    router_in_flight: int                # this router's requests on the node, any phase
    outstanding_prompt_tokens: int       # this router's requests before their first token
    outstanding_requests: int
    unreported_prompt_tokens: int        # ... of those, not yet in the last report
    unreported_requests: int
    # This router's change to the node's requests since its last report, any phase
    # (fleet.CreditLedger.decode_delta; may be negative); None = not known (R uses U).
    decode_delta: int | None = None
    # All routers' dispatches per one of this router's (fleet.PeerShare; >= 1, 1 = alone):
    # the prediction scales the unreported terms by it.
    peer_factor: float = 1.0
    # The node's decode step time in seconds (fleet.speed): its own timing where it reports
    # one, else its running count averaged over reports / its generation rate, else the
    # model's reference step scaled by its weight; 0 = none measured or no fresh report.
    step_s: float = 0.0
    # LoRA adapters of the model this node can serve (its registration); loaded ones are in
    # ``report.loaded_adapters``.
    adapters: tuple[str, ...] = ()
    # Observed / predicted time to first token on this node (a smoothed ratio kept by the
    # router from its own requests; 1 = the profile predicts it well). The predictive policy
    # multiplies its TTFT prediction for this node by it.
    prediction_scale: float = 1.0
    # The node's role (its registration): "both" serves whole requests; "prefill" and
    # "decode" serve one leg of a disaggregated request.
    role: str = "both"

    @property
    def at_capacity(self) -> bool:
        return self.max_concurrency > 0 and self.router_in_flight >= self.max_concurrency


class CandidateSource(Protocol):
    """A decision's candidates, readable one by one so a sampled decision builds only those
    it looks at (``fleet.candidates.LazyCandidates``; ``ListCandidates`` for a plain list).
    Index order is node-id order."""

    def __len__(self) -> int: ...

    def at(self, i: int) -> Candidate | None:
        """The i-th candidate, or None when it is not routable now (lease over, excluded)."""
        ...

    def all(self) -> list[Candidate]:
        """Every routable candidate, in index order."""
        ...

    def index_of(self, node_id: str) -> int | None:
        """The index of ``node_id``, or None when it is not a node of this source."""
        ...


class ListCandidates:
    """A ``CandidateSource`` over a list (tests, callers that already hold candidates)."""

    __slots__ = ("_index", "_items")

    def __init__(self, items: Sequence[Candidate]) -> None:
        self._items = list(items)
        self._index = {c.node_id: i for i, c in enumerate(self._items)}

    def __len__(self) -> int:
        return len(self._items)

    def at(self, i: int) -> Candidate | None:
        return self._items[i]

    def all(self) -> list[Candidate]:
        return list(self._items)

    def index_of(self, node_id: str) -> int | None:
        return self._index.get(node_id)


@dataclass(frozen=True)
class RequestInfo:
    """What routing knows about a request."""

    model: str
    prompt_tokens: int
    routing_key: str = ""
    # The LoRA adapter named (GenerateRequest.adapter); "" = the base model.
    adapter: str = ""
    # The node that served ``routing_key`` last (fleet.sessions), "" = none: the prediction
    # counts an expected prefix hit there (scheduling.predictor).
    session_node: str = ""
    # Prefix locality (router/fleet/locality.py): the prompt's block hashes
    # (gpumesh.kvblocks), and per node id the prompt tokens that node holds in its KV cache
    # (nodes holding none are absent). The prediction charges each node only the prefill it
    # would still do.
    prefix_hashes: tuple[int, ...] = ()
    cached_tokens: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # Per node id, the tokens the prefix index holds for that node (its cached blocks x the
    # block size; a lazy view, read for the candidates only): how full its prefix cache is,
    # so a store that fits evicts nothing. A node absent from it: unknown (counted as full).
    indexed_tokens: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # The output tokens it may generate (its max_tokens; 0 = unknown): the prediction's
    # completion time counts them (RoutingSettings.output_tokens_default when unknown).
    output_tokens: int = 0
    # The request's service-level objectives in seconds (0 = none): time to first token and
    # time per output token, resolved from the request, its API key and its model.
    ttft_slo_s: float = 0.0
    tpot_slo_s: float = 0.0

    @cached_property
    def best_cached_tokens(self) -> int:
        """The longest prefix of the prompt any node holds (0 = none; at most the prompt),
        computed once per request however many candidates are scored."""
        return min(max(self.cached_tokens.values(), default=0), self.prompt_tokens)


@dataclass(frozen=True)
class CandidateScore:
    node_id: str
    total: float                          # the policy's value of the node, larger is better
    # the policy's raw terms: predicted_latency's ttft_s, completion_s, imposed_s (seconds);
    # least_request's least_request score
    scores: Mapping[str, float]
    expected_wait_s: float | None = None  # predicted time to first token, if predicted


@dataclass(frozen=True)
class Decision:
    """The result of one pick: the chosen node and why (raw scores for tracing)."""

    policy: str
    node_id: str
    candidates: int                       # after filters
    # The best few candidates by total with their raw terms, the chosen one included (every
    # candidate when there are few; see ``policies.base.KEEP_SCORES``).
    considered: tuple[CandidateScore, ...] = ()
    filtered: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    tie_size: int = 1                     # how many candidates tied for the best total
    sampled_from: int = 0                 # fleet size a sample was drawn from; 0 = no sampling
    # The chosen node's predicted time to first token and to the last token, seconds from the
    # decision (None: the policy does not predict).
    predicted_ttft_s: float | None = None
    predicted_completion_s: float | None = None
    # The chosen candidate's prediction_scale the prediction was multiplied by (0 = unknown).
    prediction_scale: float = 0.0
