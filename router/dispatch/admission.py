"""Admission: a routing decision plus a charged credit, or a bounded wait for one.

``AdmissionQueue.acquire`` runs the routing pipeline and charges the chosen node at once (the
router's own counts move before any heartbeat can). When every eligible node is at its max
concurrency the request waits in a bounded queue per model, up to its deadline: FIFO per
client key and round robin between keys (``fairqueue``: one key's burst cannot starve
another's); a full queue answers RESOURCE_EXHAUSTED at once (to the request, or to the newest
waiter of a key over its fair share); no eligible node at all -> UNAVAILABLE. Queues are pumped
whenever the registry reports a change (a slot freed, a heartbeat, a join).

Service-level objectives (``slo``): a request whose decision predicts that the best node
misses its TTFT (or TPOT) objective is not charged to it. With ``slo_admission = "queue"`` it
waits in a second line per model, earliest TTFT objective first (bounded by ``queue_bound``,
its objective's budget and its deadline), and goes as soon as a pump finds a node predicted to
meet it; when its budget runs out it gets RESOURCE_EXHAUSTED with a retry-after
(``slo.slo_verdict``). The objective's line is pumped before the fair queue.
"""

from __future__ import annotations

import asyncio
import bisect
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpumesh.router import errors
from gpumesh.router.auth.interceptor import current_key_name
from gpumesh.router.dispatch.fairqueue import FairQueue
from gpumesh.router.dispatch import slo
from gpumesh.router.dispatch.records import ChargeFn
from gpumesh.router.fleet import Credit, Registry
from gpumesh.router.scheduling import Decision, NoCandidate, Policy, RequestInfo, select_from
from gpumesh.router.scheduling.filters import Filter, request_filters


@dataclass(eq=False)
class _Waiter:
    info: RequestInfo
    exclude: frozenset[str]
    charge: ChargeFn
    future: asyncio.Future[tuple[Decision, Credit]]
    key: str = ""   # the client's API key name (router.auth); "" without keys
    arrived: float = 0.0   # (clock) when acquire began
    deadline: float = field(default=float("inf"))
    # waiting for a node predicted to meet its TTFT objective: when its budget ends (clock)
    slo_until: float = field(default=float("inf"))


