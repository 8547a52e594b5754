"""The grpc.aio call shapes the dispatcher uses, over a translating worker call."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A status raised by the translation as if the worker had answered it."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class WorkerStreamCall:
    """What the dispatcher needs of a ``grpc.aio.UnaryStreamCall`` (read / cancel / done),
    over the generator that translates a worker's stream. ``inner``: the worker calls the
    generator started, cancelled with this call."""

    def __init__(self, gen: AsyncIterator[bytes], inner: list[grpc.aio.Call]) -> None:
        self._gen = gen
        self._inner = inner
        self._done = False

    async def read(self) -> bytes | Any:
        try:
            return await self._gen.__anext__()
        except StopAsyncIteration:
            self._done = True
            return grpc.aio.EOF
        except BaseException:
            self._done = True
            raise

    def cancel(self) -> bool:
        self._done = True
        for call in self._inner:
            call.cancel()
        # Run the generator's cleanup (its counts) now rather than at garbage collection.
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(self._gen.aclose())  # type: ignore[attr-defined]
        return True

    def done(self) -> bool:
        return self._done
