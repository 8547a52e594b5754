"""One request's attempts, in layers, the way httpx layers send -> auth -> redirects -> one
request. Read top to bottom:

    send(transport, failover, state)       the request: every chunk the client receives
      continue_mid_stream                  after output reached the client: another node
                                           continues the stream from the tokens delivered
        retry_before_first_token           before output: the same request on another node
          single_attempt                   pick a node, open its call, await its answer

The router (proxy mode) and the client library (lookaside mode) run these same layers, each
with its own ``Transport`` (how one attempt reaches a node) and ``Failover`` (what a failure
means there):

- router: admission picks the node and the router forwards its chunks
  (``gpumesh.router.dispatch.proxy``; rules in ``gpumesh.router.dispatch.failover``); its node
  calls are wrapped in the outlier feedback (``dispatch.ejection``) and the stall watch
  (``dispatch.watch``);
- client: the router's ``Pick`` RPC picks the node and the client calls it with the ticket
  (``gpumesh.client``).

Another kind of attempt (a disaggregated one: prefill on one node, then decode on another)
is another ``Transport.open`` behind the same ``NodeCall``, or another ``single_attempt``
passed to ``send``; retry and migration stay as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from gpumesh.migration import StreamProgress, final_chunk, resume_request
from gpumesh.v1 import inference_pb2 as pb

Chunk = TypeVar("Chunk")
Chunk_co = TypeVar("Chunk_co", covariant=True)


class NodeCall(Protocol[Chunk_co]):
    """One attempt's call on one node, opened by ``Transport.open``."""

    node_id: str

    async def first(self) -> Chunk_co | None:
        """The node's first response (a stream's first chunk, or the unary answer); None when
        it ended without one. Raises one of ``Failover.failures`` for a failed call."""
        ...

    async def next(self) -> Chunk_co | None:
        """A stream's next chunk; None at its end. Raises like ``first``."""
        ...

    def close(self, error: Exception | None) -> None:
        """The attempt is over: ``error`` is the failure that ended it, None when it ended
        cleanly or the caller stopped. Releases what the attempt holds and cancels the call
        when it is still running (the node then aborts the request). Called exactly once."""
        ...


class Transport(Protocol[Chunk]):
    """How one attempt reaches a node, for one request."""

    streaming: bool        # False: one answer (``first``), no ``next``
    prompt_tokens: int     # the request's prompt size as the transport counts it (0: unknown)

    async def open(self, request: pb.GenerateRequest | None,
                   exclude: frozenset[str]) -> NodeCall[Chunk]:
        """Picks a node outside ``exclude`` and starts the call. ``request``: None sends the
        client's request as received, else this continuation of it. Raises one of
        ``Failover.failures`` when no node can take it."""
        ...

    def message(self, chunk: Chunk) -> pb.GenerateStreamResponse:
        """A stream chunk as a message (what the migration layer reads of it)."""
        ...

    def encode(self, message: pb.GenerateStreamResponse) -> Chunk:
        """A chunk for the client, from a message (the end of a migrated stream)."""
        ...


class Failover(Protocol):
    """What a failed attempt means for the next one."""

    failures: tuple[type[Exception], ...]   # what a failed pick or node call raises

    def retry(self, error: Exception, attempt: int, node_id: str) -> bool:
        """Before output: whether the request goes to another node after ``error`` on
        ``node_id`` (``attempt``: attempts made so far, 1-based)."""
        ...

    def migrate(self, error: Exception, migrations: int, node_id: str,
                delivered_tokens: int) -> bool:
        """After output: whether another node continues the stream (``migrations``:
        continuations so far)."""
        ...

    def after_output(self, error: Exception, node_id: str) -> BaseException:
        """What the client sees when a stream that delivered output ends with ``error``."""
        ...


@dataclass
class Attempts:
    """One request's attempts so far, shared by the layers. ``request``: the parsed request
    when its stream may continue on another node (None: it may not); ``progress``: what the
    client was sent, when something reads it (None: nothing does)."""

    request: pb.GenerateRequest | None = None
    progress: StreamProgress | None = None
    attempt: int = 0                       # attempts started
    delivered: int = 0                     # chunks the client received
    tried: frozenset[str] = frozenset()    # nodes that failed this request
    node_id: str = ""                      # the latest attempt's node
    last_error: Exception | None = None    # the latest attempt's failure


