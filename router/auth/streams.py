"""Bounds on ControlPlane streams that have not registered yet, per peer and in total.

Who calls it: the ControlPlane servicer, when an authenticated stream opens (``enter``) and
when it registers or ends (``leave``). A node sends its Registration at once, so a stream
counts here for a few milliseconds; a caller that opens streams and sends nothing holds at
most ``per_peer`` of them (each for at most one lease, the first message's deadline), and
all callers together at most ``total``. Beyond either bound a new stream ends at once with
RESOURCE_EXHAUSTED; the node retries with backoff. Single event loop: no locks.

``refuse`` ends a stranger's stream. The decision is taken before any message is read, but
the stream is ended only once the caller's first message has arrived (read and discarded
unlooked-at; at most ``REFUSAL_WAIT_S``): gRPC's client loses the status of a bidirectional
call that the server ends while the client is still writing ("Internal error from Core"),
and a refused node must see why it was refused. At most ``MAX_REFUSING`` streams wait so;
beyond that they end at once.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc

from gpumesh.router.auth.interceptor import AuthCounters

MAX_UNREGISTERED_PER_PEER = 64   # a host may run many nodes that (re)connect at once
MAX_UNREGISTERED = 1024
MAX_REFUSING = 256
REFUSAL_WAIT_S = 1.0


def peer_host(peer: str) -> str:
    """The address part of a gRPC peer string ("ipv4:10.0.0.1:5000" -> "ipv4:10.0.0.1",
    "ipv6:[::1]:5000" -> "ipv6:[::1]"); the whole string when it has no port."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


class UnregisteredStreams:
    def __init__(self, per_peer: int = MAX_UNREGISTERED_PER_PEER,
                 total: int = MAX_UNREGISTERED) -> None:
        self.per_peer = per_peer
        self.total = total
        self._by_peer: Counter[str] = Counter()
        self._count = 0
        self._refusing = 0

    def __len__(self) -> int:
        return self._count

    async def enter(self, peer: str, context: grpc.aio.ServicerContext,
                    counters: AuthCounters) -> bool:
        """Counts a new stream of ``peer``; over a bound, ends it with RESOURCE_EXHAUSTED
        (counted as a node rejection) instead."""
        if self._by_peer[peer] >= self.per_peer:
            why = f"{self.per_peer} unregistered control streams from this peer are open"
        elif self._count >= self.total:
            why = f"{self.total} unregistered control streams are open"
        else:
            self._by_peer[peer] += 1
            self._count += 1
            return True
        counters.reject("node", grpc.StatusCode.RESOURCE_EXHAUSTED, why, context.peer())
        await self.refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{why}: send a Registration first")
        return False

    def leave(self, peer: str) -> None:
        self._count -= 1
        self._by_peer[peer] -= 1
        if self._by_peer[peer] <= 0:
            del self._by_peer[peer]

    async def refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode,
                     message: str) -> None:
        """Ends the stream with ``code`` once its first message arrived (module docstring);
        raises like ``context.abort``."""
        if self._refusing < MAX_REFUSING:
            self._refusing += 1
            try:
                await asyncio.wait_for(context.read(), REFUSAL_WAIT_S)
            except (asyncio.TimeoutError, grpc.RpcError, RuntimeError):
                pass   # nothing came, or the caller left: end it all the same
            finally:
                self._refusing -= 1
        await context.abort(code, message)
