"""Nodes the router refuses for a while because they sent garbage, and the per-node heartbeat
rate limit.

Who calls it: the ControlPlane servicer. A node whose registration or heartbeat fails
validation (``router.fleet.validation``) is removed from the fleet and put here with the
reason for ``quarantine_s`` seconds; its registrations are refused meanwhile, and GetFleet
lists it (state QUARANTINED, with the reason) so operators see why it is gone. A quarantined
node is never in the registry, so it is never scored.

``HeartbeatRate`` is a token bucket per stream: heartbeats beyond ``max_per_s`` (with a burst of
a few seconds' worth) are dropped unapplied, so a node flooding heartbeats costs the router
only their parsing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_ENTRIES = 4096   # quarantine records kept at most (oldest dropped): bounded memory


@dataclass(frozen=True)
class Quarantined:
    node_id: str
    address: str
    reason: str
    since: float        # clock seconds
    until: float


class Quarantine:
    """``clock``: monotonic seconds (the registry's)."""

    def __init__(self, quarantine_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.quarantine_s = quarantine_s
        self.clock = clock
        self._nodes: dict[str, Quarantined] = {}
        self.total = 0      # nodes quarantined since start (a metric)

    def add(self, node_id: str, address: str, reason: str) -> Quarantined:
        now = self.clock()
        self._nodes.pop(node_id, None)
        while len(self._nodes) >= MAX_ENTRIES:
            self._nodes.pop(next(iter(self._nodes)))
        q = self._nodes[node_id] = Quarantined(node_id[:256], address[:256], reason[:512], now,
                                               now + self.quarantine_s)
        self.total += 1
        return q

    def active(self, node_id: str) -> Quarantined | None:
        """The node's quarantine if it is still in force."""
        q = self._nodes.get(node_id)
        if q is None:
            return None
        if self.clock() >= q.until:
            del self._nodes[node_id]
            return None
        return q

    def listing(self) -> list[Quarantined]:
        """Quarantines in force, by node id (GetFleet)."""
        now = self.clock()
        for node_id in [n for n, q in self._nodes.items() if now >= q.until]:
            del self._nodes[node_id]
        return sorted(self._nodes.values(), key=lambda q: q.node_id)


class HeartbeatRate:
    """A token bucket: ``allow()`` is False for heartbeats beyond ``max_per_s`` (burst:
    ``burst_s`` seconds' worth, at least 4). ``max_per_s`` 0 = unlimited."""

    __slots__ = ("_clock", "_last", "_tokens", "burst", "dropped", "rate")

    def __init__(self, max_per_s: float, clock: Callable[[], float] = time.monotonic,
                 burst_s: float = 2.0) -> None:
        self.rate = max_per_s
        self.burst = max(4.0, max_per_s * burst_s)
        self._tokens = self.burst
        self._clock = clock
        self._last = clock()
        self.dropped = 0

    def allow(self) -> bool:
        if self.rate <= 0:
            return True
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.dropped += 1
        return False