class AdmissionQueue:
    """Decides and charges; queues per model while the fleet is busy. ``clock``: monotonic
    seconds (deadlines are on it); ``queue_bound``: waiters per model."""

    def __init__(self, registry: Registry, profile: Policy, filters: Sequence[Filter],
                 rng: random.Random, clock: Callable[[], float], *, queue_bound: int,
                 decision_sample_size: int, slo_admission: str = "queue") -> None:
        if slo_admission not in slo.MODES:
            raise ValueError(f"slo_admission must be one of {slo.MODES}")
        self.slo_admission = slo_admission
        self.registry = registry
        self.profile = profile
        self.filters = tuple(filters)
        self.rng = rng
        self.clock = clock
        self.queue_bound = queue_bound
        self.decision_sample_size = decision_sample_size
        self._queues: dict[str, FairQueue[_Waiter]] = {}
        # per model: waiters for a node predicted to meet their objectives, by slo_until
        self._slo_lines: dict[str, list[_Waiter]] = {}
        registry.add_listener(self._on_change)

    def decide(self, info: RequestInfo, exclude: frozenset[str] = frozenset()) -> Decision:
        """One routing decision now, without charging. Reads the registry's cached candidates
        lazily: O(decision_sample_size) on a large fleet."""
        return select_from(self.profile, self.registry.candidate_source(info.model, exclude),
                           info, self.rng, self.filters + request_filters(info),
                           self.decision_sample_size)

    def queue_length(self, model: str) -> int:
        return len(self._queues.get(model, ())) + len(self._slo_lines.get(model, ()))

    async def acquire(self, info: RequestInfo, deadline: float, charge: ChargeFn,
                      exclude: frozenset[str] = frozenset()) -> tuple[Decision, Credit, float]:
        """Returns (decision, credit, seconds queued). Raises RouterError."""
        start = self.clock()
        if deadline <= start:
            raise errors.deadline_exhausted()
        queue = self._queues.get(info.model)
        if queue is None:
            queue = self._queues[info.model] = FairQueue(self.queue_bound)
        fut: asyncio.Future[tuple[Decision, Credit]] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(info, exclude, charge, fut, current_key_name.get(), start, deadline)
        check = slo.ADMIT
        if not queue:
            try:
                d = self.decide(info, exclude)
                check = self._slo(d, waiter, start)
                if check.verdict is slo.Verdict.ADMIT:
                    return d, charge(d.node_id, d), 0.0
            except NoCandidate as e:
                if not e.busy:
                    raise errors.no_healthy_node(info.model, e.filtered) from None
        if check.verdict is slo.Verdict.REJECT:
            raise slo.unmet(info.model, check)
        if check.verdict is slo.Verdict.WAIT:
            line = self._slo_lines.setdefault(info.model, [])
            if len(line) >= self.queue_bound:
                raise slo.unmet(info.model, slo.SloCheck(
                    slo.Verdict.REJECT, min(max(check.seconds, slo.MIN_RETRY_AFTER_S),
                                            slo.MAX_RETRY_AFTER_S), check.reason))
            waiter.slo_until = start + check.seconds
            bisect.insort(line, waiter, key=lambda w: w.slo_until)
        else:
            admitted, displaced = queue.push(waiter)
            if not admitted:
                raise errors.queue_full(info.model, self.queue_bound)
            if displaced is not None and not displaced.future.done():
                # a key over its fair share of a full queue gives its newest place up
                displaced.future.set_exception(errors.queue_full(info.model, self.queue_bound))
        try:
            done, _ = await asyncio.wait({fut}, timeout=min(deadline, waiter.slo_until) - start)
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        if not done:
            self._abandon(waiter)
            if waiter.slo_until < deadline:   # its objective's budget ran out
                raise slo.unmet(info.model, self._slo_retry(waiter))
            raise errors.queue_deadline(info.model, self.clock() - start)
        d, credit = fut.result()   # re-raises a RouterError set by the pump
        return d, credit, self.clock() - start

    def _slo(self, d: Decision, w: _Waiter, now: float) -> slo.SloCheck:
        return slo.slo_verdict(d, w.info, now - w.arrived, w.deadline - now,
                               self.slo_admission)

    def _slo_retry(self, w: _Waiter) -> slo.SloCheck:
        """The refusal of a waiter whose objective's budget ran out: the retry-after is the
        best node's predicted excess now (a decision without charging)."""
        now = self.clock()
        try:
            check = slo.slo_verdict(self.decide(w.info, w.exclude), w.info, now - w.arrived,
                                    0.0, "reject")
        except NoCandidate:
            check = slo.ADMIT
        if check.verdict is slo.Verdict.REJECT:
            return check
        return slo.SloCheck(slo.Verdict.REJECT, slo.MIN_RETRY_AFTER_S,
                            "its time-to-first-token budget ran out while waiting")

    def _expire(self, w: _Waiter) -> None:
        """A waiter moved to the objective's line by a pump: its budget ran out."""
        if w.future.done():
            return
        line = self._slo_lines.get(w.info.model)
        if line is not None and w in line:
            line.remove(w)
        w.future.set_exception(slo.unmet(w.info.model, self._slo_retry(w)))

    def _abandon(self, w: _Waiter) -> None:
        queue = self._queues.get(w.info.model)
        if queue is not None:
            queue.remove(w)
        line = self._slo_lines.get(w.info.model)
        if line is not None and w in line:
            line.remove(w)
        if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
            _, credit = w.future.result()
            credit.finish(admitted=False)   # granted as we gave up: hand the slot back
        else:
            w.future.cancel()

    def _on_change(self, models: frozenset[str]) -> None:
        for m in models:
            if self._slo_lines.get(m) and not self._pump_slo(m):
                continue   # the fleet is busy: nothing more can go
            if self._queues.get(m):
                self._pump(m)

    def _pump_slo(self, model: str) -> bool:
        """Sends the objective line's waiters whose best node is now predicted to meet
        their objectives, earliest budget first; False when the fleet is at capacity."""
        line = self._slo_lines[model]
        now = self.clock()
        for w in list(line):
            if w.future.done():
                line.remove(w)
                continue
            try:
                d = self.decide(w.info, w.exclude)
            except NoCandidate as e:
                if e.busy:
                    return False
                line.remove(w)
                w.future.set_exception(errors.no_healthy_node(model, e.filtered))
                continue
            if self._slo(d, w, now).verdict is slo.Verdict.ADMIT:
                line.remove(w)
                w.future.set_result((d, w.charge(d.node_id, d)))
        return True

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
            check = self._slo(d, w, self.clock())
            if check.verdict is slo.Verdict.WAIT and \
                    len(self._slo_lines.setdefault(model, [])) < self.queue_bound:
                queue.pop()   # its objective is now at stake: the objective's line
                w.slo_until = self.clock() + check.seconds
                bisect.insort(self._slo_lines[model], w, key=lambda x: x.slo_until)
                asyncio.get_running_loop().call_later(check.seconds, self._expire, w)
                continue
            queue.pop()
            if check.verdict is not slo.Verdict.ADMIT:
                w.future.set_exception(slo.unmet(model, check))
                continue
            w.future.set_result((d, w.charge(d.node_id, d)))
