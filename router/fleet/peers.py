"""This router's share of all routers' dispatches, estimated from the nodes' reports."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from gpumesh.types import RouterAccount

Clock = Callable[[], float]


class PeerShare:
    """This router's share of the admissions its nodes report across every router, and its
    inverse ``factor`` (>= 1): how many requests all routers together are estimated to
    dispatch for each one this router dispatches.

    Why: a decision sees the fleet as of each node's last report plus THIS router's own
    dispatches since; its peers' dispatches since that report (other ``--workers`` processes,
    other replicas) are invisible until the next one. With W equal routers every one of them
    sees the same report and, counting only its own 1/W of the traffic, moves its estimate
    of a node W times too slowly: all of them keep sending to the node that reported the
    lighter load for the whole heartbeat interval, the next report shows the overshoot, and
    the split of in-flight requests between equal nodes swings by about one interval's
    arrivals. Scaling this router's unreported requests by ``factor`` (peers assumed to act
    like it, which they do when they see the same reports) restores one router's behaviour.

    Estimate: every accepted report carries each router's cumulative ``admitted_requests`` on
    that node; per node, the increase since the node's previous report, ours and all
    routers', is added to two sums over all nodes that decay with ``half_life_s`` (injected
    clock). ``factor`` = all / ours, 1 while there is too little data (fewer than
    ``MIN_ADMISSIONS`` in the decayed sum, or none of them ours) and capped at ``MAX_FACTOR``.
    One router alone (or peers that are idle) gives exactly 1, so a single router decides as
    if it had no peers. A counter going down (node restart) only resets that node's baseline.
    ``half_life_s`` <= 0 turns the estimate off (``factor`` stays 1)."""

    MIN_ADMISSIONS = 8.0
    MAX_FACTOR = 64.0

    def __init__(self, router_id: str, half_life_s: float, clock: Clock) -> None:
        self.router_id = router_id
        self.half_life_s = half_life_s
        self.clock = clock
        self._last: dict[str, tuple[int, int]] = {}   # node id -> (ours, all) cumulative
        self._ours = 0.0
        self._all = 0.0
        self._t = -math.inf
        self.factor = 1.0

    def observe(self, node_id: str, accounts: Iterable[RouterAccount]) -> None:
        """One accepted report of ``node_id`` with every router's account on it."""
        ours = total = 0
        for a in accounts:
            total += a.admitted_requests
            if a.router_id == self.router_id:
                ours = a.admitted_requests
        prev = self._last.get(node_id)
        self._last[node_id] = (ours, total)
        if self.half_life_s <= 0:
            return
        if prev is None or ours < prev[0] or total < prev[1]:
            return   # first report of this node, or its counters restarted: baseline only
        d_ours, d_all = ours - prev[0], total - prev[1]
        if d_all <= 0:
            return
        now = self.clock()
        if math.isfinite(self._t) and now > self._t:
            decay = 0.5 ** ((now - self._t) / self.half_life_s)
            self._ours *= decay
            self._all *= decay
        self._t = max(self._t, now)
        self._ours += d_ours
        self._all += d_all
        if self._all < self.MIN_ADMISSIONS or self._ours <= 0:
            self.factor = 1.0
        else:
            self.factor = min(max(self._all / self._ours, 1.0), self.MAX_FACTOR)

    def forget(self, node_id: str) -> None:
        self._last.pop(node_id, None)

