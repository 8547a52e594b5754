"""Gray-failure watch over the router's in-flight node calls.

A node that hangs (SIGSTOP, a wedged engine, a partition that keeps its TCP connections open)
fails nothing: its streams just stop moving. Who calls it: ``WatchedCall``, the stall-watch
layer around each proxied node call (``gpumesh.attempts``), registers the call (``track``),
marks progress at every chunk (``Tracked.progress``, one clock read) and forgets it when the
attempt ends; a task of the dispatcher runs ``sweep`` every ``period_s``; the registry's
removal listener calls ``node_gone``.

Rule (``sweep``): a stream is *lost* when its node has sent no report for ``stall_s`` or is
gone from the fleet (lease expired, stream closed), another healthy node serves its model, and
the stream itself has made no progress for ``stall_s``. A unary call shows no progress: it is
lost only when its node leaves the fleet (``node_gone``). A node whose heartbeats stop while its
streams keep moving (a partitioned control stream) keeps its streams; a node that keeps
heartbeating but is merely slow is left to the first-token deadline and outlier ejection.
Losing a call cancels it; ``WatchedCall`` turns that cancellation into UNAVAILABLE blaming the
node (``failover.lost_call``), which the attempt layers fail over (retry before the first
token, continuation after it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gpumesh.attempts import NodeCall
from gpumesh.router.dispatch.failover import lost_call

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Tracked:
    """One node call in flight. ``last``: monotonic time of its start or latest chunk."""

    node_id: str
    call: Any
    last: float
    streaming: bool = True   # a unary call shows no progress until it ends
    lost: str = ""           # why the watch gave up on it ("" while it is fine)

    def progress(self, now: float) -> None:
        self.last = now


@dataclass
class InFlightWatch:
    """``healthy(node_id, now)``: True while the node is in the fleet with a fresh report.
    ``replaceable(node_id, now)``: True when another healthy node serves one of its models (a
    call on the only node of its model is left alone until the node leaves the fleet: failing
    it over could only fail it, and a saturated node that reports late is still working)."""

    healthy: Callable[[str, float], bool]
    clock: Callable[[], float]
    stall_s: float
    replaceable: Callable[[str, float], bool] = lambda _node_id, _now: True
    _calls: dict[str, set[Tracked]] = field(default_factory=dict)

    def track(self, node_id: str, call: Any, streaming: bool = True) -> Tracked:
        t = Tracked(node_id, call, self.clock(), streaming)
        self._calls.setdefault(node_id, set()).add(t)
        return t

    def untrack(self, t: Tracked) -> None:
        calls = self._calls.get(t.node_id)
        if calls is not None:
            calls.discard(t)
            if not calls:
                del self._calls[t.node_id]

    def in_flight(self, node_id: str) -> int:
        return len(self._calls.get(node_id, ()))

    def sweep(self) -> int:
        """Cancels the calls that stalled on unhealthy nodes; returns how many."""
        now = self.clock()
        n = 0
        for node_id in list(self._calls):
            if self.healthy(node_id, now) or not self.replaceable(node_id, now):
                continue
            for t in list(self._calls.get(node_id, ())):
                if not t.lost and t.streaming and now - t.last >= self.stall_s:
                    n += self._lose(t, f"no progress for {now - t.last:.2f}s and node "
                                       f"{node_id} is stale or gone")
        return n

    def node_gone(self, node_id: str) -> None:
        """The node left the fleet (lease expired, stream closed): its stalled calls now."""
        now = self.clock()
        for t in list(self._calls.get(node_id, ())):
            if not t.lost and (not t.streaming or now - t.last >= self.stall_s):
                self._lose(t, f"node {node_id} left the fleet and the call made no progress "
                              f"for {now - t.last:.2f}s")

    def _lose(self, t: Tracked, why: str) -> int:
        t.lost = why
        log.warning("failing over a call: %s", why)
        t.call.cancel()
        return 1

    async def run(self, period_s: float) -> None:
        """Sweeps every ``period_s`` until cancelled."""
        while True:
            await asyncio.sleep(period_s)
            try:
                self.sweep()
            except Exception:  # a bug here must not stop the watch
                log.exception("in-flight watch sweep failed")


class WatchedCall:
    """The stall watch as a layer around one node call (``gpumesh.attempts.NodeCall``):
    tracked while it runs, its progress marked at each chunk, and a cancellation the watch
    caused raised as UNAVAILABLE blaming the node (a client's cancellation passes)."""

    __slots__ = ("_clock", "_inner", "_tracked", "_watch", "node_id")

    def __init__(self, inner: NodeCall[bytes], watch: InFlightWatch, streaming: bool) -> None:
        self._inner = inner
        self._watch = watch
        self._clock = watch.clock
        self.node_id = inner.node_id
        self._tracked = watch.track(inner.node_id, inner, streaming)

    async def first(self) -> bytes | None:
        return await self._progress(self._inner.first())

    async def next(self) -> bytes | None:
        return await self._progress(self._inner.next())

    async def _progress(self, read: Awaitable[bytes | None]) -> bytes | None:
        """One read of the inner call: progress marked, or the watch's cancellation raised
        as the node's failure."""
        try:
            chunk = await read
        except asyncio.CancelledError as e:
            raise lost_call(e, self._tracked) from None
        self._tracked.last = self._clock()
        return chunk

    def close(self, error: Exception | None) -> None:
        self._watch.untrack(self._tracked)
        self._inner.close(error)
