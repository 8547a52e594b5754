"""This router's own accounting per node incarnation: a ``Credit`` per dispatched request.

Who calls it: the registry (``charge`` on dispatch, ``on_report`` with each accepted
heartbeat's account for this router, ``housekeep`` when it reads the node and from its
sweeper) and the dispatcher (``Credit.first_token`` / ``Credit.finish``). Single-threaded.

Each dispatch gets a per-node ordinal and a ``Credit`` holding its prompt-token estimate. A
credit is outstanding until the request's first token:
- proxy streams: released by the dispatcher at the first token it forwards, one by one;
- unary and lookaside (the router sees no first token): released oldest-first as the node's
  reported ``first_token_requests`` for this router grows, or at a time bound, or (unary) at
  completion. Never wholesale at a heartbeat.
A credit is "not yet in the last report" when its ordinal is above the report's
``admitted_requests`` (corrected for requests the node never admitted, e.g. rejected ones).

The decode term's D (``decode_delta``, see router/scheduling/predictor.py) is
this router's requests in flight now minus how many of them the last report held (the
reported part capped at 0: requests the node had ended before the report whose ends are
still on the way to the router are no change). A node that sends ``finished_requests`` says
so itself (admitted - finished, bounded by this router's own reported requests in flight: an
earlier process's requests under the same router id and lookaside requests are in the
node's count but not in ours); without it (foreign engines) every in-flight request up to
the cutoff is taken as held, so a finish seen after a report counts as one since it --
twice when the report already had it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from gpumesh.types import RouterAccount

# What a report without an account for this router means: nothing admitted yet.
_NO_ACCOUNT = RouterAccount(router_id="")


@dataclass(slots=True, eq=False)
class Credit:
    """One dispatched request's claim on a node: the ``tokens`` charged for it, its
    ``ordinal`` among the requests dispatched to the node, held until ``expires_at`` at most.
    ``blind`` = the router will not see its first token (unary, lookaside);
    ``slot_until_finish`` = it counts in router in-flight until ``finish`` (proxy and unary)
    rather than until its tokens are released (lookaside)."""

    ledger: CreditLedger
    ordinal: int
    tokens: int
    blind: bool
    expires_at: float
    slot_until_finish: bool
    pending: bool = field(init=False, default=True)   # tokens still counted (before first token)
    slot: bool = field(init=False, default=True)      # counted in router in-flight

    def first_token(self) -> None:
        """The router forwarded this request's first token (proxy streams)."""
        self.ledger.first_token(self)

    def finish(self, admitted: bool = True) -> None:
        """The request ended (any outcome). ``admitted=False`` when the node refused it before
        admission, so its ordinal never appears in the node's admitted count."""
        self.ledger.finish(self, admitted)


