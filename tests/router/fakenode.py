"""A small fake gpumesh node for router tests: a real grpc.aio Inference server with a scripted
token generator, and a real ControlPlane.Connect heartbeat client.

Not the product's node (node/servicer.py + node/heartbeat.py replace it in e2e tests): it keeps
just enough of the contract — validation statuses, per-router RouterAccount counters from the
ROUTER_ID / CHARGED_TOKENS metadata, pending prefill tokens, cancellation visible to the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc

from gpumesh import metadata as md
from gpumesh.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class Account:
    admitted_requests: int = 0
    admitted_prompt_tokens: int = 0
    first_token_requests: int = 0
    first_token_prompt_tokens: int = 0
    finished_requests: int = 0


@dataclass
class Seen:
    request_id: str
    model: str
    router_id: str
    charged_tokens: int
    max_tokens: int


@dataclass
class FakeNode(inference_pb2_grpc.InferenceServicer):
    node_id: str
    model: str = "m"
    aliases: tuple[str, ...] = ()
    routers: tuple[str, ...] = ()
    capacity_weight: float = 1.0
    max_concurrency: int = 0
    heartbeat_s: float = 0.05
    prefill_s: float = 0.0
    token_s: float = 0.002
    # "before_first": dies when a request arrives; "after_first": after sending one token.
    fail_mode: str | None = None
    kv_cache_usage: float = 0.0
    draining: bool = False
    # False: heartbeats leave RouterAccount.finished_requests unset (a node from before it).
    reports_finished: bool = True
    # registered as the node's front-end processes' own addresses (node.frontends)
    frontend_addresses: tuple[str, ...] = ()
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    # disaggregated prefill/decode: "prefill" answers a {"do_remote_decode": true} request with
    # parameters naming itself; every request's kv_transfer_params is kept in kv_seen
    role: str = "both"

    def __post_init__(self) -> None:
        self.seen: list[Seen] = []
        self.kv_seen: list[str] = []
        self.cancelled = 0
        self.active = 0
        self.completed = 0
        self.accounts: dict[str, Account] = {}
        self.hellos: list[control_pb2.RouterHello] = []
        self._pending_prefill = 0
        self._server: grpc.aio.Server | None = None
        self._hb_tasks: list[asyncio.Task[None]] = []
        self._seq = itertools.count(1)
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ lifecycle

    async def start(self, port: int = 0) -> FakeNode:
        self._server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        await self._server.start()
        for r in self.routers:
            self._hb_tasks.append(asyncio.get_running_loop().create_task(self._heartbeats(r)))
        return self

    async def kill(self) -> None:
        """Abrupt death: control streams drop, in-flight RPCs are cut."""
        for t in self._hb_tasks:
            t.cancel()
        self._hb_tasks.clear()
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(0)

    async def stop(self) -> None:
        await self.kill()

    # ------------------------------------------------------------------ control plane

    def load_report(self) -> control_pb2.LoadReport:
        return control_pb2.LoadReport(
            num_running=self.active, pending_prefill_tokens=self._pending_prefill,
            kv_cache_usage=self.kv_cache_usage, in_flight=self.active, draining=self.draining,
            prompt_tokens_per_s=0.0,
            router_accounts=[control_pb2.RouterAccount(
                router_id=rid, **{k: v for k, v in vars(a).items()
                                  if self.reports_finished or k != "finished_requests"})
                for rid, a in self.accounts.items()])

    def _registration(self) -> control_pb2.NodeMessage:
        return control_pb2.NodeMessage(registration=control_pb2.Registration(
            node_id=self.node_id, address=self.address, incarnation=self.incarnation,
            engine="fake", max_concurrency=self.max_concurrency, role=self.role,
            frontend_addresses=self.frontend_addresses,
            models=[control_pb2.ServedModel(name=self.model, aliases=self.aliases,
                                            max_context_length=4096,
                                            capacity_weight=self.capacity_weight)]))

    async def _heartbeats(self, router: str) -> None:
        """Connect, register, heartbeat; reconnect quickly when the router goes away."""
        while True:
            try:
                async with grpc.aio.insecure_channel(router) as channel:
                    stub = control_pb2_grpc.ControlPlaneStub(channel)
                    call = stub.Connect()
                    await call.write(self._registration())
                    reader = asyncio.get_running_loop().create_task(self._read(call))
                    try:
                        while not reader.done():
                            await call.write(control_pb2.NodeMessage(heartbeat=control_pb2.Heartbeat(
                                seq=next(self._seq), sent_unix_ms=int(time.time() * 1000),
                                load=self.load_report())))
                            await asyncio.sleep(self.heartbeat_s)
                    finally:
                        reader.cancel()
                        call.cancel()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.debug("control stream to %s ended", router, exc_info=True)
            await asyncio.sleep(0.05)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for msg in call:
                if msg.WhichOneof("kind") == "hello":
                    self.hellos.append(msg.hello)

    # ------------------------------------------------------------------ inference

    async def _validate(self, request: inference_pb2.GenerateRequest,
                        context: grpc.aio.ServicerContext) -> tuple[int, int]:
        if request.model and request.model != self.model and request.model not in self.aliases:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"model {request.model!r} not served; served: {self.model}")
        if request.WhichOneof("prompt") is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        max_tokens = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
        if max_tokens < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1")
        meta = dict(context.invocation_metadata() or ())
        charged = int(meta.get(md.CHARGED_TOKENS, "0"))
        self.seen.append(Seen(request.request_id, request.model, meta.get(md.ROUTER_ID, ""),
                              charged, max_tokens))
        self.kv_seen.append(request.kv_transfer_params)
        return max_tokens, charged

    async def _tokens(self, request: inference_pb2.GenerateRequest, max_tokens: int,
                      charged: int, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        router_id = dict(context.invocation_metadata() or ()).get(md.ROUTER_ID, "")
        acct = self.accounts.setdefault(router_id, Account()) if router_id else Account()
        acct.admitted_requests += 1
        acct.admitted_prompt_tokens += charged
        self.active += 1
        self._pending_prefill += charged
        first = True
        done = False
        try:
            if self.fail_mode == "before_first":
                asyncio.get_running_loop().create_task(self.kill())
                await asyncio.sleep(30)
            await asyncio.sleep(self.prefill_s)
            # a continuation (GenerateRequest.resume) picks up after the tokens delivered
            for i in range(len(request.resume.ids), max_tokens):
                if not first:
                    await asyncio.sleep(self.token_s)
                yield i, f"t{i} "
                if first:
                    first = False
                    self._pending_prefill -= charged
                    acct.first_token_requests += 1
                    acct.first_token_prompt_tokens += charged
                    if self.fail_mode == "after_first":
                        asyncio.get_running_loop().create_task(self.kill())
                        await asyncio.sleep(30)
            self.completed += 1
            done = True
        finally:
            if not done:   # cancelled (CancelledError or generator closed) or killed
                self.cancelled += 1
            if first:
                self._pending_prefill -= charged
            self.active -= 1
            acct.finished_requests += 1

    async def GenerateStream(self, request, context):  # type: ignore[no-untyped-def]
        max_tokens, charged = await self._validate(request, context)
        rid = request.request_id or uuid.uuid4().hex
        n = len(request.resume.ids)
        async for i, text in self._tokens(request, max_tokens, charged, context):
            n += 1
            last = n == max_tokens
            yield inference_pb2.GenerateStreamResponse(
                text=text, token_ids=[i], request_id=rid if i == 0 else "",
                finish_reason=inference_pb2.FINISH_REASON_LENGTH if last else 0,
                usage=inference_pb2.Usage(prompt_tokens=charged, completion_tokens=n)
                if last else None)
        context.set_trailing_metadata(((md.NODE_ID, self.node_id),))

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        max_tokens, charged = await self._validate(request, context)
        parts, ids = [], []
        async for i, text in self._tokens(request, max_tokens, charged, context):
            parts.append(text)
            ids.append(i)
        return inference_pb2.GenerateResponse(
            text="".join(parts), token_ids=ids, finish_reason=inference_pb2.FINISH_REASON_LENGTH,
            usage=inference_pb2.Usage(prompt_tokens=charged, completion_tokens=len(ids)),
            request_id=request.request_id or uuid.uuid4().hex,
            kv_transfer_params=f'{{"remote_engine_id": "{self.node_id}"}}'
            if self.role == "prefill" and request.kv_transfer_params else "")

    async def ListModels(self, request, context):  # type: ignore[no-untyped-def]
        return inference_pb2.ListModelsResponse(models=[inference_pb2.ModelInfo(
            name=self.model, aliases=self.aliases, capacity_weight=self.capacity_weight)])