class NoNode(Exception):
    """No node took an attempt; ``error`` is what the client sees (the previous attempt's
    failure when there was one: it says more than "no node left")."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


Opened = tuple[NodeCall[Chunk], Chunk | None]
SingleAttempt = Callable[[Transport[Chunk], Failover, Attempts, pb.GenerateRequest | None],
                         Awaitable[Opened[Chunk]]]


async def single_attempt(t: Transport[Chunk], f: Failover, s: Attempts,
                         request: pb.GenerateRequest | None) -> Opened[Chunk]:
    """One node: pick it, open its call, await its first answer. Returns the open call and
    that answer (the caller reads the rest and closes it). Raises ``NoNode`` when no node
    took it, one of ``f.failures`` when the node failed (the call is closed then)."""
    s.attempt += 1
    try:
        call = await t.open(request, s.tried)
    except f.failures as e:
        raise NoNode(s.last_error or e) from None
    s.node_id = call.node_id
    try:
        first = await call.first()
    except f.failures as e:
        call.close(e)
        raise
    except BaseException:
        call.close(None)
        raise
    return call, first


async def retry_before_first_token(t: Transport[Chunk], f: Failover, s: Attempts,
                                   request: pb.GenerateRequest | None,
                                   one: SingleAttempt[Chunk] = single_attempt) -> Opened[Chunk]:
    """``one`` until a node answers: a failure before the client saw output goes to another
    node while ``f.retry`` allows. Once output was delivered, failures pass up unchanged
    (``continue_mid_stream`` handles them)."""
    while True:
        try:
            return await one(t, f, s, request)
        except NoNode as e:
            if s.delivered:
                raise
            raise e.error from None
        except f.failures as e:
            if s.delivered or not f.retry(e, s.attempt, s.node_id):
                raise
            s.last_error = e
            s.tried = s.tried | {s.node_id}


async def continue_mid_stream(t: Transport[Chunk], f: Failover, s: Attempts,
                              one: SingleAttempt[Chunk] = single_attempt
                              ) -> AsyncGenerator[Chunk, None]:
    """Yields every chunk the client receives. A failure after output continues the stream
    on another node from the tokens delivered (``migration.resume_request``) while the
    request may migrate and ``f.migrate`` allows; a stream whose final chunk went out ends
    quietly; one whose every ``max_tokens`` token went out ends with a final chunk."""
    request: pb.GenerateRequest | None = None   # None: the client's own request
    progress = s.progress
    while True:
        try:
            call, chunk = await retry_before_first_token(t, f, s, request, one)
        except NoNode as e:   # only after output: before it the retry layer raised the error
            raise f.after_output(e.error, s.node_id) from None
        except f.failures as e:
            if not s.delivered:
                raise
            request = _continuation(t, f, s, e)   # the continuation failed before output
            if request is None:
                yield _end(t, s)
                return
            continue
        error: Exception | None = None
        try:
            while chunk is not None:
                s.delivered += 1
                if progress is not None:
                    progress.observe_message(t.message(chunk))
                yield chunk
                if not t.streaming:
                    return
                chunk = await call.next()
            return
        except f.failures as e:
            if progress is not None and progress.finished:
                return   # the client has the whole stream; only its trailers are lost
            error = e
        finally:
            call.close(error)
        request = _continuation(t, f, s, error)
        if request is None:   # every token was delivered; only the stream's end was missing
            yield _end(t, s)
            return


def _continuation(t: Transport[Chunk], f: Failover, s: Attempts,
                  error: Exception) -> pb.GenerateRequest | None:
    """After output: the request that continues the stream on another node (None: nothing
    is left to generate), or raises what the client sees."""
    s.last_error = error
    s.tried = s.tried | {s.node_id}
    progress = s.progress
    if s.request is None or progress is None or not f.migrate(
            error, progress.migrations, s.node_id, len(progress.token_ids)):
        raise f.after_output(error, s.node_id) from None
    progress.migrations += 1
    return resume_request(s.request, progress)


def _end(t: Transport[Chunk], s: Attempts) -> Chunk:
    """The final chunk of a stream whose every ``max_tokens`` token was delivered before its
    node failed."""
    assert s.request is not None and s.progress is not None
    return t.encode(final_chunk(s.request, s.progress, t.prompt_tokens))


def send(t: Transport[Chunk], f: Failover, s: Attempts,
         one: SingleAttempt[Chunk] = single_attempt) -> AsyncGenerator[Chunk, None]:
    """The whole request through the layers (module doc). Close the iterator (``aclosing``)
    when stopping early: that closes the node call, which aborts the request on the node."""
    return continue_mid_stream(t, f, s, one)


async def first_answer(t: Transport[Chunk], f: Failover, s: Attempts,
                       one: SingleAttempt[Chunk] = single_attempt) -> Chunk:
    """A unary request through the layers: the node's one answer."""
    async with contextlib.aclosing(send(t, f, s, one)) as chunks:
        async for chunk in chunks:
            return chunk
    raise AssertionError("a unary attempt answers or raises")  # pragma: no cover
