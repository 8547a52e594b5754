"""KV index truth over a real router's control plane: a simulated node whose prefix cache is
cleared is known at once to hold nothing (a new engine epoch); a node's heartbeat with a newer
epoch drops what the router indexed for it; updates of an older epoch change nothing."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from gpumesh.kvblocks import block_hashes
from gpumesh.node.app import NodeServer
from gpumesh.node.config import NodeConfig
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig
from gpumesh.router.app import RouterServer
from gpumesh.router.config import RouterConfig
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.integration.procs import free_port

MODEL = "sim"
PROMPT = "You are the assistant of tenant nine; answer in one line. " * 40


async def wait_for(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def router() -> AsyncIterator[RouterServer]:
    r = RouterServer(RouterConfig(serving={"host": "127.0.0.1", "port": free_port(),
                                           "router_id": "rt", "shutdown_grace_s": 0.5},
                                  membership={"heartbeat_interval_ms": 50}))
    await r.start()
    try:
        yield r
    finally:
        await r.stop(0.2)


async def test_a_cleared_sim_cache_empties_the_index_at_once() -> None:
    async with router() as r:
        engine = SimEngine(SimEngineConfig(model_name=MODEL, time_scale=1.0))
        node = NodeServer(NodeConfig(engine={"kind": "sim"},
                                     serving={"port": 0, "node_id": "s0"},
                                     membership={"routers": (r.address,),
                                                 "heartbeat_idle_interval_s": 5.0}), engine)
        await node.start()
        try:
            await wait_for(lambda: len(r.registry) == 1)
            async with grpc.aio.insecure_channel(r.address) as ch:
                await inference_pb2_grpc.InferenceStub(ch).Generate(
                    inference_pb2.GenerateRequest(
                        model=MODEL, text=PROMPT,
                        sampling=inference_pb2.SamplingParams(max_tokens=1)), timeout=30)
            hashes = block_hashes(engine.tokenize(PROMPT))
            index = r.locality.indexes.model(MODEL)
            await wait_for(lambda: index.match(hashes).get("s0", 0) >= len(hashes) - 1)
            before = index.epoch("s0")
            assert before > 0
            assert engine.prefix is not None and engine.prefix.clear() > 0   # a reset
            # the heartbeat interval is 5 s and the update batching 50 ms: "at once" means the
            # cleared update, which goes out without waiting
            await wait_for(lambda: index.node_blocks("s0") == 0, 2.0)
            assert index.epoch("s0") > before and not index.match(hashes)
        finally:
            await node.stop()


class RawNode:
    """A node's control stream written by hand, to send what a real node would only send in
    a race (an update of an epoch that already ended)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.queue: asyncio.Queue[cpb.NodeMessage | None] = asyncio.Queue()
        self.seq = 0

    async def _gen(self) -> AsyncIterator[cpb.NodeMessage]:
        while (msg := await self.queue.get()) is not None:
            yield msg

    async def start(self) -> None:
        self.call = control_pb2_grpc.ControlPlaneStub(self.channel).Connect(self._gen())
        await self.queue.put(cpb.NodeMessage(registration=cpb.Registration(
            node_id="raw", address="127.0.0.1:1", incarnation="i1", engine="sim",
            models=[cpb.ServedModel(name=MODEL)])))
        async for msg in self.call:
            if msg.WhichOneof("kind") == "hello":
                return

    async def heartbeat(self, epoch: int) -> None:
        self.seq += 1
        await self.queue.put(cpb.NodeMessage(heartbeat=cpb.Heartbeat(
            seq=self.seq, sent_unix_ms=int(time.time() * 1000),
            load=cpb.LoadReport(engine_epoch=epoch))))

    async def kv(self, **kw: object) -> None:
        await self.queue.put(cpb.NodeMessage(kv_cache=cpb.KvCacheUpdate(
            model=MODEL, block_size=16, **kw)))  # type: ignore[arg-type]

    async def drain(self) -> None:
        """Reads the router's messages until the stream ends (raises its error status)."""
        async for _ in self.call:
            pass

    async def close(self) -> None:
        await self.queue.put(None)
        self.call.cancel()
        await self.channel.close()


async def test_epochs_over_the_control_stream() -> None:
    a = block_hashes(list(range(160)))
    b = block_hashes(list(range(1000, 1160)))
    async with router() as r:
        node = RawNode(r.address)
        await node.start()
        try:
            await node.heartbeat(100)
            await node.kv(seq=1, snapshot=True, stored=a, epoch=100)
            index = r.locality.indexes.model(MODEL)
            await wait_for(lambda: index.match(a).get("raw") == 10)
            # an update of an older epoch (sent before a restart, delivered late): ignored
            await node.kv(seq=2, stored=b, epoch=90)
            await node.kv(seq=2, removed=a[5:], stored=b[:3], epoch=100)   # same epoch: applies
            await wait_for(lambda: index.match(b).get("raw") == 3)
            assert index.match(a)["raw"] == 5 and index.stale_updates == 1
            # a heartbeat with a newer epoch (the engine restarted): everything goes
            await node.heartbeat(200)
            await wait_for(lambda: index.node_blocks("raw") == 0)
            await node.kv(seq=3, cleared=True, stored=b, epoch=200)
            await wait_for(lambda: index.match(b).get("raw") == 10)
            assert not index.match(a)
            # out-of-range epochs are refused where they enter: the stream ends
            await node.kv(seq=4, epoch=2**60)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await asyncio.wait_for(node.drain(), 5)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "epoch" in (exc.value.details() or "")
        finally:
            await node.close()
