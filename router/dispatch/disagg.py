"""Disaggregated prefill/decode in proxy mode: one request, two nodes, one stream.

Who calls it: the dispatcher's ``stream`` (``route``: whether a request is disaggregated and
which nodes a whole request may not use; ``DisaggTransport``: the transport that serves it).
Contract (docs/disaggregation.md):

- **When**: the model has a healthy ``prefill`` node and a healthy ``decode`` node with room
  (``has_room``), the request is a stream without a LoRA adapter or a resume, and either no
  ``both`` node serves the model or the prompt has at least ``disagg_min_prompt_tokens``
  tokens. Otherwise the request is served whole, on a ``both`` or ``decode`` node
  (``whole_request_exclude`` keeps whole requests off prefill nodes).
- **One attempt, two legs**: the disaggregated attempt is one *single attempt* of the attempt
  layers (``gpumesh.attempts``): ``DisaggTransport.open`` admits the request on a decode node
  and returns a ``TwoLegCall``, whose ``first`` admits it on a prefill node and runs the
  prefill leg there (a unary Generate with ``max_tokens`` 1 and ``kv_transfer_params``
  ``{"do_remote_decode": true}``), then sends the client's own request with the returned
  ``kv_transfer_params`` (vLLM's: where the prompt's KV blocks are) to the decode node, which
  pulls the KV and streams the answer. The client sees the decode leg's stream only: one
  ordinary stream, usage counted once; trailing metadata names both nodes
  (``x-gpumesh-prefill-node-id``, ``x-gpumesh-node-id``).
- **Deadlines and failures**: the prefill leg, and the decode leg until its first chunk (the
  KV transfer happens in between), are each bounded by ``disagg_leg_timeout_s`` and the
  request's deadline. A leg that fails, hangs or returns no parameters before the first chunk
  fails the attempt with UNAVAILABLE, and the retry layer serves the request whole on another
  node with the time left (the decode node too, when the prefill leg was at fault). After
  output the stream is an ordinary stream: the stall watch, outlier feedback and prediction
  feedback wrap the decode call as any node call, and a decode node that fails continues
  the stream elsewhere (``continue_mid_stream``).
- **Trace**: the decode leg is the request's attempt span; ``gpumesh.router.prefill`` (the
  prefill leg, parent of the prefill node's span) and ``gpumesh.router.kv_transfer`` (decode
  request sent -> its first chunk) are its children.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import trace

from gpumesh import telemetry as gt
from gpumesh.router import errors
from gpumesh.router.backends import dispatch_metadata
from gpumesh.router.dispatch import failover
from gpumesh.router.dispatch.context import RequestContext
from gpumesh.router.dispatch.ejection import ObservedCall
from gpumesh.router.dispatch.proxy import ProxyCall, ProxyTransport
from gpumesh.router.dispatch.records import Assignment, DispatchRecord
from gpumesh.router.dispatch.watch import WatchedCall
from gpumesh.router.fleet.locality import prefill_tokens
from gpumesh.router.scheduling import Candidate, Decision, RequestInfo
from gpumesh.router.scheduling.types import NodeState
from gpumesh.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from gpumesh.router.dispatch.dispatcher import Dispatcher
    from gpumesh.router.fleet import Registry

log = logging.getLogger(__name__)

PREFILL_PARAMS = json.dumps({"do_remote_decode": True})
# A decode node takes no new disaggregated request with its KV cache fuller than this.
DECODE_KV_LIMIT = 0.9
Legs = tuple[frozenset[str], frozenset[str]]   # (not for the prefill leg, not for decode)


def has_room(c: Candidate) -> bool:
    """A decode node that can take a request now: under its concurrency limit and with KV
    cache to spare."""
    slots = c.max_concurrency <= 0 or c.router_in_flight < c.max_concurrency
    return slots and c.kv_cache_usage < DECODE_KV_LIMIT


def route(registry: Registry, parsed: pb.GenerateRequest, info: RequestInfo,
          min_prompt_tokens: int) -> tuple[Legs | None, frozenset[str]]:
    """(the legs' exclusions when this stream is disaggregated, else None; the nodes a whole
    request may not use). The dispatcher's one question, asked per stream."""
    cands = registry.candidates(info.model)
    if all(c.role == "both" for c in cands):
        return None, frozenset()
    prefill_nodes = frozenset(c.node_id for c in cands if c.role == "prefill")
    # a prefill node's engine serves whole requests too, but its job is prompts: whole
    # requests go elsewhere while another node serves the model
    whole = prefill_nodes if len(prefill_nodes) < len(cands) else frozenset()
    return plan(cands, parsed, info, min_prompt_tokens), whole


