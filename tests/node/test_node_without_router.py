"""A node keeps serving direct clients when no router is up, and keeps trying to reach one
(jittered backoff) — then registers as soon as a router appears."""

import asyncio

from gpumesh.client import MeshClient, build_request
from gpumesh.node.app import NodeServer
from gpumesh.node.config import NodeConfig
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig
from tests.integration.procs import RecordingControlPlane, free_port


async def test_serves_without_router_then_registers_when_one_appears():
    cp_port = free_port()
    node = NodeServer(NodeConfig(engine={"kind": "sim"},
                                 serving={"port": 0, "node_id": "lonely"},
                                 membership={"routers": (f"127.0.0.1:{cp_port}",),
                                             "reconnect_max_backoff_s": 0.3}),
                      SimEngine(SimEngineConfig(model_name="sim", time_scale=0)))
    await node.start()
    try:
        async with MeshClient(f"127.0.0.1:{node.port}") as client:
            resp = await client.generate(build_request("alone", max_tokens=4), timeout=10)
        assert resp.usage.completion_tokens == 4
        await asyncio.sleep(1.0)
        assert node.heartbeats.reconnects >= 2  # kept retrying, with backoff
        plane = RecordingControlPlane()
        await plane.start(cp_port)
        try:
            for _ in range(50):
                if plane.heartbeats("lonely"):
                    break
                await asyncio.sleep(0.1)
            assert plane.heartbeats("lonely"), "node never registered with the late router"
        finally:
            await plane.stop()
    finally:
        await node.stop()
