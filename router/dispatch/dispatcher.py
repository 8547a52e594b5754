"""The per-request path: admission, the one attempt loop, the node call.

Who calls it: the Inference servicer (``stream``, ``unary``) and the operator servicer
(``pick``). Contract:

- ``stream`` proxies GenerateStream, ``unary`` proxies Generate; both run ``_attempts``, the
  one attempt loop: admit (``AdmissionQueue``), call the node (``backends``), forward what it
  answers. A node failure before the first chunk reached the client is retried on another
  node (``failover``); after it -> UNAVAILABLE naming the node. A stream's credit releases its
  prompt tokens at the first chunk and its slot at the end; a unary call's credit is blind
  (the router never sees its first token) and holds the slot until the end.
- ``pick`` (lookaside) only charges: credits are released by the node's reports.

Cancelling the caller's task cancels the outbound call, so the node aborts the request.
Every decision and attempt is kept in the request's ``DispatchRecord``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

import grpc

from gpumesh.router import errors
from gpumesh.router.backends import NodeChannels, dispatch_metadata
from gpumesh.router.config import RouterConfig
from gpumesh.router.dispatch import failover, migration
from gpumesh.router.dispatch.admission import AdmissionQueue
from gpumesh.router.dispatch.ejection import EjectionPolicy, OutlierEjector
from gpumesh.router.dispatch.records import (
    Assignment,
    AttemptHook,
    AttemptRecord,
    ChargeFn,
    DispatchRecord,
)
from gpumesh.router.fleet import Credit, Registry
from gpumesh.router.fleet.locality import PrefixLocality, prefill_tokens
from gpumesh.router.fleet.sessions import SessionTable
from gpumesh.router.scheduling import Decision, Profile, RequestInfo
from gpumesh.router.scheduling.filters import Filter, fresh_first
from gpumesh.router.dispatch.watch import InFlightWatch, Tracked
from gpumesh.v1 import inference_pb2 as pb

log = logging.getLogger(__name__)

_NodeError = errors.RouterError | grpc.aio.AioRpcError


class Dispatcher:
    def __init__(self, config: RouterConfig, registry: Registry, channels: NodeChannels,
                 profile: Profile, filters: Sequence[Filter], rng: random.Random,
                 clock: Callable[[], float] = time.monotonic,
                 sessions: SessionTable | None = None,
                 locality: PrefixLocality | None = None) -> None:
        self.config = config
        # prefix-cache locality (router.fleet.locality); None = none
        self.locality = locality
        # routing_key -> last node (session affinity); None = no affinity
        self.sessions = sessions
        self.registry = registry
        self.channels = channels
        self.clock = clock   # deadlines (seconds, monotonic)
        # Gray failures (router.dispatch.watch, .ejection): STALE nodes and outliers get no
        # new work while another node can take it; stalled calls on STALE nodes fail over.
        self.ejector = OutlierEjector(EjectionPolicy(
            consecutive_failures=config.outlier_consecutive_failures,
            latency_factor=config.outlier_latency_factor,
            base_s=config.outlier_base_ejection_s, max_s=config.outlier_max_ejection_s), clock)
        self.watch = InFlightWatch(self._reporting, clock, config.stall_s, self._replaceable)
        self._watch_task: asyncio.Task[None] | None = None
        registry.add_removal_listener(self._node_left)
        filters = (*filters, fresh_first(), self.ejector)
        self.admission = AdmissionQueue(registry, profile, filters, rng, clock,
                                        queue_bound=config.queue_bound,
                                        decision_sample_size=config.decision_sample_size)

    def decide(self, info: RequestInfo, exclude: frozenset[str] = frozenset()) -> Decision:
        """One routing decision now, without charging (Router.Pick preview, tests)."""
        return self.admission.decide(info, exclude)

    def queue_length(self, model: str) -> int:
        return self.admission.queue_length(model)

    # ------------------------------------------------------------------ entry points

    def stream(self, request: bytes, info: RequestInfo, deadline: float,
               record: DispatchRecord, extra_metadata: Sequence[tuple[str, str]] = (),
               on_attempt: AttemptHook | None = None) -> AsyncIterator[bytes]:
        """Yields the node's serialized GenerateStreamResponse chunks. Raises RouterError or
        the node's AioRpcError (its status passes through). Close it (aclosing) on exit.
        ``on_attempt(assignment)`` (tracing) runs before each node call and returns metadata
        to add."""
        return self._attempts(request, info, deadline, record, True,
                              self._proxy_charge(info), extra_metadata, on_attempt)

    async def unary(self, request: bytes, info: RequestInfo, deadline: float,
                    record: DispatchRecord, extra_metadata: Sequence[tuple[str, str]] = (),
                    on_attempt: AttemptHook | None = None) -> bytes:
        """Returns the node's serialized GenerateResponse; same retries as ``stream``."""
        async with contextlib.aclosing(self._attempts(
                request, info, deadline, record, False,
                self._blind_charge(info, True), extra_metadata,
                on_attempt)) as responses:
            async for response in responses:
                return response
        raise AssertionError("a unary attempt answers or raises")  # pragma: no cover

    async def pick(self, info: RequestInfo, deadline: float, record: DispatchRecord,
                   exclude: frozenset[str] = frozenset()) -> Assignment:
        """Lookaside: choose and charge a node; the client calls it with a ticket.
        ``exclude``: nodes the client saw fail before a first token (its retry)."""
        record.model, record.prompt_tokens = info.model, info.prompt_tokens
        return await self._assign(info, deadline, exclude,
                                  self._blind_charge(info, False), record, None)

    # ------------------------------------------------------------------ the attempt loop

    async def _attempts(self, request: bytes, info: RequestInfo, deadline: float,
                        record: DispatchRecord, streaming: bool, charge: ChargeFn,
                        extra_metadata: Sequence[tuple[str, str]],
                        on_attempt: AttemptHook | None) -> AsyncIterator[bytes]:
        """Yields the serving node's responses: every stream chunk, or the one unary answer.

        A failure before the client saw output is retried on another node (``max_attempts``
        in all); after it, the stream continues on another node from the tokens delivered
        (``max_migrations`` times; ``failover.continuation``), unless the request opted out."""
        record.model, record.prompt_tokens = info.model, info.prompt_tokens
        self._start_watch()
        original = self._migratable(request, streaming)
        progress = migration.StreamProgress() if original is not None else None
        body: bytes | None = request
        tried: frozenset[str] = frozenset()
        last_error: _NodeError | None = None
        attempt = 0
        while True:
            attempt += 1
            try:
                slot = await self._assign(info, deadline, tried, charge, record, last_error)
            except (grpc.aio.AioRpcError, errors.RouterError) as e:
                if progress is not None and progress.started:   # no node can continue it
                    raise failover.mid_stream(e, record.node_id, self.clock(),
                                              deadline) from None
                raise
            call = self._open(slot, body, info, deadline, streaming, extra_metadata,
                              on_attempt)
            tracked = self.watch.track(slot.node_id, call, streaming)
            admitted, forwarded, sent = True, False, self.clock()
            try:
                chunk = await self._first(call, slot, deadline, streaming)
                if chunk is grpc.aio.EOF:   # (read() raises when the node ended with an error)
                    return
                self.ejector.success(slot.node_id, self.clock() - sent)
                if streaming:
                    slot.credit.first_token()
                forwarded = True
                while True:
                    record.chunks += 1
                    if progress is not None:
                        progress.observe(chunk)
                        tracked.progress(self.clock())
                    yield chunk
                    if not streaming or (chunk := await call.read()) is grpc.aio.EOF:
                        return
            except (grpc.aio.AioRpcError, errors.RouterError, asyncio.CancelledError) as exc:
                e = failover.lost_call(exc, tracked)   # re-raises a real cancellation
                admitted = forwarded or failover.admitted(e)
                if failover.blames_node(e, self.clock(), deadline):
                    self.ejector.failure(slot.node_id, failover.failed_code(e).name)
                if progress is not None and progress.finished:
                    return   # the client has the whole stream; only its trailers are lost
                if progress is not None and progress.started:
                    body = self._continuation(e, original, progress, slot, deadline, record)
                else:
                    self._failed(e, attempt, slot, deadline, record, forwarded)
                last_error = e
            finally:
                self.watch.untrack(tracked)
                slot.credit.finish(admitted)
                if not call.done():
                    call.cancel()   # client cancelled or we gave up: the node aborts
            if body is None:   # every token was delivered; only the stream's end was missing
                assert original is not None and progress is not None
                yield migration.final_chunk(original, progress,
                                            info.prompt_tokens).SerializeToString()
                return
            tried = tried | {slot.node_id}

    def _migratable(self, request: bytes, streaming: bool) -> pb.GenerateRequest | None:
        """The parsed request when its stream may continue on another node, else None."""
        if not streaming or self.config.max_migrations < 1:
            return None
        parsed = pb.GenerateRequest.FromString(request)
        return parsed if migration.migratable(parsed) else None

    def _continuation(self, e: _NodeError, original: pb.GenerateRequest | None,
                      progress: migration.StreamProgress, slot: Assignment, deadline: float,
                      record: DispatchRecord) -> bytes | None:
        """After output reached the client: the request continuing the stream on another
        node (None when every token was delivered), or raises what the client sees."""
        record.attempts[-1].error = failover.failed_code(e).name
        now = self.clock()
        if original is None or not failover.continuable(
                e, progress.migrations, self.config.max_migrations, now, deadline):
            raise failover.mid_stream(e, slot.node_id, now, deadline) from None
        progress.migrations += 1
        record.migrations += 1
        nxt = migration.resume_request(original, progress)
        log.info("node %s failed after %d tokens (%s); continuing the stream elsewhere",
                 slot.node_id, len(progress.token_ids), failover.failed_code(e).name)
        return None if nxt is None else nxt.SerializeToString()

    # ------------------------------------------------------------------ gray failures

    def _reporting(self, node_id: str, now: float) -> bool:
        """The node is in the fleet and reported within ``stall_s``: its streams are left alone
        (a node whose front end is saturated sends late heartbeats and pauses its streams at
        once, so the watch waits longer than the routing freshness before failing over)."""
        entry = self.registry.entry(node_id)
        if entry is None:
            return False
        return self.registry.state_of(entry, now)[1] < self.config.stall_s

    def _replaceable(self, node_id: str, now: float) -> bool:
        """Another node that reported within ``stall_s`` serves one of this node's models."""
        entry = self.registry.entry(node_id)
        if entry is None:
            return True
        for m in entry.registration.models:
            for c in self.registry.candidates(m.name):
                if c.node_id != node_id and self._reporting(c.node_id, now):
                    return True
        return False

    def _node_left(self, entry: Any) -> None:
        self.watch.node_gone(entry.node_id)
        self.ejector.forget(entry.node_id)

    def _start_watch(self) -> None:
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.get_running_loop().create_task(
                self.watch.run(self.config.stall_check_interval_s), name="in-flight-watch")

    async def close(self) -> None:
        """Stops the in-flight watch (router shutdown)."""
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
            self._watch_task = None

    async def _assign(self, info: RequestInfo, deadline: float, exclude: frozenset[str],
                      charge: ChargeFn, record: DispatchRecord,
                      last_error: _NodeError | None) -> Assignment:
        """Admits the request onto a node; when no other node is left for a retry, the
        previous attempt's error is what the client sees. A request with a routing_key
        prefers the node its key went to last, and its key then follows the chosen node."""
        sessions = self.sessions
        if sessions is not None and info.routing_key:
            info = replace(info, session_node=sessions.lookup(info.model, info.routing_key))
        locality = self.locality
        try:
            d, credit, queued = await self.admission.acquire(info, deadline, charge, exclude)
        except errors.RouterError:
            if last_error is not None:
                raise last_error from None
            raise
        if locality is not None and info.prefix_hashes:
            locality.routed(info, d.node_id)
        if sessions is not None and info.routing_key:
            sessions.remember(info.model, info.routing_key, d.node_id)
        entry = self.registry.entry(d.node_id)
        address = entry.registration.address if entry is not None else ""
        frontends = entry.registration.frontend_addresses if entry is not None else ()
        record.attempts.append(AttemptRecord(d.node_id, d, queued))
        return Assignment(d.node_id, address, d, credit, queued, frontends)

    def _open(self, slot: Assignment, request: bytes, info: RequestInfo, deadline: float,
              streaming: bool, extra_metadata: Sequence[tuple[str, str]],
              on_attempt: AttemptHook | None) -> Any:
        """Starts the node call (a ``grpc.aio`` call, or a backend's equivalent)."""
        client = self.channels.get(slot.node_id, slot.address, slot.frontends)
        extra = (*extra_metadata, *on_attempt(slot)) if on_attempt else extra_metadata
        # charged = the prefill the node still does (prefix locality: less its cached prefix)
        metadata = dispatch_metadata(self.registry.router_id,
                                     prefill_tokens(info, slot.node_id), extra)
        timeout_s = max(0.001, min(deadline - self.clock(), self.config.request_timeout_s))
        rpc = client.stream if streaming else client.unary
        return rpc(request, timeout_s=timeout_s, metadata=metadata)

    async def _first(self, call: Any, slot: Assignment, deadline: float,
                     streaming: bool) -> Any:
        """The node's first response; a stream's is bounded by a first-token deadline derived
        from the node's own queue (``failover.first_token_wait``)."""
        if not streaming:
            return await call
        budget = failover.first_token_wait(slot.decision, slot.node_id, self.config)
        wait = min(budget, max(deadline - self.clock(), 0.001))
        try:
            return await asyncio.wait_for(call.read(), wait)
        except TimeoutError:
            call.cancel()
            raise failover.first_token_timeout(slot.node_id, budget, self.clock(),
                                               deadline) from None

    def _failed(self, e: _NodeError, attempt: int, slot: Assignment, deadline: float,
                record: DispatchRecord, forwarded: bool) -> _NodeError:
        """Records a failed attempt; returns the error to retry after, or raises what the
        client sees."""
        code = failover.failed_code(e)
        record.attempts[-1].error = code.name
        now = self.clock()
        if forwarded:
            raise failover.mid_stream(e, slot.node_id, now, deadline) from None
        if not (failover.retryable_before_first_chunk(e) and failover.should_retry(
                code, attempt, self.config.max_attempts, now, deadline)):
            raise e
        log.info("node %s failed before the first token (%s); retrying elsewhere",
                 slot.node_id, code.name)
        return e

    # ------------------------------------------------------------------ charging

    def _proxy_charge(self, info: RequestInfo) -> ChargeFn:
        return lambda node_id, d: self.registry.charge(node_id, prefill_tokens(info, node_id))

    def _blind_charge(self, info: RequestInfo, slot_until_finish: bool) -> ChargeFn:
        """A blind credit (the router will not see its first token) holds its tokens for twice
        the decision's expected wait plus a second, plus a ticket's lifetime when the slot
        is not held until the end (lookaside), capped by lookaside_credit_max_s."""
        def charge(node_id: str, d: Decision) -> Credit:
            wait = next((s.expected_wait_s for s in d.considered
                         if s.node_id == node_id and s.expected_wait_s is not None), 0.0)
            hold = min(self.config.lookaside_credit_max_s,
                       (self.config.ticket_ttl_s if not slot_until_finish else 0.0)
                       + 2.0 * wait + 1.0)
            return self.registry.charge(node_id, prefill_tokens(info, node_id), blind=True,
                                        hold_s=hold, slot_until_finish=slot_until_finish)
        return charge
