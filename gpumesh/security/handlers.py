"""The one way a gRPC method handler is wrapped: a check before the servicer runs, in the
call's own task, and an optional hook when the call ends.

Users: ``gpumesh.security.guard`` (an unparseable request ends with INVALID_ARGUMENT),
``gpumesh.node.access`` (a node that serves routers only) and ``gpumesh.router.auth``
(API keys, quotas, operator credentials).

``wrap_handler(handler, before, after)`` returns a handler of the same kind (unary or
streaming request and response, same serializers unless ``deserializer`` replaces the
request's):

- ``before(request, context)`` runs first and returns a token (anything; ``None`` is fine).
  A streaming-request method gets ``None`` for ``request``: only the call's metadata and peer
  are known before its messages are read. To refuse the call, ``before`` aborts it through
  ``context.abort`` (which raises); ``after`` then does not run.
- ``after(token, ok)`` runs once when the servicer is done: ``ok`` is True when it returned
  (unary) or its stream ended by itself, False when it raised or the call was cancelled.
- A response stream of an async-generator servicer is re-yielded item by item and closed as
  soon as the call ends (``aclose``), not when it is collected, so a cancelled call aborts in
  the engine at once. A servicer that writes through ``context.write`` instead is awaited.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

Before = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
After = Callable[[Any, bool], None]
Deserializer = Callable[[bytes], Any] | None

_KEEP: Any = object()


def _no_after(token: Any, ok: bool) -> None:
    """The ``after`` of a wrapper that has none."""


def _behaviour(inner: Callable[..., Any], before: Before, after: After,
               streaming_request: bool) -> Callable[..., Any]:
    """``inner`` with ``before`` first and ``after`` last, of the same kind as ``inner``
    (async generator function or coroutine function), which is what grpc.aio looks at."""
    if inspect.isasyncgenfunction(inner):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            token = await before(None if streaming_request else request, context)
            gen = inner(request, context)
            ok = False
            try:
                async for item in gen:
                    yield item
                ok = True
            finally:
                await gen.aclose()   # at once: a cancelled call aborts in the engine
                after(token, ok)
        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        token = await before(None if streaming_request else request, context)
        ok = False
        try:
            out = await inner(request, context)
            ok = True
            return out
        finally:
            after(token, ok)
    return call


def wrap_handler(handler: grpc.RpcMethodHandler, before: Before | None,
                 after: After | None = None, *,
                 deserializer: Deserializer = _KEEP) -> grpc.RpcMethodHandler:
    """``handler`` with ``before`` / ``after`` around its behaviour (see the module
    docstring) and, when given, another request deserializer. ``before`` None: the
    behaviour is kept as it is (only the deserializer changes)."""
    des = handler.request_deserializer if deserializer is _KEEP else deserializer
    ser = handler.response_serializer
    done = after or _no_after

    def wrap(inner: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
        if before is None:
            return inner
        return _behaviour(inner, before, done, streaming)

    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False), des, ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, False), des,
                                                    ser)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, True), des,
                                                    ser)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, True), des, ser)
