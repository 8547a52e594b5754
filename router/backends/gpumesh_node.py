"""Router -> gpumesh node calls: one grpc.aio channel per node (per front-end process when the
node has several), raw bytes both ways.

The router forwards the client's serialized GenerateRequest unchanged and hands the node's
serialized responses back unchanged (no protobuf work per token chunk on the hot path).
Retry of transient connection failures and keepalive are declared in the channel's service
config / options. Every call carries a deadline and the metadata ``ROUTER_ID`` and
``CHARGED_TOKENS`` (gpumesh.metadata); callers may add more (e.g. a traceparent).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import grpc

from gpumesh import metadata as md

_GENERATE = "/gpumesh.v1.Inference/Generate"
_GENERATE_STREAM = "/gpumesh.v1.Inference/GenerateStream"

_SERVICE_CONFIG = json.dumps({
    "methodConfig": [{
        "name": [{"service": "gpumesh.v1.Inference"}],
        # The dispatcher retries on ANOTHER node; this only covers a connection that fails
        # before the node saw the call (gRPC retries only uncommitted calls).
        "retryPolicy": {
            "maxAttempts": 2,
            "initialBackoff": "0.02s",
            "maxBackoff": "0.1s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
        "waitForReady": False,
    }]
})


def _identity(b: bytes) -> bytes:
    return b


class NodeClient:
    """Calls to one node. Cheap to keep; ``close`` waits for in-flight calls up to grace.

    A node with several front-end processes (``frontends``: their own addresses) gets a
    channel to each, and calls alternate over them: each process then serves an equal share
    of this router's streams (over the node's shared port the kernel would place this one
    connection, and so all of them, on one process)."""

    def __init__(self, node_id: str, address: str, keepalive_time_ms: int,
                 frontends: Sequence[str] = (),
                 credentials: grpc.ChannelCredentials | None = None,
                 server_name: str = "") -> None:
        """``server_name``: with ``credentials``, the name the node's certificate must carry
        (router.backends.channels); empty = the address's host."""
        self.node_id = node_id
        self.address = address
        self.frontends = tuple(frontends)
        options = [
            ("grpc.service_config", _SERVICE_CONFIG),
            ("grpc.enable_retries", 1),
            ("grpc.keepalive_time_ms", keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        # credentials: mutual TLS to the node (RouterConfig.security.tls_*); None = plaintext
        self.channels = [grpc.aio.secure_channel(a, credentials, options=options)
                         if credentials is not None else grpc.aio.insecure_channel(a, options=options)
                         for a in (self.frontends or (address,))]
        self._streams = [c.unary_stream(_GENERATE_STREAM, request_serializer=_identity,
                                        response_deserializer=_identity) for c in self.channels]
        self._unaries = [c.unary_unary(_GENERATE, request_serializer=_identity,
                                       response_deserializer=_identity) for c in self.channels]
        self._turn = 0

    def _next(self) -> int:
        self._turn = (self._turn + 1) % len(self.channels)
        return self._turn

    def stream(self, request: bytes, *, timeout_s: float, metadata: Sequence[tuple[str, str]]
               ) -> grpc.aio.UnaryStreamCall:
        """GenerateStream; iterate the call for serialized GenerateStreamResponse chunks and
        ``cancel()`` it to abort on the node."""
        return self._streams[self._next()](request, timeout=timeout_s, metadata=tuple(metadata))

    def unary(self, request: bytes, *, timeout_s: float, metadata: Sequence[tuple[str, str]]
              ) -> grpc.aio.UnaryUnaryCall:
        """Generate; await the call for the serialized GenerateResponse."""
        return self._unaries[self._next()](request, timeout=timeout_s, metadata=tuple(metadata))

    async def close(self, grace_s: float | None) -> None:
        await asyncio.gather(*(c.close(grace_s) for c in self.channels))


def dispatch_metadata(router_id: str, charged_tokens: int,
                      extra: Sequence[tuple[str, str]] = ()) -> tuple[tuple[str, str], ...]:
    return ((md.ROUTER_ID, router_id), (md.CHARGED_TOKENS, str(int(charged_tokens))), *extra)
