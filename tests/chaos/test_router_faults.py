"""Router restarts, a stalled control stream and overload, under load."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from gpumesh.launcher import wait_serving_async
from gpumesh_bench.reliability.faultmesh import MODEL, Tally, client_channel, closed_loop
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.chaos]


async def _load(mesh, tally, stop, **kw):
    return asyncio.create_task(closed_loop(mesh.router_addresses, tally, stop, **kw))


async def test_control_stream_partition_loses_nothing(make_mesh):
    """Node 0's heartbeats stall in a proxy (its TCP stays open) past the lease: it goes
    STALE (no new work), then leaves the fleet; its streams, still moving on the data plane,
    finish where they are; once the proxy flows again it is back."""
    mesh = await make_mesh(nodes=3, proxied_control=True)
    tally, stop = Tally(), asyncio.Event()
    load = await _load(mesh, tally, stop, concurrency=12)
    await asyncio.sleep(1.5)
    mesh.proxies[0].stall()
    await asyncio.sleep(4.0)     # > lease_ttl_s (3 s)
    gone = "n0" not in {v.node_id for v in await mesh.fleet()}
    mesh.proxies[0].resume()
    await mesh.wait_fleet(3, 20)
    stop.set()
    await asyncio.wait_for(load, 60)
    print(f"\n{tally.line('control stream partitioned 4 s')} node left the fleet: {gone}")
    assert tally.lost == 0 and tally.incomplete == 0


async def test_router_kill_and_restart_never_not_found(make_mesh):
    """SIGKILL of the only router under load, restarted on its port 0.5 s later: streams on
    it are cut (no router, no stream), but no request gets NOT_FOUND, and the first request
    succeeds soon after the restart (nodes reconnect within 250 ms, clients retry
    UNAVAILABLE with the router's retry hint)."""
    mesh = await make_mesh(nodes=3)
    tally, stop = Tally(), asyncio.Event()
    load = await _load(mesh, tally, stop, concurrency=8)
    await asyncio.sleep(1.5)
    mesh.signal_router(0, signal.SIGKILL)
    mesh.routers[0].popen.wait(10)
    await asyncio.sleep(0.5)
    t_restart = time.monotonic()
    mesh.start_router(0)
    await wait_serving_async(mesh.router_addresses[0], 30, watch=[mesh.routers[0]], poll_s=0.01)
    t_up = time.monotonic()
    # fresh clients from the moment the router serves: their first success is the recovery
    tally_after, stop_after = Tally(), asyncio.Event()
    after = await _load(mesh, tally_after, stop_after, concurrency=4, stagger_s=0.0)
    await asyncio.sleep(3.0)
    stop.set()
    stop_after.set()
    await asyncio.wait_for(asyncio.gather(load, after), 60)
    first = (tally_after.first_output_at or float("inf")) - t_up
    print(f"\n{tally.line('router SIGKILL + restart (clients across it)')}")
    print(f"{tally_after.line('clients from the restarted router serving')} first token of "
          f"a successful request {first:.3f}s after it serves ({t_up - t_restart:.2f}s "
          f"process start)")
    for t in (tally, tally_after):
        assert "NOT_FOUND" not in t.failed
    assert tally_after.lost == 0
    assert first < 30


async def test_replica_restart_loses_nothing(make_mesh):
    """Two routers behind one client target: one stops gracefully (SIGTERM: refuses new
    work, drains its streams) and comes back; no request is lost."""
    mesh = await make_mesh(nodes=3, routers=2)
    tally, stop = Tally(), asyncio.Event()
    load = await _load(mesh, tally, stop, concurrency=12)
    await asyncio.sleep(1.5)
    mesh.signal_router(0, signal.SIGTERM)
    mesh.routers[0].popen.wait(30)
    mesh.start_router(0)
    await mesh.wait_fleet(3, 30, router=0)
    await asyncio.sleep(1.5)
    stop.set()
    await asyncio.wait_for(load, 60)
    print(f"\n{tally.line('replica restart (2 routers)')}")
    assert tally.lost == 0 and tally.incomplete == 0


async def test_repeated_replica_stops_lose_nothing(make_mesh):
    """Two routers behind one round-robin client target, each stopped gracefully (SIGTERM)
    three times in turn under a dense load of short streams, and restarted. The stopping
    router refuses new work with UNAVAILABLE while it drains; calls that reach it in the
    instant its gRPC server stops are reset with CANCELLED before any output, and the
    client's retry policy must send those to the other router too: nothing is lost. Each
    stop waits, as a rolling restart's readiness delay does, until the client's channel has
    reconnected to the router restarted before it (its reconnect backoff is at most 1 s, +20 %
    jitter): a client with no router to reach in that instant fails its call, UNAVAILABLE."""
    mesh = await make_mesh(nodes=2, routers=2, time_scale=5.0)
    tally, stop = Tally(), asyncio.Event()
    # many short streams: many calls arrive at a stopping router around its server.stop
    load = await _load(mesh, tally, stop, concurrency=64, max_tokens=4, stagger_s=0.3)
    await asyncio.sleep(1.0)
    for k in range(6):
        i = k % 2
        mesh.signal_router(i, signal.SIGTERM)
        assert await asyncio.to_thread(mesh.routers[i].popen.wait, 30) == 0
        mesh.start_router(i)
        await mesh.wait_fleet(2, 30, router=i, watch=False)
        await asyncio.sleep(1.5)
    stop.set()
    await asyncio.wait_for(load, 60)
    print(f"\n{tally.line('6 graceful router stops (2 routers)')} examples={tally.examples}")
    assert tally.succeeded > 0
    assert tally.lost == 0 and tally.incomplete == 0, tally.examples


async def test_overload_sheds_with_resource_exhausted_and_recovers(make_mesh):
    """3x what the fleet admits (2 nodes x 4 concurrent, queue 4): the excess is refused at
    once with RESOURCE_EXHAUSTED (not lost), admitted requests complete, and the fleet
    serves normally right after."""
    mesh = await make_mesh(nodes=2, max_concurrency=4, router_flags=["--dispatch.queue-bound", "4"])
    tally, stop = Tally(), asyncio.Event()
    load = await _load(mesh, tally, stop, concurrency=36, stagger_s=0.2, think_s=0.05)
    await asyncio.sleep(4.0)
    stop.set()
    await asyncio.wait_for(load, 60)
    print(f"\n{tally.line('3x overload')}")
    assert tally.lost == 0 and tally.incomplete == 0
    assert tally.failed.get("RESOURCE_EXHAUSTED", 0) > 0
    t0 = time.monotonic()
    async with client_channel(mesh.router_addresses) as ch:
        req = pb.GenerateRequest(model=MODEL, text="after the storm")
        req.sampling.max_tokens = 4
        await pb_grpc.InferenceStub(ch).Generate(req, timeout=10)
    print(f"first request after the overload served in {time.monotonic() - t0:.3f}s")


async def test_fresh_router_answers_unavailable_not_not_found(make_mesh):
    """A router that just started and knows no node: UNAVAILABLE with a retry hint."""
    mesh = await make_mesh(nodes=0)
    async with grpc.aio.insecure_channel(mesh.router_addresses[0]) as ch:
        req = pb.GenerateRequest(model=MODEL, text="hello")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_grpc.InferenceStub(ch).Generate(req, timeout=5)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "grpc-retry-pushback-ms" in dict(e.value.trailing_metadata() or ())
