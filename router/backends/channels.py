"""The node transport seam: one client per node, whatever speaks to it.

A ``NodeTransport`` takes the client's serialized gpumesh ``GenerateRequest`` and answers
serialized gpumesh responses: ``stream`` returns a call with ``read()`` (``grpc.aio.EOF`` at
the end), ``cancel()`` and ``done()``; ``unary`` returns an awaitable of the serialized
``GenerateResponse`` with ``cancel()`` and ``done()``. Cancelling a call aborts the request on
the node. gpumesh nodes are served by ``gpumesh_node.NodeClient``; stock vLLM gRPC workers by
``vllm_grpc.ForeignClient``, which membership adopts here for its node id.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc

from gpumesh.router.backends.gpumesh_node import NodeClient
from gpumesh.security.tls import certificate_name


class NodeTransport(Protocol):
    node_id: str
    address: str

    def stream(self, request: bytes, *, timeout_s: float,
               metadata: Sequence[tuple[str, str]]) -> Any: ...

    def unary(self, request: bytes, *, timeout_s: float,
              metadata: Sequence[tuple[str, str]]) -> Any: ...

    async def close(self, grace_s: float | None) -> None: ...


class NodeChannels:
    """One transport per node id: a NodeClient per (node id, address), created on first use,
    unless a backend adopted the node id."""

    def __init__(self, keepalive_time_ms: int = 30_000, close_grace_s: float = 30.0,
                 credentials: Callable[[], grpc.ChannelCredentials] | None = None) -> None:
        """``credentials``: called for each new node channel (TLS files re-read then); None =
        plaintext. With TLS, a channel to node X verifies the node's certificate against
        ``certificate_name(X, "node")`` (gpumesh.security.tls), not the address's host: the
        handshake completes only with a certificate of OU=node and CN=X, so a member that
        registers an address served by another certificate (another node's, a client's)
        gets no request (the dispatcher sees UNAVAILABLE and goes elsewhere)."""
        self._credentials = credentials
        self._clients: dict[str, NodeTransport] = {}
        self._keepalive_time_ms = keepalive_time_ms
        self._close_grace_s = close_grace_s
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, node_id: str, address: str, frontends: Sequence[str] = ()) -> NodeTransport:
        c = self._clients.get(node_id)
        if c is None or c.address != address or getattr(c, "frontends", ()) != tuple(frontends):
            if c is not None:
                self._close_later(c)
            tls = self._credentials is not None
            c = NodeClient(node_id, address, self._keepalive_time_ms, frontends,
                           self._credentials() if self._credentials is not None else None,
                           server_name=certificate_name(node_id, "node") if tls else "")
            self._clients[node_id] = c
        return c

    def adopt(self, client: NodeTransport) -> None:
        """Use ``client`` for its ``node_id`` from now on (a stock vLLM worker's translating
        client). Removal (``forget``) drops it as usual."""
        old = self._clients.get(client.node_id)
        if old is not None and old is not client:
            self._close_later(old)
        self._clients[client.node_id] = client

    def forget(self, node_id: str) -> None:
        """The node left: close its channel once its in-flight calls end (bounded grace)."""
        c = self._clients.pop(node_id, None)
        if c is not None:
            self._close_later(c)

    def _close_later(self, c: NodeTransport) -> None:
        task = asyncio.get_running_loop().create_task(c.close(self._close_grace_s))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.close(None) for c in clients), *self._closing,
                             return_exceptions=True)

    def __contains__(self, node_id: str) -> bool:
        return node_id in self._clients
