"""The router's gRPC servicers: thin adapters between protos and the registry / dispatcher.

- ``InferenceServicer``: the node's Inference contract (Generate, GenerateStream, ListModels).
  Requests and responses travel as raw bytes: the router parses a request once to route it
  and forwards the client's bytes unchanged; the node's chunks are forwarded unparsed. Trailing
  metadata carries ``NODE_ID`` and ``ATTEMPTS`` (gpumesh.metadata) on success and on error.
- ``ControlPlaneServicer``: Connect streams from nodes (registration, heartbeats, leave).
- ``RouterServicer``: GetFleet (operators) and Pick (lookaside tickets).

Proto types stop here: everything below works on frozen dataclasses.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from collections.abc import AsyncIterator, Callable

import grpc

from gpumesh import metadata as md
from gpumesh import tickets
from gpumesh.v1 import control_pb2, control_pb2_grpc, inference_pb2
from gpumesh.router import errors
from gpumesh.router.config import RouterConfig
from gpumesh.router.dispatch import Dispatcher, DispatchRecord
from gpumesh.router.registry import (
    AccountSample,
    GpuStat,
    ModelSpec,
    NodeRegistration,
    Registry,
    Report,
)
from gpumesh.router.scheduling.types import LoadSample, NodeState, RequestInfo
from gpumesh.router.telemetry import NOOP, RouterTelemetry, Trace

log = logging.getLogger(__name__)


def estimate_prompt_tokens(req: inference_pb2.GenerateRequest, chars_per_token: float) -> int:
    """Prompt size for routing: exact for token ids, UTF-8 bytes / chars_per_token for text,
    plus a few tokens per chat message for the template. (The router has no tokenizer; the
    node counts what the router charged via CHARGED_TOKENS, so both sides agree.)"""
    kind = req.WhichOneof("prompt")
    if kind == "token_ids":
        return len(req.token_ids.ids)
    if kind == "text":
        return math.ceil(len(req.text.encode()) / chars_per_token)
    if kind == "chat":
        return sum(math.ceil(len(m.content.encode()) / chars_per_token) + 4
                   for m in req.chat.messages)
    return 0


def _trailing(record: DispatchRecord, trace: Trace = NOOP) -> tuple[tuple[str, str], ...]:
    return ((md.NODE_ID, record.node_id), (md.ATTEMPTS, str(len(record.attempts))),
            *trace.trailing())


class InferenceServicer:
    def __init__(self, config: RouterConfig, registry: Registry, dispatcher: Dispatcher,
                 clock: Callable[[], float], telemetry: RouterTelemetry | None = None) -> None:
        self.config = config
        self.telemetry = telemetry or RouterTelemetry.disabled()
        self.registry = registry
        self.dispatcher = dispatcher
        self.clock = clock
        self.in_flight = 0
        self.closing = False
        self.idle = asyncio.Event()
        self.idle.set()

    def _parse(self, raw: bytes) -> inference_pb2.GenerateRequest:
        try:
            return inference_pb2.GenerateRequest.FromString(raw)
        except Exception:  # noqa: BLE001 - any decode failure is the client's
            raise errors.RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                                     "GenerateRequest could not be parsed") from None

    def _route(self, req: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
               ) -> tuple[RequestInfo, float]:
        if self.closing:
            raise errors.RouterError(grpc.StatusCode.UNAVAILABLE, "router is shutting down")
        model = self.registry.resolve(req.model)
        info = RequestInfo(model, estimate_prompt_tokens(req, self.config.chars_per_token),
                           req.routing_key)
        remaining = context.time_remaining()
        budget = self.config.request_timeout_s if remaining is None else remaining
        return info, self.clock() + budget

    @contextlib.contextmanager
    def _tracked(self):  # type: ignore[no-untyped-def]
        self.in_flight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    @contextlib.asynccontextmanager
    async def _call(self, method: str, context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[tuple[DispatchRecord, Trace]]:
        """One client call: its dispatch record and trace; every failure becomes the call's
        gRPC status (errors.status_for) with the record in the trailing metadata."""
        record = DispatchRecord()
        trace = self.telemetry.start(method, context, record)
        with self._tracked():
            try:
                yield record, trace
            except (errors.RouterError, grpc.aio.AioRpcError) as e:
                trace.fail(e)
                await _abort(context, e, record, trace)
            except asyncio.CancelledError:
                trace.cancelled()
                raise
            except Exception as e:
                log.exception("%s failed", method)
                trace.fail(e)
                await _abort(context, e, record, trace)
            finally:
                trace.finish(record)
            context.set_trailing_metadata(_trailing(record, trace))

    async def GenerateStream(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        async with self._call("GenerateStream", context) as (record, trace):
            req = self._parse(raw)
            info, deadline = self._route(req, context)
            trace.routed(req, info.model, info.prompt_tokens)
            async with contextlib.aclosing(self.dispatcher.stream(
                    raw, info, deadline, record, on_attempt=trace.on_attempt)) as chunks:
                async for chunk in chunks:
                    trace.chunk()
                    await context.write(chunk)

    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async with self._call("Generate", context) as (record, trace):
            req = self._parse(raw)
            info, deadline = self._route(req, context)
            trace.routed(req, info.model, info.prompt_tokens)
            response = await self.dispatcher.unary(raw, info, deadline, record,
                                                   on_attempt=trace.on_attempt)
            trace.chunk()
        return response

    async def ListModels(self, request: inference_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> inference_pb2.ListModelsResponse:
        return inference_pb2.ListModelsResponse(models=[
            inference_pb2.ModelInfo(name=m.name, aliases=m.aliases,
                                    max_context_length=m.max_context_length,
                                    tensor_parallel_size=m.tensor_parallel_size,
                                    capacity_weight=m.capacity_weight, node_ids=m.node_ids)
            for m in self.registry.models()])


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException,
                 record: DispatchRecord, trace: Trace = NOOP) -> None:
    code, details = errors.status_for(exc)
    await context.abort(code, details, trailing_metadata=_trailing(record, trace))


def _identity(b: bytes) -> bytes:
    return b


def inference_handler(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """Registers the Inference service with raw-bytes request/response for the Generate RPCs."""
    return grpc.method_handlers_generic_handler("gpumesh.v1.Inference", {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, request_deserializer=_identity, response_serializer=_identity),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=_identity,
            response_serializer=_identity),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels,
            request_deserializer=inference_pb2.ListModelsRequest.FromString,
            response_serializer=inference_pb2.ListModelsResponse.SerializeToString),
    })


# ---------------------------------------------------------------------------- control plane


def registration_from_proto(r: control_pb2.Registration) -> NodeRegistration:
    return NodeRegistration(
        node_id=r.node_id, address=r.address, incarnation=r.incarnation, engine=r.engine,
        gpu_model=r.gpu_model, max_concurrency=r.max_concurrency,
        frontend_addresses=tuple(r.frontend_addresses),
        models=tuple(ModelSpec(m.name, tuple(m.aliases), m.max_context_length,
                               m.tensor_parallel_size or 1,
                               m.capacity_weight if m.capacity_weight > 0 else 1.0)
                     for m in r.models))


def load_from_proto(r: control_pb2.LoadReport) -> LoadSample:
    return LoadSample(
        num_running=r.num_running, num_waiting=r.num_waiting,
        pending_prefill_tokens=r.pending_prefill_tokens, kv_cache_usage=r.kv_cache_usage,
        prefix_cache_hit_rate=r.prefix_cache_hit_rate,
        generation_tokens_per_s=r.generation_tokens_per_s,
        prompt_tokens_per_s=r.prompt_tokens_per_s, in_flight=r.in_flight, draining=r.draining,
        kv_capacity_tokens=r.kv_capacity_tokens,
        prefill_capacity_tokens_per_s=r.prefill_capacity_tokens_per_s,
        decode_step_s=r.decode_step_s)


class ControlPlaneServicer(control_pb2_grpc.ControlPlaneServicer):
    """One Connect stream per (node, router process). Membership ends when it ends."""

    def __init__(self, config: RouterConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self._ids = itertools.count(1)
        self.closing = asyncio.Event()

    def _hello(self) -> control_pb2.RouterMessage:
        return control_pb2.RouterMessage(hello=control_pb2.RouterHello(
            router_id=self.config.router_id, peer_addresses=self.config.peer_addresses,
            heartbeat_interval_ms=self.config.heartbeat_interval_ms,
            lease_ttl_ms=int(self.config.lease_ttl_s * 1000)))

    async def Connect(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        stream_id = next(self._ids)
        node_id = ""
        closing = asyncio.ensure_future(self.closing.wait())
        try:
            while True:
                read = asyncio.ensure_future(context.read())
                done, _ = await asyncio.wait({read, closing},
                                             return_when=asyncio.FIRST_COMPLETED)
                if read not in done:
                    read.cancel()
                    return   # router shutting down: the node reconnects elsewhere/later
                msg = read.result()
                if msg is grpc.aio.EOF:
                    return
                kind = msg.WhichOneof("kind")
                if kind == "registration":
                    reg = registration_from_proto(msg.registration)
                    if not reg.node_id or not reg.address or not reg.models:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                            "registration needs node_id, address and models")
                    if node_id and node_id != reg.node_id:
                        self.registry.stream_closed(node_id, stream_id)
                    node_id = reg.node_id
                    self.registry.register(reg, stream_id)
                    await context.write(self._hello())
                elif kind == "heartbeat":
                    if not node_id:
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                            "the first message must be a Registration")
                    hb = msg.heartbeat
                    if self.registry.entry(node_id) is None:
                        # Dropped meanwhile (its other stream to this router closed, or the lease
                        # lapsed) but this stream is alive: soft state re-admits it.
                        self.registry.register(reg, stream_id)
                    self.registry.heartbeat(
                        node_id, stream_id, hb.seq, hb.sent_unix_ms, load_from_proto(hb.load),
                        accounts=[(a.router_id, AccountSample(
                            a.admitted_requests, a.admitted_prompt_tokens,
                            a.first_token_requests, a.first_token_prompt_tokens,
                            a.finished_requests if a.HasField("finished_requests") else None))
                            for a in hb.load.router_accounts],
                        gpus=tuple(GpuStat(g.index, g.utilization, g.memory_used_bytes,
                                           g.memory_total_bytes) for g in hb.load.gpus))
                    await context.write(control_pb2.RouterMessage(
                        ack=control_pb2.HeartbeatAck(seq=hb.seq)))
                elif kind == "deregistration":
                    if node_id:
                        self.registry.deregister(node_id, stream_id, msg.deregistration.reason)
                    node_id = ""
                    return
        finally:
            closing.cancel()
            if node_id:
                self.registry.stream_closed(node_id, stream_id)


# ---------------------------------------------------------------------------- Router service

_STATE = {NodeState.HEALTHY: control_pb2.NODE_STATE_HEALTHY,
          NodeState.STALE: control_pb2.NODE_STATE_STALE,
          NodeState.DRAINING: control_pb2.NODE_STATE_DRAINING}


def _load_to_proto(report: Report | None) -> control_pb2.LoadReport:
    if report is None:
        return control_pb2.LoadReport()
    l = report.load
    return control_pb2.LoadReport(
        num_running=l.num_running, num_waiting=l.num_waiting,
        pending_prefill_tokens=l.pending_prefill_tokens, kv_cache_usage=l.kv_cache_usage,
        prefix_cache_hit_rate=l.prefix_cache_hit_rate,
        generation_tokens_per_s=l.generation_tokens_per_s, in_flight=l.in_flight,
        draining=l.draining, prompt_tokens_per_s=l.prompt_tokens_per_s,
        kv_capacity_tokens=l.kv_capacity_tokens,
        prefill_capacity_tokens_per_s=l.prefill_capacity_tokens_per_s,
        decode_step_s=l.decode_step_s,
        gpus=[control_pb2.GpuStats(index=g.index, utilization=g.utilization,
                                   memory_used_bytes=g.memory_used_bytes,
                                   memory_total_bytes=g.memory_total_bytes)
              for g in report.gpus],
        router_accounts=[control_pb2.RouterAccount(
            router_id=rid, admitted_requests=a.admitted_requests,
            admitted_prompt_tokens=a.admitted_prompt_tokens,
            first_token_requests=a.first_token_requests,
            first_token_prompt_tokens=a.first_token_prompt_tokens,
            finished_requests=a.finished_requests)
            for rid, a in report.accounts])


class RouterServicer(control_pb2_grpc.RouterServicer):
    def __init__(self, config: RouterConfig, registry: Registry, dispatcher: Dispatcher,
                 clock: Callable[[], float], wall_clock: Callable[[], float],
                 telemetry: RouterTelemetry | None = None) -> None:
        self.config = config
        self.telemetry = telemetry or RouterTelemetry.disabled()
        self.registry = registry
        self.dispatcher = dispatcher
        self.clock = clock
        self.wall_clock = wall_clock
        self._picks = 0

    async def GetFleet(self, request: control_pb2.GetFleetRequest,
                       context: grpc.aio.ServicerContext) -> control_pb2.GetFleetResponse:
        nodes = []
        for v in self.registry.fleet():
            reg = v.entry.registration
            nodes.append(control_pb2.NodeStatus(
                node_id=reg.node_id, address=reg.address, state=_STATE[v.state],
                models=[control_pb2.ServedModel(
                    name=m.name, aliases=m.aliases, max_context_length=m.max_context_length,
                    tensor_parallel_size=m.tensor_parallel_size,
                    capacity_weight=m.capacity_weight) for m in reg.models],
                load=_load_to_proto(v.entry.report),
                last_heartbeat_age_s=v.report_age_s if math.isfinite(v.report_age_s) else -1.0,
                router_in_flight=v.router_in_flight, engine=reg.engine,
                gpu_model=reg.gpu_model, kind=reg.kind,
                frontend_addresses=reg.frontend_addresses))
        workers = self.config.peer_addresses if len(self.config.peer_addresses) > 1 else ()
        return control_pb2.GetFleetResponse(router_id=self.config.router_id,
                                            policy=self.config.policy, nodes=nodes,
                                            worker_addresses=workers)

    async def Pick(self, request: control_pb2.PickRequest,
                   context: grpc.aio.ServicerContext) -> control_pb2.PickResponse:
        record = DispatchRecord()
        trace = self.telemetry.start("Pick", context, record)
        try:
            if not self.config.ticket_secret:
                raise errors.lookaside_disabled()
            req = request.request
            model = self.registry.resolve(req.model)
            info = RequestInfo(model, estimate_prompt_tokens(req, self.config.chars_per_token),
                               req.routing_key)
            trace.routed(req, model, info.prompt_tokens)
            remaining = context.time_remaining()
            deadline = self.clock() + (self.config.request_timeout_s
                                       if remaining is None else remaining)
            lease = await self.dispatcher.pick(info, deadline, record,
                                               frozenset(request.exclude_node_ids))
            ticket, expires_ms = tickets.issue(
                self.config.ticket_secret_bytes, self.config.router_id, lease.node_id,
                info.prompt_tokens, self.config.ticket_ttl_s, now=self.wall_clock())
        except (errors.RouterError, ValueError) as e:
            if isinstance(e, ValueError):
                e = errors.RouterError(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            trace.fail(e)
            await _abort(context, e, record, trace)
        finally:
            trace.finish(record)
        context.set_trailing_metadata(_trailing(record, trace))
        address = lease.address
        if lease.frontends:  # a node with several front-end processes: each in turn
            self._picks += 1
            address = lease.frontends[self._picks % len(lease.frontends)]
        return control_pb2.PickResponse(node_id=lease.node_id, address=address,
                                        ticket=ticket, expires_unix_ms=expires_ms, model=model)

