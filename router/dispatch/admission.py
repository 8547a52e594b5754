"""Admission: a routing decision plus a charged credit, or a bounded wait for one.

``AdmissionQueue.acquire`` runs the routing pipeline and charges the chosen node at once (the
router's own counts move before any heartbeat can). When every eligible node is at its max
concurrency the request waits in a bounded queue per model, up to its deadline: FIFO per
client key and round robin between keys (``fairqueue``: one key's burst cannot starve
another's); a full queue answers RESOURCE_EXHAUSTED at once (to the request, or to the newest
waiter of a key over its fair share); no eligible node at all -> UNAVAILABLE. Queues are pumped
whenever the registry reports a change (a slot freed, a heartbeat, a join).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpumesh.router import errors
from gpumesh.router.auth.interceptor import current_key_name
from gpumesh.router.dispatch.fairqueue import FairQueue
from gpumesh.router.dispatch.records import ChargeFn
from gpumesh.router.fleet import Credit, Registry
from gpumesh.router.scheduling import Decision, NoCandidate, Profile, RequestInfo, select_from
from gpumesh.router.scheduling.filters import Filter
from gpumesh.router.scheduling.steering import request_filters


@dataclass(eq=False)
class _Waiter:
    info: RequestInfo
    exclude: frozenset[str]
    charge: ChargeFn
    future: asyncio.Future[tuple[Decision, Credit]]
    key: str = ""   # the client's API key name (router.auth); "" without keys


class AdmissionQueue:
    """Decides and charges; queues per model while the fleet is busy. ``clock``: monotonic
    seconds (deadlines are on it); ``queue_bound``: waiters per model."""

    def __init__(self, registry: Registry, profile: Profile, filters: Sequence[Filter],
                 rng: random.Random, clock: Callable[[], float], *, queue_bound: int,
                 decision_sample_size: int) -> None:
        self.registry = registry
        self.profile = profile
        self.filters = tuple(filters)
        self.rng = rng
        self.clock = clock
        self.queue_bound = queue_bound
        self.decision_sample_size = decision_sample_size
        self._queues: dict[str, FairQueue[_Waiter]] = {}
        registry.add_listener(self._on_change)

    def decide(self, info: RequestInfo, exclude: frozenset[str] = frozenset()) -> Decision:
        """One routing decision now, without charging. Reads the registry's cached candidates
        lazily: O(decision_sample_size) on a large fleet."""
        return select_from(self.profile, self.registry.candidate_source(info.model, exclude),
                           info, self.rng, self.filters + request_filters(info),
                           self.decision_sample_size)

    def queue_length(self, model: str) -> int:
        return len(self._queues.get(model, ()))

    async def acquire(self, info: RequestInfo, deadline: float, charge: ChargeFn,
                      exclude: frozenset[str] = frozenset()) -> tuple[Decision, Credit, float]:
        """Returns (decision, credit, seconds queued). Raises RouterError."""
        start = self.clock()
        if deadline <= start:
            raise errors.deadline_exhausted()
        queue = self._queues.get(info.model)
        if queue is None:
            queue = self._queues[info.model] = FairQueue(self.queue_bound)
        if not queue:
            try:
                d = self.decide(info, exclude)
                return d, charge(d.node_id, d), 0.0
            except NoCandidate as e:
                if not e.busy:
                    raise errors.no_healthy_node(info.model, e.filtered) from None
        fut: asyncio.Future[tuple[Decision, Credit]] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(info, exclude, charge, fut, current_key_name.get())
        admitted, displaced = queue.push(waiter)
        if not admitted:
            raise errors.queue_full(info.model, self.queue_bound)
        if displaced is not None and not displaced.future.done():
            # a key over its fair share of a full queue gives its newest place up
            displaced.future.set_exception(errors.queue_full(info.model, self.queue_bound))
        try:
            done, _ = await asyncio.wait({fut}, timeout=deadline - start)
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        if not done:
            self._abandon(waiter)
            raise errors.queue_deadline(info.model, self.clock() - start)
        d, credit = fut.result()   # re-raises a RouterError set by the pump
        return d, credit, self.clock() - start

    def _abandon(self, w: _Waiter) -> None:
        queue = self._queues.get(w.info.model)
        if queue is not None:
            queue.remove(w)
        if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
            _, credit = w.future.result()
            credit.finish(admitted=False)   # granted as we gave up: hand the slot back
        else:
            w.future.cancel()

    def _on_change(self, models: frozenset[str]) -> None:
        for m in models:
            if self._queues.get(m):
                self._pump(m)

    def _pump(self, model: str) -> None:
        queue = self._queues[model]
        while (w := queue.peek()) is not None:
            if w.future.done():
                queue.pop()
                continue
            try:
                d = self.decide(w.info, w.exclude)
            except NoCandidate as e:
                if e.busy:
                    return
                queue.pop()
                w.future.set_exception(errors.no_healthy_node(model, e.filtered))
                continue
            queue.pop()
            w.future.set_result((d, w.charge(d.node_id, d)))
