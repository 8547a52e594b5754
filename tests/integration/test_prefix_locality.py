"""Prefix locality end to end over loopback: simulated nodes stream their KV block events to a
real router; its index follows them, is rebuilt from snapshots after a router restart, and a
request sharing a long prefix goes to the node that holds it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from gpumesh import metadata as md
from gpumesh.kvblocks import block_hashes
from gpumesh.node.app import NodeServer
from gpumesh.node.config import NodeConfig
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig
from gpumesh.router.app import RouterServer
from gpumesh.config import nest
from gpumesh.router.config import RouterConfig
from gpumesh.v1 import inference_pb2, inference_pb2_grpc
from tests.integration.procs import free_port

MODEL = "sim"
SYSTEM = "You are the helpful assistant of tenant seven; answer briefly. " * 60


async def wait_for(pred: Callable[[], bool], timeout: float = 30.0) -> float:
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def router_config(port: int, **kw: Any) -> RouterConfig:
    return RouterConfig.build(nest(RouterConfig, {
        "host": "127.0.0.1", "port": port, "router_id": "rt", "heartbeat_interval_ms": 50,
        "shutdown_grace_s": 0.5, **kw}))


@contextlib.asynccontextmanager
async def mesh(n: int = 3, **kw: Any) -> AsyncIterator[tuple[RouterServer, list[NodeServer]]]:
    port = free_port()
    router = RouterServer(router_config(port, **kw))
    await router.start()
    nodes = []
    for i in range(n):
        engine = SimEngine(SimEngineConfig(model_name=MODEL, time_scale=1.0, seed=i))
        node = NodeServer(NodeConfig(engine={"kind": "sim"},
                                     serving={"port": 0, "node_id": f"n{i}"},
                                     membership={"routers": (router.address,),
                                                 "heartbeat_idle_interval_s": 0.2,
                                                 "reconnect_max_backoff_s": 0.2}), engine)
        await node.start()
        nodes.append(node)
    holder: dict[str, RouterServer] = {"router": router}
    try:
        await wait_for(lambda: len(holder["router"].registry) == n)
        yield router, nodes
    finally:
        for node in nodes:
            await node.stop()
        await router.stop(0.2)


async def generate(address: str, text: str) -> str:
    async with grpc.aio.insecure_channel(address) as ch:
        call = inference_pb2_grpc.InferenceStub(ch).Generate(inference_pb2.GenerateRequest(
            model=MODEL, text=text, sampling=inference_pb2.SamplingParams(max_tokens=1)),
            timeout=30)
        await call
        return dict(await call.trailing_metadata())[md.NODE_ID]


def prefix_hashes(text: str) -> list[int]:
    return block_hashes(SimEngine().tokenize(text))


async def test_events_reach_the_index_and_survive_a_router_restart() -> None:
    async with mesh(2) as (router, nodes):
        served = await generate(router.address, SYSTEM + " first question")
        hashes = prefix_hashes(SYSTEM)
        ix = router.locality.indexes.model(MODEL)
        await wait_for(lambda: ix.match(hashes).get(served, 0) >= len(hashes) - 1)
        assert router.locality.indexes.model(MODEL).is_precise(served)
        # Restart the router on the same port: nodes reconnect and send snapshots.
        port = router.port
        await router.stop(0.2)
        again = RouterServer(router_config(port))
        await again.start()
        try:
            await wait_for(lambda: len(again.registry) == 2)
            rebuilt = await wait_for(lambda: again.locality.indexes.model(MODEL).match(
                hashes).get(served, 0) >= len(hashes) - 1)
            assert rebuilt < 5.0   # within a heartbeat of reconnecting (loaded machine: slack)
        finally:
            await again.stop(0.2)


async def test_a_shared_prefix_goes_to_the_node_that_holds_it() -> None:
    async with mesh(3) as (router, nodes):
        # ~3,700-token prompts: the prefill a holder saves outweighs a busy machine's noise in
        # the nodes' measured step times
        tenants = [f"Tenant {t} system prompt: policies, tools and tone. " * 250
                   for t in range(3)]
        first = {}
        for t, system in enumerate(tenants):
            first[t] = await generate(router.address, system + " opening question")
            hashes = prefix_hashes(system)
            ix = router.locality.indexes.model(MODEL)
            await wait_for(lambda h=hashes, n=first[t]: ix.match(h).get(n, 0) >= len(h) - 1)
        for turn in range(3):
            for t, system in enumerate(tenants):
                served = await generate(router.address, system + f" follow-up {turn}")
                assert served == first[t], (t, turn, served, first[t])


async def test_without_events_the_router_approximates() -> None:
    port = free_port()
    router = RouterServer(router_config(port))
    await router.start()
    nodes = []
    try:
        for i in range(3):
            engine = SimEngine(SimEngineConfig(model_name=MODEL, time_scale=1.0, seed=i))
            node = NodeServer(NodeConfig(engine={"kind": "sim"},
                                         serving={"port": 0, "node_id": f"q{i}"},
                                         membership={"routers": (router.address,),
                                                     "kv_events": False}), engine)
            await node.start()
            nodes.append(node)
        await wait_for(lambda: len(router.registry) == 3)
        system = "A long shared preamble for every request of this tenant. " * 80
        holder = await generate(router.address, system + " one")
        ix = router.locality.indexes.model(MODEL)
        assert not ix.is_precise(holder) and ix.node_blocks(holder) > 0
        for k in range(3):
            assert await generate(router.address, system + f" again {k}") == holder
    finally:
        for node in nodes:
            await node.stop()
        await router.stop(0.2)