def whole_request_exclude(registry: Registry, model: str) -> frozenset[str]:
    """The model's prefill nodes while another node serves it (see ``route``)."""
    cands = registry.candidates(model)
    prefill = frozenset(c.node_id for c in cands if c.role == "prefill")
    return prefill if len(prefill) < len(cands) else frozenset()


def plan(cands: Sequence[Candidate], parsed: pb.GenerateRequest, info: RequestInfo,
         min_prompt_tokens: int) -> Legs | None:
    """(nodes the prefill leg may not use, nodes the decode leg may not use) when this request
    is disaggregated (the rule above), else None."""
    if parsed.adapter or parsed.HasField("resume"):
        return None
    live = [c for c in cands if c.state is not NodeState.DRAINING]
    prefill = {c.node_id for c in live if c.role == "prefill" and c.state is NodeState.HEALTHY}
    decode = {c.node_id for c in live
              if c.role == "decode" and c.state is NodeState.HEALTHY and has_room(c)}
    if not prefill or not decode:
        return None
    if any(c.role == "both" for c in live) and info.prompt_tokens < min_prompt_tokens:
        return None
    everyone = frozenset(c.node_id for c in cands)
    return everyone - prefill, everyone - decode


def check_client_request(parsed: pb.GenerateRequest) -> None:
    """INVALID_ARGUMENT for a client that sets ``kv_transfer_params`` itself: they name KV
    blocks on a node, which only the router's own prefill leg may hand out."""
    if parsed.kv_transfer_params:
        raise errors.RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                                 "kv_transfer_params is set by the router, not by clients")


def _span(tracer: Any, name: str, parent: Any, attrs: dict[str, Any],
          kind: trace.SpanKind = trace.SpanKind.CLIENT) -> Any:
    """A child span of ``parent`` (a context; None: no tracing) as a context manager."""
    if parent is None or tracer is None:
        return contextlib.nullcontext(None)
    return tracer.start_as_current_span(name, context=parent, kind=kind,
                                        attributes=attrs, record_exception=False,
                                        set_status_on_exception=True)


@dataclass(slots=True, eq=False)
class DisaggTransport:
    """The router's ``gpumesh.attempts.Transport[bytes]`` for a stream that ``route``
    disaggregates: its first attempt is the two-leg call (``TwoLegCall``) over ``legs``
    (None once used); any other attempt (a retry before output, a continuation after it) is
    served whole by ``whole``."""

    d: Dispatcher
    ctx: RequestContext
    record: DispatchRecord
    legs: Legs | None
    whole: ProxyTransport
    streaming: bool = field(init=False, default=True)
    prompt_tokens: int = field(init=False)
    _tried_legs: TwoLegCall | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.prompt_tokens = self.whole.prompt_tokens

    async def open(self, request: pb.GenerateRequest | None,
                   exclude: frozenset[str]) -> Any:
        legs, self.legs = self.legs, None
        if legs is not None and request is None:
            call = await self._open_legs(legs, exclude)
            if call is not None:
                return call
        if self._tried_legs is not None and request is None:
            # the two-leg attempt failed before output, most often in its prefill leg or the
            # KV transfer: its decode node may serve the request whole (only prefill nodes
            # are kept out, by ``whole``)
            exclude = exclude - {self._tried_legs.node_id}
        return await self.whole.open(request, exclude)

    async def _open_legs(self, legs: Legs, exclude: frozenset[str]) -> WatchedCall | None:
        """Admits the request on a decode node (charged no prompt tokens: its prompt's KV
        arrives over the wire) and returns the two-leg call; None when no decode node takes
        it within ``disagg_leg_timeout_s`` (the request is then served whole)."""
        d, ctx = self.d, self.ctx
        wait = min(d.config.dispatch.disagg_leg_timeout_s, ctx.deadline - d.clock())

        def charge(node_id: str, _: Decision) -> Any:
            return d.registry.charge(node_id, 0)

        try:
            slot = await asyncio.wait_for(
                d.assign(ctx, legs[1] | exclude, charge, self.record), max(wait, 0.001))
        except (errors.RouterError, grpc.aio.AioRpcError, TimeoutError) as e:
            log.info("disaggregated request served whole: no decode node: %s", e)
            return None
        extra = tuple(ctx.on_attempt(slot)) if ctx.on_attempt is not None else ()
        call = TwoLegCall(d, ctx, self.record, slot, legs[0], extra)
        self._tried_legs = call
        return WatchedCall(call, d.watch, True)

    def message(self, chunk: bytes) -> pb.GenerateStreamResponse:
        return self.whole.message(chunk)

    def encode(self, message: pb.GenerateStreamResponse) -> bytes:
        return self.whole.encode(message)


