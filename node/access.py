"""Who may call a node directly (``NodeConfig.security.router_only``): a
``grpc.aio.ServerInterceptor``.

With ``router_only`` on, Generate / GenerateStream need a caller certificate with OU=router
(mutual TLS, ``tls_require_client_cert``) or a lookaside ticket in the request (which the
servicer then verifies with the ticket secret); every method of vLLM's ``VllmEngine`` service
needs the router certificate. Otherwise: PERMISSION_DENIED, logged at most once a second.
ListModels and health stay open (they reveal what the router's ListModels does). A forged
``x-gpumesh-router-id`` metadata key proves nothing and is not accepted as identity.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from pydantic import Field

from gpumesh.security.handlers import wrap_handler
from gpumesh.security.settings import SecuritySettings
from gpumesh.security.tls import peer_identity
from gpumesh.v1 import inference_pb2

log = logging.getLogger(__name__)

_GENERATE = ("/gpumesh.v1.Inference/Generate", "/gpumesh.v1.Inference/GenerateStream")
_VLLM = "/vllm."



class NodeSecuritySettings(SecuritySettings):
    """The node's ``[security]`` section: the shared TLS / token keys, plus who may call it.
    With tls_ca_file the node dials routers over TLS presenting its certificate (the router
    binds the node id to the certificate's CN)."""

    router_only: bool = Field(
        False, description="Inference calls only from routers: a caller certificate with "
                           "OU=router, or a valid lookaside ticket; anything else "
                           "PERMISSION_DENIED. Off: anyone who reaches the port.")
    require_ticket: bool = Field(
        False, description="Refuse requests that carry neither a router ticket nor router "
                           "metadata.")

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
        # (a streaming-request method's check sees no request: no ticket either)
        return wrap_handler(handler, self._ticketed if generate else self._router_only)

    async def _router_only(self, request: Any, ctx: grpc.aio.ServicerContext) -> None:
        await self.check(request, ctx, False)

    async def _ticketed(self, request: Any, ctx: grpc.aio.ServicerContext) -> None:
        await self.check(request, ctx, True)

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
