"""What the node has admitted, per router: the figures heartbeats carry.

Counters are cumulative since this process started (the node's incarnation), so a router
that misses a heartbeat loses nothing: it compares its own dispatch counts with the latest
cumulative figures (the router clears its credits from them). ``admitted_requests -
finished_requests`` is how many of a router's requests the node holds at the report (the
router's exact change since it is its in-flight count now minus that).

``pending_prefill_tokens`` is the node's own count of prompt tokens admitted whose request
has not produced its first token yet (queued or in prefill). It is engine-independent, so the
vLLM and the simulated node report it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpumesh.types import RouterAccount


@dataclass
class Admission:
    """One admitted request's ledger entry; the servicer calls first_token/finish on it."""

    router_id: str
    prompt_tokens: int
    charged_tokens: int
    _ledger: AdmissionLedger = field(repr=False)
    _first: bool = False
    _done: bool = False

    def first_token(self) -> None:
        if self._first or self._done:
            return
        self._first = True
        self._ledger._on_first(self)

    def finish(self) -> None:
        if self._done:
            return
        if not self._first:
            # Ended before any token (error, cancel): no longer pending prefill, and counted
            # as past its first token so the router's credit for it is released too.
            self.first_token()
        self._done = True
        self._ledger._on_finish(self)


class AdmissionLedger:
    """What this node admitted: in-flight and per-router counts (a router keeps its own,
    different ledger of what it dispatched). Single event loop; not thread-safe."""

    def __init__(self) -> None:
        self._accounts: dict[str, RouterAccount] = {}
        self.in_flight = 0
        # admitted requests past their first token and not ended: the streams sending
        # messages now (the coalescing budget divides by it)
        self.streaming = 0
        self.pending_prefill_tokens = 0

    def admit(self, router_id: str, prompt_tokens: int,
              charged_tokens: int | None = None) -> Admission:
        """Called once a request passed validation. router_id "" = a direct client (counted
        apart, not reported). ``charged_tokens``: what the router charged for it (metadata
        CHARGED_TOKENS or the ticket), so the per-router token counters match the router's own
        credit arithmetic exactly; ``prompt_tokens`` (the real count) drives pending prefill."""
        charged = prompt_tokens if charged_tokens is None else charged_tokens
        acc = self._accounts.get(router_id) or RouterAccount(router_id, finished_requests=0)
        self._accounts[router_id] = acc.admit(charged)
        self.in_flight += 1
        self.pending_prefill_tokens += prompt_tokens
        return Admission(router_id, prompt_tokens, charged, self)

    def _on_first(self, a: Admission) -> None:
        self._accounts[a.router_id] = self._accounts[a.router_id].first_token(a.charged_tokens)
        self.pending_prefill_tokens -= a.prompt_tokens
        self.streaming += 1

    def _on_finish(self, a: Admission) -> None:
        self.in_flight -= 1
        self.streaming -= 1
        self._accounts[a.router_id] = self._accounts[a.router_id].finish()

    def accounts(self) -> tuple[RouterAccount, ...]:
        return tuple(a for rid, a in self._accounts.items() if rid)
