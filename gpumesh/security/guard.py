"""Unparseable requests get INVALID_ARGUMENT, not UNKNOWN: a wrapper around a grpc.aio server
through which services are registered.

gRPC's Python server answers a request whose bytes do not parse as the method's message with
UNKNOWN (the deserializer raised). ``GuardedServer(server)`` is passed to the generated
``add_XServicer_to_server`` functions instead of the server: it wraps each method's
deserializer so that a failure yields the ``UNPARSEABLE`` marker, and each unary-request
behaviour so that the marker ends the call with INVALID_ARGUMENT before the servicer runs.
Streaming-request methods (the control plane's Connect) receive the marker from
``context.read()`` and must check for it (``is_unparseable``).

Who calls it: ``router.app`` and ``node.app`` when they register services.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import grpc

from gpumesh.security.handlers import wrap_handler


class _Unparseable:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNPARSEABLE"


UNPARSEABLE: Any = _Unparseable()
DETAILS = "request could not be parsed as the method's message"


def is_unparseable(msg: object) -> bool:
    return msg is UNPARSEABLE


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception:  # noqa: BLE001 - any decode failure is the caller's
            return UNPARSEABLE
    return parse


async def _parsed(request: Any, context: grpc.aio.ServicerContext) -> None:
    """Ends a call whose request did not parse with INVALID_ARGUMENT."""
    if request is UNPARSEABLE:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, DETAILS)


def guard_handlers(handlers: Mapping[str, grpc.RpcMethodHandler]
                   ) -> dict[str, grpc.RpcMethodHandler]:
    """The same method handlers with lenient deserializers and guarded unary-request
    behaviours (``gpumesh.security.handlers``)."""
    return {name: wrap_handler(h, None if h.request_streaming else _parsed,
                               deserializer=_lenient(h.request_deserializer))
            for name, h in handlers.items()}


class GuardedServer:
    """Stands in for a ``grpc.aio.Server`` in ``add_XServicer_to_server(servicer, server)``:
    registers the service's guarded handlers on the real server."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Ignored: generated code registers the same methods through
        ``add_registered_method_handlers`` too, and those are guarded there."""

    def add_registered_method_handlers(self, service: str,
                                       handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        guarded = guard_handlers(handlers)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, guarded),))
        self._server.add_registered_method_handlers(service, guarded)
