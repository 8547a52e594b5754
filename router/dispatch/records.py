"""What dispatch hands out and what it remembers of one request.

``Assignment`` is one dispatch slot: the node chosen for one attempt, the decision that chose
it and the credit charged for it. ``DispatchRecord`` collects every attempt of a request; the
API layer reads it for trailing metadata and telemetry reads it for spans.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpumesh.router.fleet import Credit
from gpumesh.router.scheduling import Decision


@dataclass
class AttemptRecord:
    node_id: str
    decision: Decision
    queued_s: float
    error: str = ""          # gRPC code name when the attempt failed


@dataclass
class DispatchRecord:
    """What happened to one request (read by the servicer for metadata, and by tracing)."""

    model: str = ""
    prompt_tokens: int = 0
    attempts: list[AttemptRecord] = field(default_factory=list)
    chunks: int = 0
    migrations: int = 0      # times the stream continued on another node after output
    prefill_node_id: str = ""   # disaggregated prefill/decode: the node that ran the prompt

    @property
    def node_id(self) -> str:
        return self.attempts[-1].node_id if self.attempts else ""


@dataclass
class Assignment:
    """One attempt's slot on a node: where to call, why it was chosen, what it was charged.
    ``credit`` is released by whoever holds the assignment (dispatch, or the node's reports
    for a lookaside pick)."""

    node_id: str
    address: str
    decision: Decision
    credit: Credit
    queued_s: float
    frontends: tuple[str, ...] = ()   # the node's front-end processes' own addresses

    @property
    def charged_tokens(self) -> int:
        """The prompt tokens the node was charged: what it still prefills (prefix locality:
        the prompt less the prefix it holds), told to the node as CHARGED_TOKENS."""
        return self.credit.tokens


# Called with each attempt's assignment before the node call; returns metadata to add
# (tracing: the attempt span's context).
AttemptHook = Callable[[Assignment], Sequence[tuple[str, str]]]

# Charges the chosen node for a request: (node id, decision) -> the request's credit.
ChargeFn = Callable[[str, Decision], Credit]