@dataclass(slots=True, eq=False)
class TwoLegCall:
    """The disaggregated attempt as one ``gpumesh.attempts.NodeCall[bytes]`` on the decode
    node (module doc). ``first`` runs the prefill leg, then opens the decode call and awaits
    its first chunk; the decode call is a ``ProxyCall`` in the outlier feedback, so credit,
    prediction feedback and ejection see it as any node call. A failure before that first
    chunk is raised as UNAVAILABLE (DEADLINE_EXCEEDED when the request's deadline passed):
    the retry layer then serves the request whole."""

    d: Dispatcher
    ctx: RequestContext
    record: DispatchRecord
    slot: Assignment
    not_prefill: frozenset[str]
    extra: Sequence[tuple[str, str]]
    node_id: str = field(init=False)
    _parent: Any = field(init=False)      # the attempt span: parent of both legs' spans
    _rpc: Any = field(init=False, default=None)   # the running leg's gRPC call
    _decode: ObservedCall | None = field(init=False, default=None)
    # the decode leg's own failure
    _cause: failover.NodeError | None = field(init=False, default=None)
    _answered: bool = field(init=False, default=False)  # the decode leg's first chunk arrived

    def __post_init__(self) -> None:
        self.node_id = self.slot.node_id
        self._parent = gt.extract(self.extra)

    def _failed(self, why: str, node_id: str) -> errors.RouterError:
        """A leg failed before output: UNAVAILABLE (retried whole), or the request's
        deadline."""
        if self.d.clock() >= self.ctx.deadline:
            return errors.RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"deadline exceeded in the disaggregated attempt: {why}",
                                      node_id)
        log.info("disaggregated request served whole: %s", why)
        return errors.RouterError(grpc.StatusCode.UNAVAILABLE, why, node_id)

    async def first(self) -> bytes | None:
        return await self._decode_first(await self._prefill())

    async def _prefill(self) -> str:
        """Runs the prompt on a prefill node; returns its KV-transfer parameters (JSON)."""
        d, ctx, info = self.d, self.ctx, self.ctx.info
        deadline = ctx.deadline
        wait = max(0.001, min(d.config.dispatch.disagg_leg_timeout_s, deadline - d.clock()))

        def charge(node_id: str, _: Decision) -> Any:
            return d.registry.charge(node_id, prefill_tokens(info, node_id))

        try:
            decision, credit, _ = await asyncio.wait_for(
                d.admission.acquire(info, d.clock() + wait, charge, self.not_prefill), wait)
        except (errors.RouterError, TimeoutError) as e:
            raise self._failed(f"no prefill node: {e}", "") from None
        node = decision.node_id
        self.record.prefill_node_id = node
        leg = pb.GenerateRequest()
        leg.CopyFrom(ctx.request)
        leg.sampling.max_tokens = 1
        leg.kv_transfer_params = PREFILL_PARAMS
        leg.ClearField("stream_options")
        if leg.request_id:
            leg.request_id += "-prefill"
        entry = d.registry.entry(node)
        address = entry.registration.address if entry is not None else ""
        frontends = entry.registration.frontend_addresses if entry is not None else ()
        ok, sent = False, d.clock()
        with _span(d.tracer, "gpumesh.router.prefill", self._parent, {
                "gpumesh.node.id": node, "gpumesh.routing.prompt_tokens_estimate":
                info.prompt_tokens}) as span:
            meta = list(self.extra)
            if span is not None:
                meta = [m for m in meta if m[0] not in ("traceparent", "tracestate")]
                gt.inject(meta, trace.set_span_in_context(span))
            client = d.channels.get(node, address, frontends)
            self._rpc = call = client.unary(
                leg.SerializeToString(), timeout_s=max(0.001, min(wait, deadline - d.clock())),
                metadata=dispatch_metadata(d.registry.router_id, prefill_tokens(info, node),
                                           meta))
            try:   # (the call's own timeout bounds the leg)
                answer = pb.GenerateResponse.FromString(await call)
                ok = True
            except grpc.aio.AioRpcError as e:
                if span is not None:
                    gt.set_error(span, e.code(), e.details() or "prefill leg failed")
                if failover.blames_node(e, d.clock(), deadline):
                    d.ejector.failure(node, e.code().name)
                raise self._failed(f"prefill node {node}: {e.code().name} {e.details()}",
                                   node) from None
            finally:
                credit.first_token()
                credit.finish(True)
                if not ok and not call.done():
                    call.cancel()
        # outlier and prediction feedback: the prefill answer is the node's first token
        d.ejector.success(node, d.clock() - sent)
        d.registry.predictions.observe(node, decision, ttft_s=d.clock() - sent)
        if not answer.kv_transfer_params:
            raise self._failed(f"prefill node {node} returned no kv_transfer_params", node)
        return answer.kv_transfer_params

    async def _decode_first(self, params: str) -> bytes | None:
        """Sends the client's request with ``params`` to the decode node; its first chunk
        (the decode node pulled the prompt's KV and generated)."""
        d, ctx, slot = self.d, self.ctx, self.slot
        dec = pb.GenerateRequest()
        dec.CopyFrom(ctx.request)
        dec.kv_transfer_params = params
        client = d.channels.get(slot.node_id, slot.address, slot.frontends)
        self._rpc = call = client.stream(
            dec.SerializeToString(),
            timeout_s=max(0.001, min(ctx.deadline - d.clock(),
                                     d.config.dispatch.request_timeout_s)),
            metadata=dispatch_metadata(d.registry.router_id, 0, self.extra))
        self._decode = ObservedCall(ProxyCall(d, slot, call, True, ctx.deadline, self.record),
                                    d.ejector, ctx.deadline)
        with _span(d.tracer, "gpumesh.router.kv_transfer", self._parent, {
                "gpumesh.node.id": slot.node_id,
                "gpumesh.prefill.node.id": self.record.prefill_node_id},
                trace.SpanKind.INTERNAL):
            wait = max(0.001, min(d.config.dispatch.disagg_leg_timeout_s, ctx.deadline - d.clock()))
            try:
                chunk = await asyncio.wait_for(self._decode.first(), wait)
            except TimeoutError:
                self._cause = errors.RouterError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"node {slot.node_id} produced no token within {wait:.1f}s (KV transfer)",
                    slot.node_id)
                raise self._failed(self._cause.message, slot.node_id) from None
            except (grpc.aio.AioRpcError, errors.RouterError) as e:
                self._cause = e
                raise self._failed(f"decode node {slot.node_id}: "
                                   f"{failover.failed_code(e).name} {e}", slot.node_id) from None
        if chunk is None:
            raise self._failed(f"decode node {slot.node_id} ended without output", slot.node_id)
        self._answered = True
        return chunk

    async def next(self) -> bytes | None:
        assert self._decode is not None
        return await self._decode.next()

    def close(self, error: Exception | None) -> None:
        if self._decode is not None:
            self._decode.close(None if error is None else (self._cause or error))
        else:   # the attempt ended before the decode call (in the prefill leg)
            if error is not None:
                assert isinstance(error, errors.RouterError | grpc.aio.AioRpcError)
                self.record.attempts[-1].error = failover.failed_code(error).name
            self.slot.credit.finish(False)
        if error is not None and not self._answered:
            self.record.prefill_node_id = ""   # the answer comes from one node alone

    def cancel(self) -> None:
        """The stall watch gave up on the call."""
        if self._rpc is not None:
            self._rpc.cancel()
