"""The node's heartbeat client against a real gRPC control plane on loopback (the recording
test double of the router's control service); the load it reports is set by the test."""

from __future__ import annotations

import asyncio
import time

from gpumesh.v1 import control_pb2 as cpb
from gpumesh.node.heartbeat import HeartbeatClient
from tests.integration.procs import RecordingControlPlane


async def test_a_node_that_goes_idle_says_so_within_a_busy_interval() -> None:
    plane = RecordingControlPlane()
    addr = await plane.start()
    state = {"in_flight": 2}
    hb = HeartbeatClient(
        (addr,), registration=lambda: cpb.Registration(node_id="hb-node"),
        load=lambda: cpb.LoadReport(in_flight=state["in_flight"], num_running=state["in_flight"]),
        busy_interval_s=0.05, idle_interval_s=30.0)
    hb.start()
    try:
        async def beats(pred, timeout: float = 10.0) -> cpb.Heartbeat:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for h in plane.heartbeats("hb-node"):
                    if pred(h):
                        return h
                await asyncio.sleep(0.01)
            raise AssertionError(f"no such heartbeat in {timeout} s: {plane.heartbeats('hb-node')}")

        await beats(lambda h: h.load.in_flight == 2)
        t_idle = time.time()
        state["in_flight"] = 0
        # Sent at the first check after the change (one busy interval), not after the 30 s
        # idle interval: until then routers would count the finished requests as in flight.
        h = await beats(lambda h: h.load.in_flight == 0)
        assert h.sent_unix_ms / 1000 - t_idle < 1.0
        n = len(plane.heartbeats("hb-node"))
        await asyncio.sleep(0.5)
        assert len(plane.heartbeats("hb-node")) == n   # and then quiet: idle pace
    finally:
        await hb.close()
        await plane.stop()
