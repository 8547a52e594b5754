"""``ServingState``: whether this node process is serving or draining, and what it admitted."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpumesh.node.accounting import AdmissionLedger


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
