"""Dispatch: pick a node, queue when the fleet is busy, call the node, retry once.

Who calls it: the Inference and Router servicers. Contract:
- ``acquire`` runs the routing pipeline for a request and charges the chosen node at once
  (the router's own counts move before any heartbeat can). When every eligible node is at its
  max concurrency the request waits in a bounded FIFO queue per model, up to its deadline;
  a full queue answers RESOURCE_EXHAUSTED at once; no eligible node at all -> UNAVAILABLE.
  Queues are pumped whenever the registry reports a change (a slot freed, a heartbeat, a join).
- ``stream`` proxies GenerateStream: a node failure before the first chunk reached the client
  is retried once on another node; after it -> UNAVAILABLE naming the node. The credit for the
  request's prompt tokens is released at its first chunk, the in-flight slot at its end.
- ``unary`` proxies Generate, retrying once on another node if the node fails.
- ``pick`` (lookaside) only charges: credits are released by the node's reports.
Cancelling the caller's task cancels the outbound call, so the node aborts the request.

Every decision and attempt is kept in a ``DispatchRecord`` (for trailing metadata and traces).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from gpumesh.router import errors
from gpumesh.router.config import RouterConfig
from gpumesh.router.fleet import Credit, Registry
from gpumesh.router.scheduling import Decision, NoCandidate, Profile, RequestInfo, select_from
from gpumesh.router.scheduling.filters import Filter
from gpumesh.router.transport import NodeChannels, dispatch_metadata

log = logging.getLogger(__name__)


@dataclass
class AttemptRecord:
    node_id: str
    decision: Decision
    queued_s: float
    error: str = ""          # gRPC code name when the attempt failed


@dataclass
class DispatchRecord:
    """What happened to one request (read by the servicer for metadata, and by tracing)."""

    model: str = ""
    prompt_tokens: int = 0
    attempts: list[AttemptRecord] = field(default_factory=list)
    chunks: int = 0

    @property
    def node_id(self) -> str:
        return self.attempts[-1].node_id if self.attempts else ""


@dataclass
class Lease:
    node_id: str
    address: str
    decision: Decision
    credit: Credit
    queued_s: float
    frontends: tuple[str, ...] = ()   # the node's front-end processes' own addresses


# Called with each attempt's lease before the node call; returns metadata to add (tracing).
AttemptHook = Callable[[Lease], Sequence[tuple[str, str]]]


@dataclass
class _Waiter:
    info: RequestInfo
    exclude: frozenset[str]
    charge: Callable[[str, Decision], Credit]
    future: asyncio.Future[tuple[Decision, Credit]]


class Dispatcher:
    def __init__(self, config: RouterConfig, registry: Registry, channels: NodeChannels,
                 profile: Profile, filters: Sequence[Filter], rng: random.Random,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.registry = registry
        self.channels = channels
        self.profile = profile
        self.filters = tuple(filters)
        self.rng = rng
        self.clock = clock   # deadlines (seconds, monotonic)
        self._queues: dict[str, deque[_Waiter]] = {}
        registry.add_listener(self._on_change)

    # ------------------------------------------------------------------ picking

    def decide(self, info: RequestInfo, exclude: frozenset[str] = frozenset()) -> Decision:
        """One routing decision now, without charging (Router.Pick preview, tests). Reads the
        registry's cached candidates lazily: O(decision_sample_size) on a large fleet."""
        return select_from(self.profile, self.registry.candidate_source(info.model, exclude),
                           info, self.rng, self.filters, self.config.decision_sample_size)

    def queue_length(self, model: str) -> int:
        return len(self._queues.get(model, ()))

    async def acquire(self, info: RequestInfo, deadline: float,
                      charge: Callable[[str, Decision], Credit],
                      exclude: frozenset[str] = frozenset()) -> tuple[Decision, Credit, float]:
        """Returns (decision, credit, seconds queued). Raises RouterError."""
        start = self.clock()
        if deadline <= start:
            raise errors.deadline_exhausted()
        queue = self._queues.setdefault(info.model, deque())
        if not queue:
            try:
                d = self.decide(info, exclude)
                return d, charge(d.node_id, d), 0.0
            except NoCandidate as e:
                if not e.busy:
                    raise errors.no_healthy_node(info.model, e.filtered) from None
        if len(queue) >= self.config.queue_bound:
            raise errors.queue_full(info.model, self.config.queue_bound)
        fut: asyncio.Future[tuple[Decision, Credit]] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(info, exclude, charge, fut)
        queue.append(waiter)
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
        if queue is not None and w in queue:
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
        while queue:
            w = queue[0]
            if w.future.done():
                queue.popleft()
                continue
            try:
                d = self.decide(w.info, w.exclude)
            except NoCandidate as e:
                if e.busy:
                    return
                queue.popleft()
                w.future.set_exception(errors.no_healthy_node(model, e.filtered))
                continue
            queue.popleft()
            w.future.set_result((d, w.charge(d.node_id, d)))

    # ------------------------------------------------------------------ charging

    def _proxy_charge(self, tokens: int) -> Callable[[str, Decision], Credit]:
        return lambda node_id, d: self.registry.charge(node_id, tokens)

    def _blind_charge(self, tokens: int, slot_until_finish: bool
                      ) -> Callable[[str, Decision], Credit]:
        def charge(node_id: str, d: Decision) -> Credit:
            wait = next((s.expected_wait_s for s in d.considered
                         if s.node_id == node_id and s.expected_wait_s is not None), 0.0)
            hold = min(self.config.lookaside_credit_max_s,
                       (self.config.ticket_ttl_s if not slot_until_finish else 0.0)
                       + 2.0 * wait + 1.0)
            return self.registry.charge(node_id, tokens, blind=True, hold_s=hold,
                                        slot_until_finish=slot_until_finish)
        return charge

    async def _lease(self, info: RequestInfo, deadline: float, exclude: frozenset[str],
                     charge: Callable[[str, Decision], Credit], record: DispatchRecord) -> Lease:
        d, credit, queued = await self.acquire(info, deadline, charge, exclude)
        entry = self.registry.entry(d.node_id)
        address = entry.registration.address if entry is not None else ""
        frontends = entry.registration.frontend_addresses if entry is not None else ()
        record.attempts.append(AttemptRecord(d.node_id, d, queued))
        return Lease(d.node_id, address, d, credit, queued, frontends)

    def _attempt_timeout(self, deadline: float) -> float:
        return max(0.001, min(deadline - self.clock(), self.config.request_timeout_s))

    # ------------------------------------------------------------------ proxy modes

    async def stream(self, request: bytes, info: RequestInfo, deadline: float,
                     record: DispatchRecord, extra_metadata: Sequence[tuple[str, str]] = (),
                     on_attempt: AttemptHook | None = None) -> AsyncIterator[bytes]:
        """Yields the node's serialized GenerateStreamResponse chunks. Raises RouterError or
        the node's AioRpcError (its status passes through). Close it (aclosing) on exit.
        ``on_attempt(lease)`` (tracing) runs before each node call and returns metadata to add."""
        record.model, record.prompt_tokens = info.model, info.prompt_tokens
        exclude: frozenset[str] = frozenset()
        last_error: errors.RouterError | grpc.aio.AioRpcError | None = None
        for attempt in range(1, self.config.max_attempts + 1):
            try:
                lease = await self._lease(info, deadline, exclude,
                                          self._proxy_charge(info.prompt_tokens), record)
            except errors.RouterError:
                if last_error is not None:
                    raise last_error from None   # no other node to retry on
                raise
            client = self.channels.get(lease.node_id, lease.address, lease.frontends)
            extra = (*extra_metadata, *on_attempt(lease)) if on_attempt else extra_metadata
            call = client.stream(request, timeout_s=self._attempt_timeout(deadline),
                                 metadata=dispatch_metadata(self.registry.router_id,
                                                            info.prompt_tokens, extra))
            admitted = True
            streamed = False
            try:
                first_wait = min(self.config.first_token_timeout_s,
                                 max(deadline - self.clock(), 0.001))
                try:
                    first = await asyncio.wait_for(call.read(), first_wait)
                except TimeoutError:
                    call.cancel()
                    if self.clock() >= deadline:
                        raise errors.RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                                 "deadline exceeded before the first token",
                                                 lease.node_id) from None
                    raise errors.RouterError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"node {lease.node_id} produced no token within "
                        f"{self.config.first_token_timeout_s}s", lease.node_id) from None
                if first is grpc.aio.EOF:   # (read() raises when the node ended with an error)
                    return
                lease.credit.first_token()
                streamed = True
                record.chunks += 1
                yield first
                while True:
                    chunk = await call.read()
                    if chunk is grpc.aio.EOF:
                        return
                    record.chunks += 1
                    yield chunk
            except grpc.aio.AioRpcError as e:
                record.attempts[-1].error = e.code().name
                if streamed:
                    raise self._mid_stream(e, lease.node_id, deadline) from None
                admitted = e.code() not in errors.NOT_ADMITTED_CODES
                if not self._retry(e.code(), attempt, deadline):
                    raise
                log.info("node %s failed before the first token (%s); retrying elsewhere",
                         lease.node_id, e.code().name)
                last_error = e
            except errors.RouterError as e:
                record.attempts[-1].error = e.code.name
                if e.code is not grpc.StatusCode.UNAVAILABLE or not self._retry(
                        e.code, attempt, deadline):
                    raise
                last_error = e
            finally:
                lease.credit.finish(admitted)
                if not call.done():
                    call.cancel()   # client cancelled or we gave up: the node aborts
            exclude = exclude | {lease.node_id}
        raise AssertionError("unreachable")  # pragma: no cover

    async def unary(self, request: bytes, info: RequestInfo, deadline: float,
                    record: DispatchRecord, extra_metadata: Sequence[tuple[str, str]] = (),
                    on_attempt: AttemptHook | None = None) -> bytes:
        """Returns the node's serialized GenerateResponse; retries once on another node."""
        record.model, record.prompt_tokens = info.model, info.prompt_tokens
        exclude: frozenset[str] = frozenset()
        last_error: grpc.aio.AioRpcError | None = None
        for attempt in range(1, self.config.max_attempts + 1):
            try:
                lease = await self._lease(info, deadline, exclude,
                                          self._blind_charge(info.prompt_tokens, True), record)
            except errors.RouterError:
                if last_error is not None:
                    raise last_error from None
                raise
            client = self.channels.get(lease.node_id, lease.address, lease.frontends)
            extra = (*extra_metadata, *on_attempt(lease)) if on_attempt else extra_metadata
            call = client.unary(request, timeout_s=self._attempt_timeout(deadline),
                                metadata=dispatch_metadata(self.registry.router_id,
                                                           info.prompt_tokens, extra))
            admitted = True
            try:
                response: bytes = await call
                record.chunks = 1
                return response
            except grpc.aio.AioRpcError as e:
                record.attempts[-1].error = e.code().name
                admitted = e.code() not in errors.NOT_ADMITTED_CODES
                if not self._retry(e.code(), attempt, deadline):
                    raise
                last_error = e
            finally:
                lease.credit.finish(admitted)
                if not call.done():
                    call.cancel()
            exclude = exclude | {lease.node_id}
        raise AssertionError("unreachable")  # pragma: no cover

    async def pick(self, info: RequestInfo, deadline: float, record: DispatchRecord,
                   exclude: frozenset[str] = frozenset()) -> Lease:
        """Lookaside: choose and charge a node; the client calls it with a ticket.
        ``exclude``: nodes the client saw fail before a first token (its retry)."""
        record.model, record.prompt_tokens = info.model, info.prompt_tokens
        return await self._lease(info, deadline, exclude,
                                 self._blind_charge(info.prompt_tokens, False), record)

    def _retry(self, code: grpc.StatusCode, attempt: int, deadline: float) -> bool:
        return (code in errors.RETRYABLE_NODE_CODES and attempt < self.config.max_attempts
                and self.clock() < deadline)

    def _mid_stream(self, e: grpc.aio.AioRpcError, node_id: str, deadline: float
                    ) -> BaseException:
        if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED and self.clock() >= deadline - 0.01:
            return e
        if e.code() in errors.RETRYABLE_NODE_CODES or e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            return errors.failed_mid_stream(node_id, f"{e.code().name}: {e.details()}")
        return e
