"""``RouterControlPlaneServicer``: the ControlPlane Connect stream, one per (node, router
process). Membership lives as long as the stream: registration, heartbeats, leave.

The first message must be a Registration (node_id, address and models required); each
heartbeat is acknowledged with its seq. When the router stops, open streams end and nodes
reconnect elsewhere or later.
"""

from __future__ import annotations

import asyncio
import itertools

import grpc

from gpumesh import wire
from gpumesh.router.config import RouterConfig
from gpumesh.router.fleet import Registry
from gpumesh.v1 import control_pb2, control_pb2_grpc


class RouterControlPlaneServicer(control_pb2_grpc.ControlPlaneServicer):
    """Set ``closing`` to end every open stream (router shutdown)."""

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
                    reg = wire.registration_from_proto(msg.registration)
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
                    self.registry.heartbeat(node_id, stream_id, hb.seq, hb.sent_unix_ms,
                                            wire.load_report_from_proto(hb.load))
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
