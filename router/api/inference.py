"""``RouterInferenceServicer``: the node's Inference contract (Generate, GenerateStream,
ListModels), served by routing.

Requests and responses travel as raw bytes: the router parses a request once to route it and
forwards the client's bytes unchanged; the node's chunks are forwarded unparsed. Every failure
becomes the call's gRPC status (``errors.status_for``); trailing metadata carries the dispatch
record on success and on error (``intake.trailing``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator

import grpc

from gpumesh import wire
from gpumesh.router import errors
from gpumesh.router.api import intake
from gpumesh.router.config import RouterConfig
from gpumesh.router.dispatch import Dispatcher, DispatchRecord, RequestContext
from gpumesh.router.fleet import Registry
from gpumesh.router.telemetry import RouterTelemetry, Trace
from gpumesh.security.guard import guard_handlers
from gpumesh.v1 import inference_pb2

log = logging.getLogger(__name__)


class RouterInferenceServicer:
    """``in_flight`` / ``idle``: calls inside the servicer (shutdown drains them);
    ``closing``: new calls are refused with UNAVAILABLE."""

    def __init__(self, config: RouterConfig, registry: Registry, dispatcher: Dispatcher,
                 clock: Callable[[], float], telemetry: RouterTelemetry | None = None) -> None:
        self.config = config
        self.telemetry = telemetry or RouterTelemetry.disabled()
        self.registry = registry
        self.dispatcher = dispatcher
        self.clock = clock
        self.in_flight = 0
        self.request_ids: set[str] = set()   # clients' request ids in flight here
        self.closing = False
        self.idle = asyncio.Event()
        self.idle.set()

    async def GenerateStream(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        async with self._call("GenerateStream", context) as (record, trace):
            ctx = await self._prepare(raw, context, trace)
            with self._request_id(ctx.request.request_id):
                async with contextlib.aclosing(self.dispatcher.stream(ctx, record)) as chunks:
                    async for chunk in chunks:
                        trace.chunk()
                        await context.write(chunk)

    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        async with self._call("Generate", context) as (record, trace):
            ctx = await self._prepare(raw, context, trace)
            with self._request_id(ctx.request.request_id):
                response = await self.dispatcher.unary(ctx, record)
            trace.chunk()
        return response

    async def ListModels(self, request: inference_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> inference_pb2.ListModelsResponse:
        return inference_pb2.ListModelsResponse(models=[
            wire.model_info_to_proto(m, m.node_ids) for m in self.registry.models()])

    async def _prepare(self, raw: bytes, context: grpc.aio.ServicerContext,
                       trace: Trace) -> RequestContext:
        """The request parsed and its context built, once (``intake.prepare``)."""
        req = intake.parse_request(raw)
        if self.closing:
            raise errors.RouterError(grpc.StatusCode.UNAVAILABLE, "router is shutting down")
        return await intake.prepare(raw, req, self.config, self.dispatcher, context,
                                    self.clock, trace)

    @contextlib.contextmanager
    def _request_id(self, request_id: str) -> Iterator[None]:
        """ALREADY_EXISTS for a client's request id in flight on this router (the node
        refuses one in flight there too); ids the client left empty are the node's."""
        if not request_id:
            yield
            return
        if request_id in self.request_ids:
            raise errors.duplicate_request_id(request_id)
        self.request_ids.add(request_id)
        try:
            yield
        finally:
            self.request_ids.discard(request_id)

    @contextlib.contextmanager
    def _tracked(self) -> Iterator[None]:
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
                await intake.abort(context, e, record, trace)
            except asyncio.CancelledError:
                trace.cancelled()
                raise
            except Exception as e:
                log.exception("%s failed", method)
                trace.fail(e)
                await intake.abort(context, e, record, trace)
            finally:
                trace.finish(record)
            context.set_trailing_metadata(intake.trailing(record, trace))


def _identity(b: bytes) -> bytes:
    return b


def inference_handler(servicer: RouterInferenceServicer) -> grpc.GenericRpcHandler:
    """Registers the Inference service with raw-bytes request/response for the Generate RPCs."""
    # guard_handlers: an unparseable ListModelsRequest is INVALID_ARGUMENT, not UNKNOWN
    return grpc.method_handlers_generic_handler("gpumesh.v1.Inference", guard_handlers({
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, request_deserializer=_identity, response_serializer=_identity),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=_identity,
            response_serializer=_identity),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels,
            request_deserializer=inference_pb2.ListModelsRequest.FromString,
            response_serializer=inference_pb2.ListModelsResponse.SerializeToString),
    }))