class CreditLedger:
    """This router's counts for one node incarnation (see the module docstring)."""

    def __init__(self, incarnation: str, on_release: Callable[[], None] | None = None) -> None:
        self.incarnation = incarnation
        self.dispatched = 0
        self.in_flight = 0
        self._pending: dict[int, Credit] = {}   # ordinal order = dispatch order
        self._pending_tokens = 0
        self._rejected: list[int] = []          # ordinals the node never admitted, sorted
        self._rejected_below = 0                # pruned rejected ordinals <= cutoff
        self._cutoff = 0                        # ordinals <= cutoff are in the last report
        self._unreported_tokens = 0             # pending credits with ordinal > cutoff
        self._unreported_n = 0
        # The decode term's input (``decode_delta``): requests whose finish this router sees
        # (proxy, unary) still in flight, split by ordinal at the cutoff (above: not in the
        # last report whatever their phase; at or below: ``_live_reported``), how many of them
        # the last report held (``_held``), and lookaside credits (finish unseen) pending and
        # unreported.
        self._live_unreported: set[int] = set()
        self._live_reported = 0
        self._held = 0
        self._blind_slot_unreported = 0
        self._synced = False
        self._base_admitted = 0
        self._base_first = 0
        self._proxy_first_seen = 0
        self._blind_done = 0
        self._on_release = on_release
        # Bumped by every change a Candidate reads (the registry's per-node cache checks it).
        self.version = 0
        # No blind credit expires before this (a lower bound: may be early, never late).
        self.next_expiry = math.inf

    # --- dispatch side

    def charge(self, tokens: int, now: float, *, blind: bool, hold_s: float,
               slot_until_finish: bool = True) -> Credit:
        self.dispatched += 1
        c = Credit(self, self.dispatched, max(int(tokens), 0), blind, now + hold_s,
                   slot_until_finish)
        self._pending[c.ordinal] = c
        self._pending_tokens += c.tokens
        self._unreported_tokens += c.tokens     # a new ordinal is above any report's cutoff
        self._unreported_n += 1
        if slot_until_finish:
            self._live_unreported.add(c.ordinal)
        else:
            self._blind_slot_unreported += 1
        self.in_flight += 1
        self.version += 1
        if blind and c.expires_at < self.next_expiry:
            self.next_expiry = c.expires_at
        return c

    def first_token(self, c: Credit) -> None:
        if c.pending and not c.blind:
            self._proxy_first_seen += 1
        self._release_tokens(c)

    def finish(self, c: Credit, admitted: bool) -> None:
        if c.pending and not admitted:
            bisect.insort(self._rejected, c.ordinal)
        elif c.pending and c.blind:
            self._blind_done += 1   # a finished unary request had its first token
        self._release_tokens(c)
        self._release_slot(c)

    def _release_tokens(self, c: Credit) -> None:
        if c.pending:
            c.pending = False
            self.version += 1
            self._pending.pop(c.ordinal, None)
            self._pending_tokens -= c.tokens
            if c.ordinal > self._cutoff:
                self._unreported_tokens -= c.tokens
                self._unreported_n -= 1
                if not c.slot_until_finish:
                    self._blind_slot_unreported -= 1
            if not c.slot_until_finish:
                self._release_slot(c)

    def _release_slot(self, c: Credit) -> None:
        if c.slot:
            c.slot = False
            self.version += 1
            self.in_flight -= 1
            if c.slot_until_finish:
                if c.ordinal > self._cutoff:
                    self._live_unreported.discard(c.ordinal)
                else:
                    self._live_reported -= 1
            if self._on_release is not None:
                self._on_release()

    # --- report side

    def on_report(self, account: RouterAccount | None) -> None:
        self.version += 1   # the cutoff (what counts as unreported) may move
        a = account or _NO_ACCOUNT
        if not self._synced:
            # A node's counters are cumulative per incarnation and may predate this ledger
            # (router restarted with the same id): take the offset from the first report.
            self._synced = True
            self._base_admitted = max(0, a.admitted_requests - self.dispatched
                                      + len(self._rejected))
            self._base_first = max(0, a.first_token_requests - self._proxy_first_seen
                                   - self._blind_done)
        admitted = max(0, a.admitted_requests - self._base_admitted)
        cutoff = admitted + self._rejected_below
        i = 0
        while i < len(self._rejected) and self._rejected[i] <= cutoff:
            cutoff += 1
            i += 1
        self._rejected_below += i
        del self._rejected[:i]
        new_cutoff = max(self._cutoff, min(cutoff, self.dispatched))
        live = self._live_unreported
        for ordinal in range(self._cutoff + 1, new_cutoff + 1):   # now in a report
            c = self._pending.get(ordinal)
            if c is not None:
                self._unreported_tokens -= c.tokens
                self._unreported_n -= 1
                if not c.slot_until_finish:
                    self._blind_slot_unreported -= 1
            if ordinal in live:
                live.discard(ordinal)
                self._live_reported += 1
        self._cutoff = new_cutoff
        # How many of this router's requests still in flight the report holds. Without the
        # node's finished count: all of them up to the cutoff (a finish the router sees after
        # the report is taken to have come after it). With it: admitted - finished, the
        # node's own count, so a finish that reached the node before the report but this
        # router after it is not subtracted twice. Raw counters: an earlier process's
        # admissions under this router id are in both and cancel once its requests end; until
        # then (and for lookaside requests, whose finish this router never sees) the node
        # holds more than this router counts in flight, so the bound keeps the estimate
        # between the exact one and the inferred one.
        self._held = self._live_reported
        if a.finished_requests is not None:
            self._held = min(self._live_reported,
                             max(0, a.admitted_requests - a.finished_requests))
        # Blind credits: release oldest-first as the node's first-token count grows.
        blind_first = max(0, a.first_token_requests - self._base_first - self._proxy_first_seen)
        if self._blind_done < blind_first:
            for c in [c for c in self._pending.values() if c.blind]:
                if self._blind_done >= blind_first:
                    break
                self._blind_done += 1
                self._release_tokens(c)

    def housekeep(self, now: float) -> None:
        """Releases blind credits past their time bound. Cheap when none is due (``now`` before
        ``next_expiry``); the registry calls it when it reads the node and from its sweeper."""
        if now < self.next_expiry:
            return
        expired = [c for c in self._pending.values() if c.blind and c.expires_at <= now]
        self.next_expiry = min((c.expires_at for c in self._pending.values()
                                if c.blind and c.expires_at > now), default=math.inf)
        for c in expired:
            self._blind_done += 1
            self._release_tokens(c)

    # --- reads

    @property
    def pending_tokens(self) -> int:
        return self._pending_tokens

    @property
    def pending_requests(self) -> int:
        return len(self._pending)

    def decode_delta(self) -> int:
        """How far the node's running + waiting requests have moved since its last report, as
        far as this router's requests show it: its requests in flight now (those whose finish
        it sees: proxy, unary) minus how many of them the report held, plus lookaside
        requests pending and unreported (their finish is not seen). The report holds
        admitted - finished when the node sends ``finished_requests``; otherwise every
        in-flight request up to the report's admission cutoff, so that a finish seen after the
        report counts as one since it. The reported part is capped at 0: the requests the
        router still counted in flight at the report beyond what the node held had already
        ended at the node (their ends were on the way), so the first finishes seen after the
        report are theirs and change nothing; only finishes beyond them lower D. May be
        negative. O(1)."""
        return (len(self._live_unreported) + min(0, self._live_reported - self._held)
                + self._blind_slot_unreported)

    def unreported(self) -> tuple[int, int]:
        """(prompt tokens, requests) outstanding and dispatched after the last report. O(1):
        kept as running sums (charge adds, a release or a report's cutoff subtracts)."""
        return self._unreported_tokens, self._unreported_n

