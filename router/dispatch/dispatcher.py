"""The router's per-request path, top to bottom.

Who calls it: the Inference servicer (``prepare``, then ``stream`` or ``unary``) and the
operator servicer (``prepare``, then ``pick``). A request goes:

1. ``Dispatcher.prepare`` -> ``context.prepare``: the ``RequestContext``, built once
   (model resolved, routing fields checked, prompt sized, prefix locality asked once, the
   routing key's last node); every step below reads it, none rebuilds it.
2. ``Dispatcher.stream`` / ``unary``: the attempt layers of ``gpumesh.attempts`` (shared
   with the lookaside client) over the router's ``proxy.ProxyTransport``:
   ``send`` -> ``continue_mid_stream`` (after output: another node continues the stream,
   ``gpumesh.migration``) -> ``retry_before_first_token`` (before output: another node,
   ``failover.ProxyFailover``) -> ``single_attempt``, which calls
3. ``ProxyTransport.open``: ``Dispatcher.assign`` (admission decides and charges a node,
   ``AdmissionQueue.acquire``; locality and the session table note the choice), then the
   node call (``backends``), wrapped in the outlier feedback (``ejection.ObservedCall``) and
   the stall watch (``watch.WatchedCall``) around ``proxy.ProxyCall``;
4. ``ProxyCall.first`` (the first chunk: the credit releases its prompt tokens),
   ``ProxyCall.next`` for the rest, ``ProxyCall.close`` at the attempt's end (the credit
   releases its slot; a failure is recorded).

A stream that ``disagg.route`` disaggregates (prefill and decode nodes) runs the same layers
over ``disagg.DisaggTransport``: its first single attempt opens a ``disagg.TwoLegCall`` on a
decode node (admitted as in step 3, in the stall watch), whose ``first`` runs the prefill
leg on a prefill node, then the decode call (a ``ProxyCall`` in the outlier feedback) until
its first chunk; a failure before that chunk is retried whole on a non-prefill node, and
after it the stream migrates as any other. Whole requests never go to a prefill node while
another node serves the model (``disagg.whole_request_exclude``).

A stream's credit releases its prompt tokens at the first chunk and its slot at the end; a
unary call's credit is blind (the router never sees its first token) and holds the slot
until the end. ``pick`` (lookaside) only charges: credits are released by the node's
reports. Cancelling the caller's task cancels the outbound call, so the node aborts the
request. Every decision and attempt is kept in the request's ``DispatchRecord``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from gpumesh import attempts, migration
from gpumesh.router.auth.interceptor import current_key_name
from gpumesh.router.backends import NodeChannels
from gpumesh.router.dispatch import context, disagg, failover
from gpumesh.router.dispatch.admission import AdmissionQueue
from gpumesh.router.dispatch.context import RequestContext
from gpumesh.router.dispatch.ejection import EjectionPolicy, OutlierEjector
from gpumesh.router.dispatch.proxy import ProxyTransport
from gpumesh.router.dispatch.records import (
    Assignment,
    AttemptHook,
    AttemptRecord,
    ChargeFn,
    DispatchRecord,
)
from gpumesh.router.dispatch.watch import InFlightWatch
from gpumesh.router.fleet import Credit, Registry
from gpumesh.router.fleet.locality import PrefixLocality, prefill_tokens
from gpumesh.router.fleet.sessions import SessionTable
from gpumesh.router.scheduling import Decision, Policy, RequestInfo
from gpumesh.router.scheduling.filters import Filter, fresh_first
from gpumesh.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from gpumesh.router.config import RouterConfig


class Dispatcher:
    def __init__(self, config: RouterConfig, registry: Registry, channels: NodeChannels,
                 profile: Policy, filters: Sequence[Filter], rng: random.Random,
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
        self.tracer: Any = None   # the router's OpenTelemetry tracer (disagg spans; app sets it)
        self.clock = clock   # deadlines (seconds, monotonic)
        # Gray failures (router.dispatch.watch, .ejection): STALE nodes and outliers get no
        # new work while another node can take it; stalled calls on STALE nodes fail over.
        dispatch = config.dispatch
        self.ejector = OutlierEjector(EjectionPolicy(
            consecutive_failures=dispatch.outlier_consecutive_failures,
            latency_factor=dispatch.outlier_latency_factor,
            base_s=dispatch.outlier_base_ejection_s, max_s=dispatch.outlier_max_ejection_s), clock)
        self.watch = InFlightWatch(self._reporting, clock, dispatch.stall_s, self._replaceable)
        self._watch_task: asyncio.Task[None] | None = None
        registry.add_removal_listener(self._node_left)
        filters = (*filters, fresh_first(), self.ejector)
        self.admission = AdmissionQueue(registry, profile, filters, rng, clock,
                                        queue_bound=config.dispatch.queue_bound,
                                        decision_sample_size=config.routing.sample_size,
                                        slo_admission=config.dispatch.slo_admission)

    def decide(self, info: RequestInfo, exclude: frozenset[str] = frozenset()) -> Decision:
        """One routing decision now, without charging (Router.Pick preview, tests)."""
        return self.admission.decide(info, exclude)

    def queue_length(self, model: str) -> int:
        return self.admission.queue_length(model)

    # ------------------------------------------------------------------ the request path

    async def prepare(self, request: pb.GenerateRequest, raw: bytes, deadline: float,
                      on_attempt: AttemptHook | None = None) -> RequestContext:
        """Step 1: the request's context, built once before admission (``context.prepare``:
        model, routing fields, prompt size, prefix locality, the key's last node)."""
        disagg.check_client_request(request)   # KV-transfer parameters are the router's
        return await context.prepare(
            request, raw, deadline, current_key_name.get(), on_attempt,
            registry=self.registry, chars_per_token=self.config.locality.chars_per_token,
            locality=self.locality, sessions=self.sessions,
            model_slos=(self.config.dispatch.slo_ttft_ms, self.config.dispatch.slo_tpot_ms))

    def stream(self, ctx: RequestContext, record: DispatchRecord) -> AsyncIterator[bytes]:
        """Step 2 (GenerateStream): yields the node's serialized GenerateStreamResponse chunks
        through the attempt layers (``gpumesh.attempts.send`` over ``ProxyTransport``).
        Raises RouterError or the node's AioRpcError (its status passes through). Close it
        (aclosing) on exit."""
        record.model, record.prompt_tokens = ctx.info.model, ctx.info.prompt_tokens
        self._start_watch()
        # disaggregated prefill/decode (dispatch.disagg): the first attempt runs two legs
        legs, whole = disagg.route(self.registry, ctx.request, ctx.info,
                                   self.config.dispatch.disagg_min_prompt_tokens)
        whole_t = ProxyTransport(self, ctx, record, True, self._proxy_charge(ctx.info), whole)
        t: attempts.Transport[bytes] = (whole_t if legs is None else
                                        disagg.DisaggTransport(self, ctx, record, legs, whole_t))
        return attempts.send(t, self._failover(ctx, record), self._state(ctx))

    async def unary(self, ctx: RequestContext, record: DispatchRecord) -> bytes:
        """Step 2 (Generate): the node's serialized GenerateResponse; the same layers as
        ``stream`` (retry before the answer; nothing to migrate)."""
        record.model, record.prompt_tokens = ctx.info.model, ctx.info.prompt_tokens
        self._start_watch()
        t = ProxyTransport(self, ctx, record, False, self._blind_charge(ctx.info, True),
                           disagg.whole_request_exclude(self.registry, ctx.info.model))
        return await attempts.first_answer(t, self._failover(ctx, record), attempts.Attempts())

    async def pick(self, ctx: RequestContext, record: DispatchRecord,
                   exclude: frozenset[str] = frozenset()) -> Assignment:
        """Step 2 (Router.Pick, lookaside): choose and charge a node; the client calls it
        with a ticket and runs the attempt layers itself. ``exclude``: nodes the client saw
        fail this request."""
        record.model, record.prompt_tokens = ctx.info.model, ctx.info.prompt_tokens
        exclude = exclude | disagg.whole_request_exclude(self.registry, ctx.info.model)
        return await self.assign(ctx, exclude, self._blind_charge(ctx.info, False), record)

    def _failover(self, ctx: RequestContext, record: DispatchRecord) -> failover.ProxyFailover:
        return failover.ProxyFailover(self.config, self.clock, ctx.deadline, record)

    def _state(self, ctx: RequestContext) -> attempts.Attempts:
        """A stream that may continue on another node keeps its progress (every chunk is
        read for its token ids); one that may not is forwarded unread."""
        if self.config.dispatch.max_migrations < 1 or not migration.migratable(ctx.request):
            return attempts.Attempts()
        return attempts.Attempts(request=ctx.request, progress=migration.StreamProgress())

    async def assign(self, ctx: RequestContext, exclude: frozenset[str], charge: ChargeFn,
                     record: DispatchRecord) -> Assignment:
        """One attempt's node: admission decides and charges it (``AdmissionQueue``), prefix
        locality records where the prompt went, the routing key follows the chosen node."""
        info = ctx.info
        d, credit, queued = await self.admission.acquire(info, ctx.deadline, charge, exclude)
        if self.locality is not None and info.prefix_hashes:
            self.locality.routed(info, d.node_id)
        if self.sessions is not None and info.routing_key:
            self.sessions.remember(info.model, info.routing_key, d.node_id)
        entry = self.registry.entry(d.node_id)
        address = entry.registration.address if entry is not None else ""
        frontends = entry.registration.frontend_addresses if entry is not None else ()
        record.attempts.append(AttemptRecord(d.node_id, d, queued))
        return Assignment(d.node_id, address, d, credit, queued, frontends)

    # ------------------------------------------------------------------ gray failures

    def _reporting(self, node_id: str, now: float) -> bool:
        """The node is in the fleet and reported within ``stall_s``: its streams are left alone
        (a node whose front end is saturated sends late heartbeats and pauses its streams at
        once, so the watch waits longer than the routing freshness before failing over)."""
        entry = self.registry.entry(node_id)
        if entry is None:
            return False
        return self.registry.state_of(entry, now)[1] < self.config.dispatch.stall_s

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
                self.watch.run(self.config.dispatch.stall_check_interval_s), name="in-flight-watch")

    async def close(self) -> None:
        """Stops the in-flight watch (router shutdown)."""
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
            self._watch_task = None

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
            hold = min(self.config.dispatch.lookaside_credit_max_s,
                       (self.config.security.ticket_ttl_s if not slot_until_finish else 0.0)
                       + 2.0 * wait + 1.0)
            return self.registry.charge(node_id, prefill_tokens(info, node_id), blind=True,
                                        hold_s=hold, slot_until_finish=slot_until_finish)
        return charge
