"""The router's transport for the attempt layers (``gpumesh.attempts``): proxy mode.

``ProxyTransport.open`` is one attempt's way to a node: admission picks and charges the node
(``Dispatcher.assign``), the node call starts with the dispatch metadata (router id, the
prompt tokens charged, the attempt span's context), and the call is wrapped in the router's
own layers: the outlier feedback (``ejection.ObservedCall``) around the stall watch
(``watch.WatchedCall``) around ``ProxyCall``, the node call itself.

``ProxyCall`` is where an attempt's outcome is observed, each in one spot: ``first`` sees the
node's first chunk (the first token reached the router: the credit releases its prompt
tokens), ``close`` sees the end of the attempt (the credit releases its slot; a failure is
recorded in the request's ``DispatchRecord``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from gpumesh.router.backends import dispatch_metadata
from gpumesh.router.dispatch import failover
from gpumesh.router.dispatch.context import RequestContext
from gpumesh.router.dispatch.ejection import ObservedCall
from gpumesh.router.dispatch.records import Assignment, ChargeFn, DispatchRecord
from gpumesh.router.dispatch.watch import WatchedCall
from gpumesh.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from gpumesh.router.dispatch.dispatcher import Dispatcher


@dataclass(slots=True, eq=False)
class ProxyCall:
    """One attempt's node call (``gpumesh.attempts.NodeCall[bytes]``): ``call``, a
    ``grpc.aio`` call or a backend's equivalent, to the node ``slot`` assigned, for the
    request of ``record`` whose deadline is ``deadline`` (``d.clock()`` seconds). A stream's
    first chunk is bounded by a first-token deadline derived from the node's own queue
    (``failover.first_token_wait``)."""

    d: Dispatcher
    slot: Assignment
    call: Any
    streaming: bool
    deadline: float
    record: DispatchRecord
    node_id: str = field(init=False)
    _sent: float = field(init=False)     # when the call started (d.clock())
    _answered: bool = field(init=False, default=False)
    _ended: bool = field(init=False, default=False)   # the node's whole answer arrived

    def __post_init__(self) -> None:
        self.node_id = self.slot.node_id
        self._sent = self.d.clock()

    async def first(self) -> bytes | None:
        call = self.call
        if not self.streaming:
            response: bytes = await call
            self._first_chunk()
            self._ended = True
            return response
        clock = self.d.clock
        budget = failover.first_token_wait(self.slot.decision, self.node_id, self.d.config)
        try:
            chunk = await asyncio.wait_for(
                call.read(), min(budget, max(self.deadline - clock(), 0.001)))
        except TimeoutError:
            call.cancel()
            raise failover.first_token_timeout(self.node_id, budget, clock(),
                                               self.deadline) from None
        if chunk is grpc.aio.EOF:   # (read() raises when the node ended with an error)
            return None
        self._first_chunk()
        return chunk

    def _first_chunk(self) -> None:
        """The node's first response reached the router."""
        self._answered = True
        self.record.chunks += 1
        if self.streaming:
            self.slot.credit.first_token()
            # prediction feedback (router.fleet.predictions): right after the credit change,
            # which rebuilds the node's candidate, before any other decision runs
            self.d.registry.predictions.observe(self.node_id, self.slot.decision,
                                                ttft_s=self.d.clock() - self._sent)

    async def next(self) -> bytes | None:
        chunk = await self.call.read()
        if chunk is grpc.aio.EOF:
            self._ended = True
            return None
        self.record.chunks += 1
        return chunk

    def close(self, error: Exception | None) -> None:
        """The attempt ended (``error``: its failure, None: done or the caller stopped)."""
        admitted = True
        if error is not None:
            assert isinstance(error, failover.NodeError)
            self.record.attempts[-1].error = failover.failed_code(error).name
            admitted = self._answered or failover.admitted(error)
        elif self._ended:
            self.d.registry.predictions.observe(self.node_id, self.slot.decision,
                                                completion_s=self.d.clock() - self._sent)
        self.slot.credit.finish(admitted)
        if not self.call.done():
            self.call.cancel()   # the client cancelled or the layers gave up: the node aborts

    def cancel(self) -> None:
        """The stall watch gave up on the call."""
        self.call.cancel()


@dataclass(slots=True, eq=False)
class ProxyTransport:
    """The router's ``gpumesh.attempts.Transport[bytes]`` for one request (module doc).
    ``charge``: how admission charges the chosen node (a proxy stream's credit, or a blind
    one for a unary call). ``never``: nodes no attempt of this request may use (a model's
    prefill nodes while another node serves it: ``disagg.whole_request_exclude``)."""

    d: Dispatcher
    ctx: RequestContext
    record: DispatchRecord
    streaming: bool
    charge: ChargeFn
    never: frozenset[str] = frozenset()
    prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_tokens = self.ctx.info.prompt_tokens

    async def open(self, request: pb.GenerateRequest | None,
                   exclude: frozenset[str]) -> ObservedCall:
        d, ctx = self.d, self.ctx
        slot = await d.assign(ctx, exclude | self.never, self.charge, self.record)
        body = ctx.raw if request is None else request.SerializeToString()
        extra = ctx.on_attempt(slot) if ctx.on_attempt is not None else ()
        # charged = the prefill the node still does (prefix locality: less its cached prefix)
        metadata = dispatch_metadata(d.registry.router_id, slot.charged_tokens, extra)
        timeout_s = max(0.001, min(ctx.deadline - d.clock(), d.config.dispatch.request_timeout_s))
        client = d.channels.get(slot.node_id, slot.address, slot.frontends)
        rpc = client.stream if self.streaming else client.unary
        call = ProxyCall(d, slot, rpc(body, timeout_s=timeout_s, metadata=metadata),
                         self.streaming, ctx.deadline, self.record)
        return ObservedCall(WatchedCall(call, d.watch, self.streaming), d.ejector,
                            ctx.deadline)

    def message(self, chunk: bytes) -> pb.GenerateStreamResponse:
        return pb.GenerateStreamResponse.FromString(chunk)

    def encode(self, message: pb.GenerateStreamResponse) -> bytes:
        return message.SerializeToString()
