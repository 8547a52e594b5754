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


async def test_reconnects_to_a_restarted_router_at_once() -> None:
    """The first reconnect attempt comes 0.05-0.15 s after the stream broke (jittered back-off
    from 0.1 s), so a router restarted on its port hears from the node right away."""
    plane = RecordingControlPlane()
    addr = await plane.start()
    hb = HeartbeatClient((addr,), registration=lambda: cpb.Registration(node_id="hb-re"),
                         load=lambda: cpb.LoadReport(), busy_interval_s=0.05,
                         idle_interval_s=0.05, max_backoff_s=1.0)
    hb.start()
    again = RecordingControlPlane()
    try:
        while not plane.messages.get("hb-re"):
            await asyncio.sleep(0.01)
        await plane.stop()
        await again.start(plane.port)
        t0 = time.monotonic()
        while not again.messages.get("hb-re"):
            assert time.monotonic() - t0 < 5.0, "the node did not come back"
            await asyncio.sleep(0.005)
        print(f"\nre-registered {time.monotonic() - t0:.3f}s after the router came back")
        assert hb.reconnects >= 1
    finally:
        await hb.close()
        await again.stop()
