"""Orders from the router to a node, written on the node's own Connect stream.

The ControlPlane servicer opens one outbox per Connect stream (``open``/``close``) and, while
it waits for the node's next message, writes whatever the operator API queued for that stream
(``wait_read``). The operator API (``DrainNode``, ``UndrainNode``) queues a ``RouterMessage``
for the stream that registered the node (``send``). Single event loop: no locks.
"""

from __future__ import annotations

import asyncio

import grpc

from gpumesh.v1 import control_pb2


class NodeOrders:
    """Per-stream outboxes of ``RouterMessage`` (stream ids as the registry knows them)."""

    def __init__(self) -> None:
        self._outboxes: dict[int, asyncio.Queue[control_pb2.RouterMessage]] = {}

    def open(self, stream_id: int) -> asyncio.Queue[control_pb2.RouterMessage]:
        return self._outboxes.setdefault(stream_id, asyncio.Queue())

    def close(self, stream_id: int) -> None:
        self._outboxes.pop(stream_id, None)

    def send(self, stream_id: int, msg: control_pb2.RouterMessage) -> bool:
        """Queues ``msg`` for the stream; False when the stream has no outbox (closed, or a
        node the router registered itself, such as a stock vLLM worker)."""
        box = self._outboxes.get(stream_id)
        if box is None:
            return False
        box.put_nowait(msg)
        return True


async def wait_read(read: asyncio.Future[object], closing: asyncio.Future[object],
                    outbox: asyncio.Queue[control_pb2.RouterMessage],
                    context: grpc.aio.ServicerContext) -> bool:
    """Waits for ``read`` (the node's next message), writing queued orders meanwhile; False
    when ``closing`` finished first (the caller cancels ``read``)."""
    while True:
        order = asyncio.ensure_future(outbox.get())
        done, _ = await asyncio.wait({read, closing, order},
                                     return_when=asyncio.FIRST_COMPLETED)
        if order in done:
            await context.write(order.result())
        else:
            order.cancel()   # nothing taken: asyncio.Queue keeps items of a cancelled get
        if read in done:
            return True
        if closing in done:
            return False
