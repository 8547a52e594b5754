"""Routing-key affinity and LoRA adapter routing end to end over real gRPC, in one process: a
router and two simulated nodes serving the same model and adapters (the same contract as the
vLLM nodes of test_affinity_vllm, without an engine start)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from gpumesh import metadata as md
from gpumesh.client import MeshClient, build_request
from gpumesh.node.app import NodeServer
from gpumesh.node.config import NodeConfig
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig
from gpumesh.router.app import RouterServer
from gpumesh.router.config import RouterConfig
from gpumesh.v1 import control_pb2 as cpb


@pytest.fixture
async def fleet(tiny_adapters: Path):
    router = RouterServer(RouterConfig(serving={"host": "127.0.0.1", "port": 0,
                                                "shutdown_grace_s": 0.2},
                                       membership={"lease_ttl_s": 3.0, "freshness_s": 1.5}))
    await router.start()
    nodes = []
    try:
        for name in ("sa", "sb"):
            node = NodeServer(
                NodeConfig(engine={"kind": "sim"},
                           serving={"port": 0, "node_id": name},
                           membership={"routers": (router.address,),
                                       "heartbeat_busy_interval_s": 0.05,
                                       "heartbeat_idle_interval_s": 0.1},
                           lora={"adapter_dir": str(tiny_adapters)}),
                SimEngine(SimEngineConfig(model_name="m", time_scale=1.0,
                                          adapter_load_ms=50.0)))
            await node.start()
            nodes.append(node)
        await wait_fleet(router.address, lambda f: len(f.nodes) == 2 and all(
            n.state == cpb.NODE_STATE_HEALTHY for n in f.nodes))
        yield router.address, {n.state.node_id: f"127.0.0.1:{n.port}" for n in nodes}
    finally:
        for n in nodes:
            await n.stop(0.2)
        await router.stop(0.2)


async def wait_fleet(router: str, predicate, timeout_s: float = 30.0) -> cpb.GetFleetResponse:
    deadline = time.monotonic() + timeout_s
    async with MeshClient(router) as c:
        while True:
            f = await c.fleet(timeout=10)
            if predicate(f):
                return f
            assert time.monotonic() < deadline, f"fleet never matched: {f}"
            await asyncio.sleep(0.05)


async def served_by(client: MeshClient, req) -> str:
    call = client.inference.Generate(req, timeout=30)
    await call
    return dict(await call.trailing_metadata() or ())[md.NODE_ID]


async def test_adapter_requests_follow_the_loaded_adapter(fleet) -> None:
    router, addrs = fleet
    for node, adapter in (("sa", "alpha"), ("sb", "beta")):
        async with MeshClient(addrs[node]) as direct:
            await direct.generate(build_request("x", max_tokens=1, adapter=adapter), timeout=30)
    await wait_fleet(router, lambda f: {n.node_id: tuple(n.load.loaded_adapters)
                                        for n in f.nodes} == {"sa": ("alpha",),
                                                              "sb": ("beta",)})
    async with MeshClient(router) as client:
        for _ in range(5):
            assert await served_by(client, build_request("x", max_tokens=2,
                                                         adapter="alpha")) == "sa"
            assert await served_by(client, build_request("x", max_tokens=2,
                                                         adapter="beta")) == "sb"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.generate(build_request("x", max_tokens=1, adapter="gamma"), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_routing_key_sticks_while_even_and_follows_the_prediction_under_load(fleet
                                                                                  ) -> None:
    router, _ = fleet
    async with MeshClient(router) as client:
        # an evenly loaded fleet: each key keeps its node (ties go to the session's node).
        # Each request waits for reports that show the fleet idle again: a report sent while
        # the previous request still waited would charge its node for a queue it no longer has.
        for key in ("k1", "k2", "k3"):
            nodes = set()
            for _ in range(4):
                nodes.add(await served_by(client, build_request("x", max_tokens=2,
                                                                routing_key=key)))
                await wait_fleet(router, lambda f: all(
                    n.load.num_running + n.load.num_waiting == 0 for n in f.nodes))
            assert len(nodes) == 1, (key, nodes)
        # a key is an expected hit, not a bound: a one-token prompt has nothing to reuse, so
        # while its node runs a long stream the next request of the key is predicted to start
        # sooner on the idle node, and goes there. Up to three keys: the second decision reads
        # the heartbeat reports of two simulated nodes on a shared machine, and one taken in
        # the wrong instant can still show the busy node as idle.
        placed = []
        for key in ("hot0", "hot1", "hot2"):
            calls = []
            try:
                for _ in range(2):
                    call = client.inference.GenerateStream(build_request(
                        "x", max_tokens=5000, ignore_eos=True, routing_key=key), timeout=60)
                    await call.read()
                    calls.append(call)
                    f = await client.fleet(timeout=10)
                    for _ in range(100):   # the stream in its node's report
                        if sum(n.load.num_running for n in f.nodes) >= len(calls):
                            break
                        await asyncio.sleep(0.05)
                        f = await client.fleet(timeout=10)
                placed.append(sorted(n.router_in_flight for n in f.nodes))
            finally:
                for call in calls:
                    call.cancel()
            if placed[-1] == [1, 1]:
                break
            await asyncio.sleep(0.5)   # the cancelled streams leave the nodes
        assert placed[-1] == [1, 1], placed
