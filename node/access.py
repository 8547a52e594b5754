"""Who may call a node directly (``NodeConfig.router_only``): a ``grpc.aio.ServerInterceptor``.

With ``router_only`` on, Generate / GenerateStream need a caller certificate with OU=router
(mutual TLS, ``tls_require_client_cert``) or a lookaside ticket in the request (which the
servicer then verifies with the ticket secret); every method of vLLM's ``VllmEngine`` service
needs the router certificate. Otherwise: PERMISSION_DENIED, logged at most once a second.
ListModels and health stay open (they reveal what the router's ListModels does). A forged
``x-gpumesh-router-id`` metadata key proves nothing and is not accepted as identity.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from gpumesh.security.tls import peer_identity
from gpumesh.v1 import inference_pb2

log = logging.getLogger(__name__)

_GENERATE = ("/gpumesh.v1.Inference/Generate", "/gpumesh.v1.Inference/GenerateStream")
_VLLM = "/vllm."


class RouterOnly(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self.rejected = 0
        self._logged = -1e9

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method
        generate = method in _GENERATE
        if not generate and not method.startswith(_VLLM):
            return handler
        return _guarded(handler, self, ticket_ok=generate)

    async def check(self, request: Any, ctx: grpc.aio.ServicerContext, ticket_ok: bool) -> None:
        ident = peer_identity(ctx)
        if ident.present and "router" in ident.roles:
            return
        if ticket_ok and isinstance(request, inference_pb2.GenerateRequest) and request.ticket:
            return   # verified by the servicer (gpumesh.tickets)
        self.rejected += 1
        now = time.monotonic()
        if now - self._logged >= 1.0:
            self._logged = now
            log.warning("direct call from %s refused: router_only", ctx.peer())
        await ctx.abort(grpc.StatusCode.PERMISSION_DENIED,
                        "this node accepts calls from routers only (a router certificate, or "
                        "a router's lookaside ticket)")


def _guarded(h: grpc.RpcMethodHandler, auth: RouterOnly, ticket_ok: bool
             ) -> grpc.RpcMethodHandler:
    if h.unary_unary is not None:
        inner = h.unary_unary

        async def uu(request: Any, ctx: grpc.aio.ServicerContext) -> Any:
            await auth.check(request, ctx, ticket_ok)
            return await inner(request, ctx)
        return grpc.unary_unary_rpc_method_handler(uu, h.request_deserializer,
                                                   h.response_serializer)
    if h.unary_stream is not None:
        inner_s = h.unary_stream

        async def us(request: Any, ctx: grpc.aio.ServicerContext) -> Any:
            await auth.check(request, ctx, ticket_ok)
            result = inner_s(request, ctx)
            if inspect.isasyncgen(result):
                try:
                    async for item in result:
                        yield item
                finally:
                    await result.aclose()   # at once: a cancelled call aborts in the engine
            else:
                await result   # a servicer that writes through the context
        return grpc.unary_stream_rpc_method_handler(us, h.request_deserializer,
                                                    h.response_serializer)
    if h.stream_unary is not None:
        inner_su = h.stream_unary

        async def su(it: Any, ctx: grpc.aio.ServicerContext) -> Any:
            await auth.check(None, ctx, False)
            return await inner_su(it, ctx)
        return grpc.stream_unary_rpc_method_handler(su, h.request_deserializer,
                                                    h.response_serializer)
    inner_ss = h.stream_stream

    async def ss(it: Any, ctx: grpc.aio.ServicerContext) -> Any:
        await auth.check(None, ctx, False)
        result = inner_ss(it, ctx)
        if inspect.isasyncgen(result):
            try:
                async for item in result:
                    yield item
            finally:
                await result.aclose()
        else:
            await result
    return grpc.stream_stream_rpc_method_handler(ss, h.request_deserializer,
                                                 h.response_serializer)
