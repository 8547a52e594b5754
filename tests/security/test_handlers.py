"""gpumesh.security.handlers.wrap_handler on a real grpc.aio server over loopback: ``before``
runs first with the request (None for a streaming request) and can refuse the call before the
servicer runs; ``after`` runs once with whether the servicer completed; a cancelled response
stream's servicer generator is closed at once; the deserializer can be replaced."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from gpumesh.security.handlers import wrap_handler

SERVICE = "test.Wrapped"


def _raw(b: bytes) -> bytes:
    return b


class _Recorder:
    def __init__(self) -> None:
        self.before: list[Any] = []
        self.after: list[tuple[Any, bool]] = []
        self.closed = asyncio.Event()
        self.servicer_ran = 0

    async def check(self, request: Any, ctx: grpc.aio.ServicerContext) -> str:
        self.before.append(request)
        if request == b"refuse":
            await ctx.abort(grpc.StatusCode.PERMISSION_DENIED, "refused")
        return f"token-{len(self.before)}"

    def done(self, token: Any, ok: bool) -> None:
        self.after.append((token, ok))

    async def unary(self, request: bytes, ctx: grpc.aio.ServicerContext) -> bytes:
        self.servicer_ran += 1
        if request == b"fail":
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad")
        return request.upper()

    async def stream(self, request: bytes, ctx: grpc.aio.ServicerContext
                     ) -> AsyncIterator[bytes]:
        self.servicer_ran += 1
        try:
            for i in range(1000):
                yield b"%d" % i
                await asyncio.sleep(0.01)
        finally:
            self.closed.set()

    async def chat(self, requests: Any, ctx: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for r in requests:
            yield r[::-1]


@pytest.fixture
async def served():
    rec = _Recorder()
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(rec.unary, _raw, _raw),
        "Stream": grpc.unary_stream_rpc_method_handler(rec.stream, _raw, _raw),
        "Chat": grpc.stream_stream_rpc_method_handler(rec.chat, _raw, _raw),
    }
    wrapped = {name: wrap_handler(h, rec.check, rec.done) for name, h in handlers.items()}
    # the deserializer is replaceable too (the guard's lenient parse)
    wrapped["Shout"] = wrap_handler(handlers["Unary"], rec.check, rec.done,
                                    deserializer=lambda b: b + b"!")
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, wrapped),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield rec, ch
    finally:
        await server.stop(0)


async def _until(cond: Any) -> None:
    """The server ends its call after the client has the status: wait for its hooks."""
    for _ in range(250):
        if cond():
            return
        await asyncio.sleep(0.02)


def _call(ch: grpc.aio.Channel, method: str, kind: str = "unary_unary") -> Any:
    return getattr(ch, kind)(f"/{SERVICE}/{method}", request_serializer=_raw,
                             response_deserializer=_raw)


async def test_unary_before_and_after(served) -> None:
    rec, ch = served
    assert await _call(ch, "Unary")(b"hi", timeout=10) == b"HI"
    assert rec.before == [b"hi"] and rec.after == [("token-1", True)]
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await _call(ch, "Unary")(b"fail", timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await _until(lambda: len(rec.after) == 2)
    assert rec.after[-1] == ("token-2", False)
    assert await _call(ch, "Shout")(b"hey", timeout=10) == b"HEY!"


async def test_a_refused_call_never_reaches_the_servicer(served) -> None:
    rec, ch = served
    for method, kind in (("Unary", "unary_unary"), ("Stream", "unary_stream")):
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            call = _call(ch, method, kind)(b"refuse", timeout=10)
            if kind == "unary_stream":
                async for _ in call:
                    pass
            else:
                await call
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    await asyncio.sleep(0.2)
    assert rec.servicer_ran == 0 and rec.after == []


async def test_a_cancelled_stream_closes_its_servicer_at_once(served) -> None:
    rec, ch = served
    call = _call(ch, "Stream", "unary_stream")(b"go", timeout=30)
    got = [await call.read() for _ in range(3)]
    assert got == [b"0", b"1", b"2"]
    call.cancel()
    await asyncio.wait_for(rec.closed.wait(), 5)
    await _until(lambda: rec.after)
    assert rec.after == [("token-1", False)]


async def test_a_streaming_request_is_checked_on_its_metadata(served) -> None:
    rec, ch = served
    call = _call(ch, "Chat", "stream_stream")(timeout=10)
    await call.write(b"abc")
    assert await call.read() == b"cba"
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert rec.before == [None]
    await _until(lambda: rec.after)
    assert rec.after == [("token-1", True)]
