"""Membership for stock vLLM gRPC workers: each listed worker registered and reported like a
node.

For each worker in ``RouterConfig.membership.foreign_nodes`` a ``ForeignMember`` task does
what a gpumesh node does itself: HealthCheck + GetModelInfo -> ``Registry.register`` (kind
"vllm-grpc", a fresh incarnation per connection), then load reports into ``Registry.heartbeat`` exactly as
heartbeats would be applied:

- pushed: ``SubscribeKvEvents`` (``load_records_before_first_batch``): every batch's
  ``EngineLoad`` record is a report (KV block events themselves are not used);
- polled: ``GetLoads`` every ``poll_interval_s`` whenever no pushed record arrived within that
  interval (a stock worker without ``--kv-events-config`` answers the subscription
  UNIMPLEMENTED; vLLM's Python servicer pushes nothing before its first KV batch).

Each report carries the client's ``account`` as this router's. Any failure ends
the session: the node leaves, and the member reconnects with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs

import grpc
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2 as smg_common

from gpumesh.router.backends.channels import NodeChannels
from gpumesh.router.backends.vllm_grpc.client import ForeignClient
from gpumesh.router.backends.vllm_grpc.load import load_from_record, merge_scheduler_loads
from gpumesh.router.fleet import Registry
from gpumesh.router.tokenizers import RouterTokenizers, Tokenizer
from gpumesh.types import LoadReport, ModelSpec, Registration

log = logging.getLogger(__name__)

KIND = "vllm-grpc"
_stream_ids = itertools.count(1 << 40)   # registry stream ids, apart from Connect streams'


@dataclass(frozen=True)
class ForeignSpec:
    """One foreign worker: ``host:port[?weight=W&node_id=ID&tokenizer=PATH&max_concurrency=N]``."""

    address: str
    node_id: str = ""
    capacity_weight: float = 1.0
    tokenizer: str = ""          # "" -> the worker's GetModelInfo.tokenizer_path
    max_concurrency: int = 0

    @classmethod
    def parse(cls, text: str) -> ForeignSpec:
        address, _, query = text.strip().partition("?")
        q = {k: v[-1] for k, v in parse_qs(query).items()}
        unknown = set(q) - {"weight", "node_id", "tokenizer", "max_concurrency"}
        if not address or ":" not in address or unknown:
            raise ValueError(f"foreign node must be host:port[?weight=&node_id=&tokenizer=&"
                             f"max_concurrency=], got {text!r}")
        return cls(address, q.get("node_id", ""), float(q.get("weight", 1.0)),
                   q.get("tokenizer", ""), int(q.get("max_concurrency", 0)))

    @property
    def resolved_node_id(self) -> str:
        return self.node_id or f"vllm@{self.address}"


@dataclass(slots=True, eq=False)
class ForeignMember:
    """Keeps one foreign worker registered and reported while it answers (module doc).
    ``rpc_timeout_s`` bounds each membership RPC (HealthCheck, GetModelInfo, GetLoads)."""

    spec: ForeignSpec
    registry: Registry
    channels: NodeChannels
    tokenizers: RouterTokenizers
    _: dataclasses.KW_ONLY
    poll_interval_s: float = 0.25
    rpc_timeout_s: float = 5.0
    max_backoff_s: float = 5.0
    node_id: str = field(init=False)
    pushed: int = field(init=False, default=0)   # reports taken from pushed records
    polled: int = field(init=False, default=0)   # reports taken from GetLoads
    _channel: grpc.aio.Channel = field(init=False)
    _stub: vpb_grpc.VllmEngineStub = field(init=False)
    _tokenizer: Tokenizer | None = field(init=False, default=None)
    _stream_id: int = field(init=False, default=0)
    _seq: int = field(init=False, default=0)
    _last_push: float = field(init=False, default=0.0)
    _client: ForeignClient | None = field(init=False, default=None)  # this incarnation

    def __post_init__(self) -> None:
        self.node_id = self.spec.resolved_node_id
        self._channel = grpc.aio.insecure_channel(self.spec.address, options=[
            ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        self._stub = vpb_grpc.VllmEngineStub(self._channel)

    async def run(self) -> None:
        backoff = 0.2
        while True:
            try:
                await self._session()
            except asyncio.CancelledError:
                self._leave("router stopping")
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: leave, back off, retry
                if self._stream_id:
                    log.warning("foreign node %s lost: %s", self.node_id, exc)
                else:
                    log.debug("foreign node %s not reachable yet: %s", self.node_id, exc)
                self._leave(f"{type(exc).__name__}")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
            else:
                backoff = 0.2

    async def close(self) -> None:
        await self._channel.close(None)   # its tokenizer is the router's (closed with it)

    def _leave(self, reason: str) -> None:
        if self._stream_id:
            self.registry.deregister(self.node_id, self._stream_id, reason)
            self._stream_id = 0

    async def _session(self) -> None:
        health = await self._stub.HealthCheck(vpb.HealthCheckRequest(), timeout=self.rpc_timeout_s)
        if not health.healthy:
            raise RuntimeError(f"worker unhealthy: {health.message}")
        info = await self._stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=self.rpc_timeout_s)
        if self._tokenizer is None:
            path = self.spec.tokenizer or info.tokenizer_path or info.model_path
            if not Path(path).exists():
                raise RuntimeError(f"no local tokenizer for {self.node_id} at {path!r}; set "
                                   "tokenizer= in its foreign_nodes entry")
            self._tokenizer = await self.tokenizers.worker_tokenizer(path)
        name = info.served_model_name or info.model_path
        self._stream_id = next(_stream_ids)
        self._seq = 0
        self.registry.register(Registration(
            node_id=self.node_id, address=self.spec.address,
            models=(ModelSpec(name, (), info.max_context_length, 1, self.spec.capacity_weight),),
            incarnation=uuid.uuid4().hex[:16], engine="vllm",
            max_concurrency=self.spec.max_concurrency, kind=KIND), self._stream_id)
        # a fresh incarnation: its account (the worker's ledger) restarts with the client
        self._client = ForeignClient(self.node_id, self.spec.address, self._channel,
                                     self._tokenizer, self.registry.router_id)
        self.channels.adopt(self._client)
        log.info("foreign node %s (%s) joined serving %s", self.node_id, self.spec.address, name)
        sub = asyncio.create_task(self._subscribe())
        try:
            await self._poll_loop(sub)
        finally:
            sub.cancel()
            with contextlib.suppress(BaseException):
                await sub

    def _report(self, load: LoadReport) -> None:
        self._seq += 1
        assert self._client is not None   # (reports follow the registration)
        account = self._client.account
        self.registry.heartbeat(self.node_id, self._stream_id, self._seq,
                                 int(time.time() * 1000),
                                 dataclasses.replace(load, router_accounts=(account,)))

    async def _subscribe(self) -> None:
        """Pushed records while the worker sends them; ends quietly when it cannot."""
        try:
            async for batch in self._stub.SubscribeKvEvents(
                    smg_common.SubscribeKvEventsRequest(load_records_before_first_batch=True)):
                if batch.HasField("load"):
                    self._last_push = time.monotonic()
                    self.pushed += 1
                    self._report(load_from_record(batch.load))
        except grpc.aio.AioRpcError as exc:
            log.info("foreign node %s pushes no load records (%s); polling GetLoads",
                     self.node_id, exc.code().name)

    async def _poll_loop(self, sub: asyncio.Task[None]) -> None:
        while True:
            if time.monotonic() - self._last_push > self.poll_interval_s:
                loads = await self._stub.GetLoads(vpb.GetLoadsRequest(), timeout=self.rpc_timeout_s)
                if loads.loads:
                    self.polled += 1
                    self._report(merge_scheduler_loads(loads.loads))
            await asyncio.sleep(self.poll_interval_s)


class ForeignFleet:
    """Every configured foreign worker's member task (wired by ``router.app``)."""

    def __init__(self, specs: Sequence[str], registry: Registry, channels: NodeChannels,
                 tokenizers: RouterTokenizers, poll_interval_s: float = 0.25) -> None:
        self.members = [ForeignMember(ForeignSpec.parse(s), registry, channels, tokenizers,
                                      poll_interval_s=poll_interval_s) for s in specs]
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(m.run(), name=f"foreign:{m.node_id}")
                       for m in self.members]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(m.close() for m in self.members), return_exceptions=True)
        self._tasks = []
