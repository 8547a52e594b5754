"""``ServingState``: whether this node process is serving or draining, and what it admitted."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpumesh.node.accounting import AdmissionLedger
from gpumesh.node.errors import already_exists


class ServingState:
    """Mutable serving state of one node process, shared by its servicers, its heartbeats and
    its drain (``gpumesh.node.app`` creates it once the port is bound). Single event loop."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.draining = False
        self.ledger = AdmissionLedger()
        # prompt ids -> tokens of their prefix the engine holds in its KV cache (the node's
        # mirror of its engine's block events, gpumesh.node.cache); None = not known
        self.cached_prefix_tokens: Callable[[Sequence[int]], int] | None = None
        # each front-end process's own host:port when the node has several (gpumesh.node.frontends)
        self.frontend_addresses: tuple[str, ...] = ()
        # request ids the engine is running (both APIs): one engine request per id
        self.request_ids: set[str] = set()

    def claim_request_id(self, request_id: str) -> None:
        """Holds ``request_id`` for a request about to run; the caller discards it from
        ``request_ids`` once the engine is done with it. A second request with an id in
        flight is the caller's mistake: ALREADY_EXISTS (RequestError) before the engine
        sees it, so it neither fails as an engine error nor aborts the running request."""
        if request_id in self.request_ids:
            raise already_exists(f"request id {request_id[:128]!r} is already in flight on "
                                 "this node: use a unique id per request, or none")
        self.request_ids.add(request_id)
