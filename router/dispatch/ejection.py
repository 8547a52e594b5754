"""Outlier ejection: a node that keeps failing, or answers far slower than its peers, gets no
new work for a while (Envoy's outlier detection, per node).

Who calls it: ``ObservedCall``, the outlier-feedback layer around each proxied node call
(``gpumesh.attempts``), reports each attempt's outcome (``success`` with its first-response
latency, ``failure`` for a node fault, ``failover.blames_node``); the routing filter drops
ejected nodes while some other candidate is left (an ejected node still serves when nothing
else can). Client errors (a bad prompt, a deadline the client set) are never reported.

- Consecutive failures: ``consecutive_failures`` node faults in a row eject the node.
- Latency: a node whose first-response latency (EWMA, ``latency_alpha``) exceeds
  ``latency_factor`` x the median of its peers' — with at least ``min_peers`` peers measured
  and at least ``latency_min_s`` — is ejected.
- Back-off: the k-th ejection in a row lasts ``base_s`` x 2^(k-1), capped at ``max_s``; a
  success after re-admission resets k. An ejected node re-admitted still carries its old
  latency average until new samples replace it; re-ejection on latency waits for
  ``min_samples`` new samples.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from gpumesh.attempts import NodeCall
from gpumesh.router import errors
from gpumesh.router.dispatch.failover import blames_node, failed_code
from gpumesh.router.scheduling.types import Candidate

log = logging.getLogger(__name__)


@dataclass
class _NodeHealth:
    failures: int = 0            # consecutive node faults
    ejections: int = 0           # consecutive ejections (back-off exponent)
    until: float = 0.0           # ejected until (monotonic seconds)
    latency_s: float | None = None
    samples: int = 0             # latency samples since the last (re-)admission


@dataclass(frozen=True)
class EjectionPolicy:
    consecutive_failures: int = 3
    latency_factor: float = 5.0
    latency_min_s: float = 0.5
    min_peers: int = 2
    min_samples: int = 5
    latency_alpha: float = 0.2
    base_s: float = 1.0
    max_s: float = 30.0

    @property
    def enabled(self) -> bool:
        return self.consecutive_failures > 0 or self.latency_factor > 0


@dataclass(slots=True, eq=False)
class OutlierEjector:
    """Per-node consecutive failures and latency against ``policy``, on ``clock`` (monotonic
    seconds)."""

    policy: EjectionPolicy
    clock: Callable[[], float]
    _nodes: dict[str, _NodeHealth] = field(init=False, default_factory=dict)

    def _get(self, node_id: str) -> _NodeHealth:
        h = self._nodes.get(node_id)
        if h is None:
            h = self._nodes[node_id] = _NodeHealth()
        return h

    def success(self, node_id: str, latency_s: float) -> None:
        """An attempt's first response arrived after ``latency_s`` seconds."""
        h = self._get(node_id)
        now = self.clock()
        h.failures = 0
        if h.until <= now:
            h.ejections = 0 if h.samples >= self.policy.min_samples else h.ejections
        a = self.policy.latency_alpha
        h.latency_s = latency_s if h.latency_s is None else (1 - a) * h.latency_s + a * latency_s
        h.samples += 1
        if self.policy.latency_factor > 0 and h.samples >= self.policy.min_samples:
            peers = [o.latency_s for n, o in self._nodes.items()
                     if n != node_id and o.latency_s is not None and o.until <= now]
            if len(peers) >= self.policy.min_peers:
                median = statistics.median(peers)
                limit = max(self.policy.latency_min_s, self.policy.latency_factor * median)
                if h.latency_s > limit:
                    self._eject(node_id, h, f"first-response latency {h.latency_s:.2f}s > "
                                            f"{self.policy.latency_factor}x peers' median "
                                            f"{median:.2f}s")

    def failure(self, node_id: str, why: str) -> None:
        """An attempt failed for a reason that blames the node."""
        h = self._get(node_id)
        h.failures += 1
        n = self.policy.consecutive_failures
        if n > 0 and h.failures >= n and h.until <= self.clock():
            self._eject(node_id, h, f"{h.failures} consecutive failures (last: {why})")

    def _eject(self, node_id: str, h: _NodeHealth, why: str) -> None:
        h.ejections += 1
        hold = min(self.policy.max_s, self.policy.base_s * 2 ** (h.ejections - 1))
        h.until = self.clock() + hold
        h.failures = 0
        h.samples = 0
        log.warning("node %s ejected for %.1fs: %s", node_id, hold, why)

    def ejected(self, node_id: str) -> bool:
        h = self._nodes.get(node_id)
        return h is not None and h.until > self.clock()

    def forget(self, node_id: str) -> None:
        """The node left the fleet; a new incarnation starts clean."""
        self._nodes.pop(node_id, None)

    # The routing filter (scheduling.filters protocol: the ejector itself is passed as a
    # filter); whole-set dependent, like kv_below.
    def __call__(self, candidates: Sequence[Candidate]) -> tuple[list[Candidate], dict[str, str]]:
        if not self._nodes:
            return list(candidates), {}
        now = self.clock()
        out = [c for c in candidates if (h := self._nodes.get(c.node_id)) is not None
               and h.until > now]
        if not out or len(out) == len(candidates):
            return list(candidates), {}
        gone = {c.node_id for c in out}
        return ([c for c in candidates if c.node_id not in gone],
                {n: "ejected (outlier)" for n in gone})

    def sample_conclusive(self, kept: Sequence[Candidate]) -> bool:
        """False when an ejected node survived (the sample held nothing else; the fleet may)."""
        return not any(self.ejected(c.node_id) for c in kept)


class ObservedCall:
    """Outlier feedback as a layer around one node call (``gpumesh.attempts.NodeCall``): its
    first answer's latency (from the call's start) is a success for the node; a failure that
    blames the node (``failover.blames_node``: not the client's fault nor its deadline) is a
    failure. ``deadline``: the request's, on ``ejector.clock``."""

    __slots__ = ("_deadline", "_ejector", "_inner", "_sent", "next", "node_id")

    def __init__(self, inner: NodeCall[bytes], ejector: OutlierEjector,
                 deadline: float) -> None:
        self._inner = inner
        self._ejector = ejector
        self._deadline = deadline
        self._sent = ejector.clock()
        self.node_id = inner.node_id
        self.next = inner.next   # nothing to observe between chunks

    async def first(self) -> bytes | None:
        chunk = await self._inner.first()
        if chunk is not None:
            self._ejector.success(self.node_id, self._ejector.clock() - self._sent)
        return chunk

    def close(self, error: Exception | None) -> None:
        if isinstance(error, errors.RouterError | grpc.aio.AioRpcError) and blames_node(
                error, self._ejector.clock(), self._deadline):
            self._ejector.failure(self.node_id, failed_code(error).name)
        self._inner.close(error)
