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
from gpumesh.router.dispatch import failover
from gpumesh.router.dispatch.admission import AdmissionQueue
from gpumesh.router.dispatch.records import (
    Assignment,
    AttemptHook,
    AttemptRecord,
    ChargeFn,
    DispatchRecord,
)
from gpumesh.router.fleet import Credit, Registry
from gpumesh.router.fleet.sessions import SessionTable
from gpumesh.router.scheduling import Decision, Profile, RequestInfo
from gpumesh.router.scheduling.filters import Filter

log = logging.getLogger(__name__)

_NodeError = errors.RouterError | grpc.aio.AioRpcError


class Dispatcher:
    def __init__(self, config: RouterConfig, registry: Registry, channels: NodeChannels,
                 profile: Profile, filters: Sequence[Filter], rng: random.Random,
                 clock: Callable[[], float] = time.monotonic,
                 sessions: SessionTable | None = None) -> None:
        self.config = config
        # routing_key -> last node (session affinity); None = no affinity
        self.sessions = sessions
        self.registry = registry
        self.channels = channels
        self.clock = clock   # deadlines (seconds, monotonic)
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
                              self._proxy_charge(info.prompt_tokens), extra_metadata, on_attempt)

    async def unary(self, request: bytes, info: RequestInfo, deadline: float,
                    record: DispatchRecord, extra_metadata: Sequence[tuple[str, str]] = (),
                    on_attempt: AttemptHook | None = None) -> bytes:
        """Returns the node's serialized GenerateResponse; same retries as ``stream``."""
        async with contextlib.aclosing(self._attempts(
                request, info, deadline, record, False,
                self._blind_charge(info.prompt_tokens, True), extra_metadata,
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
                                  self._blind_charge(info.prompt_tokens, False), record, None)

    # ------------------------------------------------------------------ the attempt loop

    async def _attempts(self, request: bytes, info: RequestInfo, deadline: float,
                        record: DispatchRecord, streaming: bool, charge: ChargeFn,
                        extra_metadata: Sequence[tuple[str, str]],
                        on_attempt: AttemptHook | None) -> AsyncIterator[bytes]:
        """Yields the serving node's responses: every stream chunk, or the one unary answer."""
        record.model, record.prompt_tokens = info.model, info.prompt_tokens
        tried: frozenset[str] = frozenset()
        last_error: _NodeError | None = None
        for attempt in range(1, self.config.max_attempts + 1):
            slot = await self._assign(info, deadline, tried, charge, record, last_error)
            call = self._open(slot, request, info, deadline, streaming, extra_metadata,
                              on_attempt)
            admitted, forwarded = True, False
            try:
                first = await self._first(call, slot, deadline, streaming)
                if first is grpc.aio.EOF:   # (read() raises when the node ended with an error)
                    return
                if streaming:
                    slot.credit.first_token()
                forwarded = True
                record.chunks += 1
                yield first
                while streaming and (chunk := await call.read()) is not grpc.aio.EOF:
                    record.chunks += 1
                    yield chunk
                return
            except (grpc.aio.AioRpcError, errors.RouterError) as e:
                admitted = forwarded or failover.admitted(e)
                last_error = self._failed(e, attempt, slot, deadline, record, forwarded)
            finally:
                slot.credit.finish(admitted)
                if not call.done():
                    call.cancel()   # client cancelled or we gave up: the node aborts
            tried = tried | {slot.node_id}
        raise AssertionError("unreachable")  # pragma: no cover

    async def _assign(self, info: RequestInfo, deadline: float, exclude: frozenset[str],
                      charge: ChargeFn, record: DispatchRecord,
                      last_error: _NodeError | None) -> Assignment:
        """Admits the request onto a node; when no other node is left for a retry, the
        previous attempt's error is what the client sees. A request with a routing_key
        prefers the node its key went to last, and its key then follows the chosen node."""
        sessions = self.sessions
        if sessions is not None and info.routing_key:
            info = replace(info, session_node=sessions.lookup(info.model, info.routing_key))
        try:
            d, credit, queued = await self.admission.acquire(info, deadline, charge, exclude)
        except errors.RouterError:
            if last_error is not None:
                raise last_error from None
            raise
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
        metadata = dispatch_metadata(self.registry.router_id, info.prompt_tokens, extra)
        timeout_s = max(0.001, min(deadline - self.clock(), self.config.request_timeout_s))
        rpc = client.stream if streaming else client.unary
        return rpc(request, timeout_s=timeout_s, metadata=metadata)

    async def _first(self, call: Any, slot: Assignment, deadline: float,
                     streaming: bool) -> Any:
        """The node's first response; a stream's is bounded by first_token_timeout_s."""
        if not streaming:
            return await call
        wait = min(self.config.first_token_timeout_s, max(deadline - self.clock(), 0.001))
        try:
            return await asyncio.wait_for(call.read(), wait)
        except TimeoutError:
            call.cancel()
            raise failover.first_token_timeout(slot.node_id, self.config.first_token_timeout_s,
                                               self.clock(), deadline) from None

    def _failed(self, e: _NodeError, attempt: int, slot: Assignment, deadline: float,
                record: DispatchRecord, forwarded: bool) -> _NodeError:
        """Records a failed attempt; returns the error to retry after, or raises what the
        client sees."""
        code = failover.failed_code(e)
        record.attempts[-1].error = code.name
        now = self.clock()
        if forwarded and isinstance(e, grpc.aio.AioRpcError):
            raise failover.mid_stream_error(e, slot.node_id, now, deadline) from None
        if not (failover.retryable_before_first_chunk(e) and failover.should_retry(
                code, attempt, self.config.max_attempts, now, deadline)):
            raise e
        log.info("node %s failed before the first token (%s); retrying elsewhere",
                 slot.node_id, code.name)
        return e

    # ------------------------------------------------------------------ charging

    def _proxy_charge(self, tokens: int) -> ChargeFn:
        return lambda node_id, d: self.registry.charge(node_id, tokens)

    def _blind_charge(self, tokens: int, slot_until_finish: bool) -> ChargeFn:
        """A blind credit (the router will not see its first token) holds its tokens for twice
        the decision's expected wait plus a second, plus a ticket's lifetime when the slot
        is not held until the end (lookaside), capped by lookaside_credit_max_s."""
        def charge(node_id: str, d: Decision) -> Credit:
            wait = next((s.expected_wait_s for s in d.considered
                         if s.node_id == node_id and s.expected_wait_s is not None), 0.0)
            hold = min(self.config.lookaside_credit_max_s,
                       (self.config.ticket_ttl_s if not slot_until_finish else 0.0)
                       + 2.0 * wait + 1.0)
            return self.registry.charge(node_id, tokens, blind=True, hold_s=hold,
                                        slot_until_finish=slot_until_finish)
        return charge
