"""The Python client library: one stub for a router or a node, plus lookaside mode.

Proxy mode (default): calls go to ``target`` (a router or a node), tokens come back through it.
Lookaside mode (``lookaside=True``, target must be a router): the client asks the router's
``Router.Pick`` for a node and a signed ticket, then streams from the node directly, through
the same attempt layers the router runs in proxy mode (``gpumesh.attempts``) with its own
transport: a node failing before the first token is retried once with a fresh pick; one
failing after it is replaced mid-stream (the stream continues on another node from the tokens
delivered; ``GenerateRequest.no_migration`` opts out); cancellation (closing the iterator, or
the caller's task being cancelled) cancels the node call, which aborts in the engine.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from gpumesh import attempts
from gpumesh import metadata as md
from gpumesh.migration import StreamProgress
from gpumesh.security.client import ClientTls, bearer_interceptors, open_channel
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc

# Channel-level retry of UNAVAILABLE, declared in the service config rather than hand-rolled
# (grpc's retry design). gRPC retries a call only while no response message has arrived, so a
# stream is never replayed after output (mid-stream failover is the router's, or
# ``MeshClient.stream``'s in lookaside mode). A router that is up but still rebuilding its
# fleet, or a router restarting behind its address, answers UNAVAILABLE with
# grpc-retry-pushback-ms, which these policies honour. Generate and GenerateStream also retry
# CANCELLED: a gRPC server that stops (a router on SIGTERM, after its drain, in
# ``server.stop``) resets the calls that reached it in that instant and were not yet handed to
# a handler with RST_STREAM(CANCEL), which the client sees as CANCELLED before any response;
# only the retry sends such a call to another router. A call the client cancels itself is
# never retried, and nothing is retried once output has arrived.
_SERVICE_CONFIG = json.dumps({
    # round_robin (SPREAD_OPTIONS) watches each address's gRPC health ("" name) and picks only
    # SERVING ones: a router or node that starts draining (NOT_SERVING) gets no new calls and
    # no retries; an address whose server has no health service counts as healthy.
    "healthCheckConfig": {"serviceName": ""},
    "methodConfig": [{
        "name": [{"service": "gpumesh.v1.Inference", "method": "ListModels"},
                 {"service": "gpumesh.v1.Router"}],
        "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
    }, {
        "name": [{"service": "gpumesh.v1.Inference", "method": "Generate"},
                 {"service": "gpumesh.v1.Inference", "method": "GenerateStream"}],
        "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "1s",
                        "backoffMultiplier": 2,
                        "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"]},
    }]})
# Reconnect backoff: gRPC's defaults (1 s first, growing to 120 s) leave a router that
# restarted behind its address unused for seconds to minutes after it serves again, and a
# channel whose other routers then stop has no backend at all. Routers sit beside their
# clients (a data centre, not the internet): the first retry after 0.1 s, at most 1 s apart
# (gRPC jitters each by ±20 %), so a client uses a restarted router within about a second.
CHANNEL_OPTIONS = [("grpc.service_config", _SERVICE_CONFIG), ("grpc.enable_retries", 1),
                   ("grpc.keepalive_time_ms", 30_000),
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1_000)]
# Lookaside mode: node statuses that fail a stream over to another node, and how often.
_NODE_FAULTS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN,
                          grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
                          grpc.StatusCode.CANCELLED})
MAX_MIGRATIONS = 2
# With a spread target (below): one connection per router worker, calls round-robin over them.
SPREAD_OPTIONS = [("grpc.lb_policy_name", "round_robin")]


def _ip_target(addresses: Sequence[str]) -> str:
    """host:port list -> a gRPC ``ipv4:``/``ipv6:`` target (names resolved here, once)."""
    v4: list[str] = []
    v6: list[str] = []
    for a in addresses:
        host, _, port = a.rpartition(":")
        host = host.strip("[]")
        info = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
        ip = info[4][0]
        (v6 if info[0] == socket.AF_INET6 else v4).append(
            f"[{ip}]:{port}" if info[0] == socket.AF_INET6 else f"{ip}:{port}")
    return f"ipv4:{','.join(v4)}" if v4 else f"ipv6:{','.join(v6)}"


async def spread_target(target: str, timeout: float = 10.0) -> str:
    """The target a client with few connections should use for a router started with
    ``--workers N``: its workers' own addresses as one ``ipv4:`` target, to open with
    ``SPREAD_OPTIONS`` (gRPC's round_robin: a connection per worker, calls spread evenly).

    Why: the workers share the public port through SO_REUSEPORT, and the kernel hashes each
    *connection* to a worker; a client's calls all ride its one connection, so a handful of
    clients load the workers unevenly (a few connections over as many workers rarely land
    one per worker) and the busiest worker saturates first. The same for a node with several front-end processes (``frontends``): their own
    addresses, from its ListModels. Returns ``target`` unchanged for a single-process router
    or node."""
    async with grpc.aio.insecure_channel(target) as ch:
        try:
            fleet = await cpb_grpc.RouterStub(ch).GetFleet(cpb.GetFleetRequest(), timeout=timeout)
            workers = list(fleet.worker_addresses)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            try:  # a node
                models = await pb_grpc.InferenceStub(ch).ListModels(pb.ListModelsRequest(),
                                                                    timeout=timeout)
            except grpc.aio.AioRpcError as exc2:
                if exc2.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                return target   # some other Inference server: nothing to spread
            workers = list(models.frontend_addresses)
    return _ip_target(workers) if len(workers) > 1 else target


def build_request(prompt: str | Sequence[int] | Sequence[tuple[str, str]], model: str = "",
                  max_tokens: int | None = None, temperature: float | None = None,
                  top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                  stop: Sequence[str] = (), ignore_eos: bool = False, request_id: str = "",
                  routing_key: str = "", per_token: bool = False,
                  adapter: str = "") -> pb.GenerateRequest:
    """prompt: text, token ids, or chat messages as (role, content) pairs; ``adapter``: a
    LoRA adapter the model's nodes serve (ListModels' ``adapters``)."""
    req = pb.GenerateRequest(model=model, request_id=request_id, routing_key=routing_key,
                             adapter=adapter)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], tuple):
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in prompt)
    else:
        req.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    s = req.sampling
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature),
                        ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
        if value is not None:
            setattr(s, name, value)
    s.stop.extend(stop)
    s.ignore_eos = ignore_eos
    req.stream_options.per_token = per_token
    return req


@dataclass
class StreamResult:
    """Filled in as a stream is consumed; trailing metadata once it ended."""

    node_id: str = ""
    trace_id: str = ""
    attempts: int = 1
    migrations: int = 0      # continuations on another node after output (lookaside mode)
    trailing: dict[str, str] = field(default_factory=dict)


class MeshClient:
    def __init__(self, target: str, lookaside: bool = False,
                 channel_options: Sequence[tuple[str, object]] = (),
                 tls: ClientTls | None = None, api_key: str = "") -> None:
        """``tls``: TLS to the router and nodes (CA, and a client certificate for mutual
        TLS); None = plaintext. ``api_key``: sent as ``authorization: Bearer KEY`` on every
        call (gpumesh.security.client)."""
        self.target = target
        self.lookaside = lookaside
        self._options = [*CHANNEL_OPTIONS, *channel_options]
        self._tls = tls
        self._interceptors = bearer_interceptors(api_key)
        self._channel = self._open(target)
        self.inference = pb_grpc.InferenceStub(self._channel)
        self.router = cpb_grpc.RouterStub(self._channel)
        self._node_channels: dict[str, grpc.aio.Channel] = {}

    @classmethod
    async def spread(cls, target: str, lookaside: bool = False,
                     channel_options: Sequence[tuple[str, object]] = ()) -> MeshClient:
        """A client whose calls go round-robin over a multi-worker router's processes
        (``spread_target``); the same as ``MeshClient(target)`` for anything else."""
        spread = await spread_target(target)
        opts = [*channel_options, *(SPREAD_OPTIONS if spread != target else ())]
        return cls(spread, lookaside=lookaside, channel_options=opts)

    async def close(self) -> None:
        for ch in self._node_channels.values():
            await ch.close()
        await self._channel.close()

    async def __aenter__(self) -> MeshClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _open(self, target: str) -> grpc.aio.Channel:
        return open_channel(target, self._options, self._tls, self._interceptors)

    def _node_stub(self, address: str) -> pb_grpc.InferenceStub:
        ch = self._node_channels.get(address)
        if ch is None:
            ch = self._node_channels[address] = self._open(address)
        return pb_grpc.InferenceStub(ch)

    async def list_models(self, timeout: float = 10.0) -> pb.ListModelsResponse:
        return await self.inference.ListModels(pb.ListModelsRequest(), timeout=timeout)

    async def fleet(self, timeout: float = 10.0) -> cpb.GetFleetResponse:
        return await self.router.GetFleet(cpb.GetFleetRequest(), timeout=timeout)

    async def generate(self, request: pb.GenerateRequest, timeout: float | None = None,
                       metadata: Sequence[tuple[str, str]] = ()) -> pb.GenerateResponse:
        if not self.lookaside:
            return await self.inference.Generate(request, timeout=timeout, metadata=metadata)
        parts: list[str] = []
        ids: list[int] = []
        last = pb.GenerateStreamResponse()
        rid = ""
        async for chunk in self.stream(request, timeout=timeout, metadata=metadata):
            rid = rid or chunk.request_id
            parts.append(chunk.text)
            ids.extend(chunk.token_ids)
            last = chunk
        return pb.GenerateResponse(text="".join(parts), token_ids=ids,
                                   finish_reason=last.finish_reason, usage=last.usage,
                                   request_id=rid)

    async def stream(self, request: pb.GenerateRequest, timeout: float | None = None,
                     metadata: Sequence[tuple[str, str]] = (),
                     result: StreamResult | None = None
                     ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Yields chunks; ``result`` (optional) receives the serving node and trace id."""
        result = result if result is not None else StreamResult()
        if not self.lookaside:
            call = self.inference.GenerateStream(request, timeout=timeout, metadata=metadata)
            try:
                async for chunk in call:
                    yield chunk
            finally:
                if call.done():
                    _fill(result, await _trailing(call))
                else:
                    call.cancel()  # the caller stopped early: cancel, which aborts in the engine
            return
        async with contextlib.aclosing(self._lookaside(request, timeout, metadata,
                                                       result)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _lookaside(self, request: pb.GenerateRequest, timeout: float | None,
                         metadata: Sequence[tuple[str, str]], result: StreamResult
                         ) -> AsyncGenerator[pb.GenerateStreamResponse, None]:
        """The attempt layers the router runs (``gpumesh.attempts``) over the lookaside
        transport: a node failing before the first token is retried once with a fresh pick;
        after it the stream continues on another node from the tokens delivered
        (``GenerateRequest.resume``), at most ``MAX_MIGRATIONS`` times, unless
        ``request.no_migration``."""
        state = attempts.Attempts(request=None if request.no_migration else request,
                                  progress=StreamProgress())
        transport = _LookasideTransport(self, request, timeout, metadata, result)
        async with contextlib.aclosing(attempts.send(transport, _LookasideFailover(),
                                                     state)) as chunks:
            async for chunk in chunks:
                yield chunk
        result.attempts = state.attempt
        result.migrations = state.progress.migrations if state.progress is not None else 0


class _LookasideCall:
    """One lookaside attempt: the node's stream, called directly with the router's ticket
    (``gpumesh.attempts.NodeCall``)."""

    def __init__(self, node_id: str, call: Any, result: StreamResult) -> None:
        self.node_id = node_id
        self._call = call
        self._result = result

    async def first(self) -> pb.GenerateStreamResponse | None:
        return await self.next()

    async def next(self) -> pb.GenerateStreamResponse | None:
        chunk = await self._call.read()
        if chunk is grpc.aio.EOF:
            _fill(self._result, await _trailing(self._call))
            return None
        return chunk  # type: ignore[no-any-return]

    def close(self, error: Exception | None) -> None:
        self._call.cancel()   # a no-op once it ended; else the node aborts the request


class _LookasideTransport:
    """Lookaside mode's ``gpumesh.attempts.Transport``: the router's ``Pick`` chooses the
    node (``exclude``: those that failed this request), the client calls it with the ticket."""

    streaming = True
    prompt_tokens = 0   # the client does not count the prompt

    def __init__(self, client: MeshClient, request: pb.GenerateRequest, timeout: float | None,
                 metadata: Sequence[tuple[str, str]], result: StreamResult) -> None:
        self._client = client
        self._request = request
        self._timeout = timeout
        self._metadata = metadata
        self._result = result

    async def open(self, request: pb.GenerateRequest | None,
                   exclude: frozenset[str]) -> _LookasideCall:
        current = self._request if request is None else request
        pick = await self._client.router.Pick(
            cpb.PickRequest(request=current, exclude_node_ids=sorted(exclude)),
            timeout=10.0, metadata=self._metadata)
        req = pb.GenerateRequest()
        req.CopyFrom(current)
        req.ticket = pick.ticket
        call = self._client._node_stub(pick.address).GenerateStream(
            req, timeout=self._timeout, metadata=self._metadata)
        return _LookasideCall(pick.node_id, call, self._result)

    def message(self, chunk: pb.GenerateStreamResponse) -> pb.GenerateStreamResponse:
        return chunk

    def encode(self, message: pb.GenerateStreamResponse) -> pb.GenerateStreamResponse:
        return message


class _LookasideFailover:
    """Lookaside mode's ``gpumesh.attempts.Failover``: a node fault (``_NODE_FAULTS``) is
    retried once before output and continued elsewhere ``MAX_MIGRATIONS`` times after it;
    anything else reaches the caller as the node answered it."""

    failures: tuple[type[Exception], ...] = (grpc.aio.AioRpcError,)

    def retry(self, error: Exception, attempt: int, node_id: str) -> bool:
        return _fault(error) and attempt < 2

    def migrate(self, error: Exception, migrations: int, node_id: str,
                delivered_tokens: int) -> bool:
        return _fault(error) and migrations < MAX_MIGRATIONS

    def after_output(self, error: Exception, node_id: str) -> BaseException:
        return error


def _fault(error: Exception) -> bool:
    return isinstance(error, grpc.aio.AioRpcError) and error.code() in _NODE_FAULTS


async def _trailing(call: grpc.aio.Call) -> dict[str, str]:
    try:
        return {k: v for k, v in (await call.trailing_metadata() or ()) if isinstance(v, str)}
    except (grpc.aio.AioRpcError, AttributeError):
        return {}


def _fill(result: StreamResult, trailing: dict[str, str]) -> None:
    result.trailing = trailing
    result.node_id = trailing.get(md.NODE_ID, result.node_id)
    result.trace_id = trailing.get(md.TRACE_ID, result.trace_id)
    if md.ATTEMPTS in trailing:
        result.attempts = int(trailing[md.ATTEMPTS])
