"""A node's prefill capacity and decode step ride its heartbeat into the router's candidates
and GetFleet: a real in-process node (simulated engine) and a real router over loopback."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from gpumesh.v1 import control_pb2, control_pb2_grpc
from gpumesh.node.app import NodeServer
from gpumesh.node.config import NodeConfig
from gpumesh.node.engines.base import EngineRequest, Sampling
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig
from gpumesh.router.app import RouterServer
from gpumesh.router.config import RouterConfig
from gpumesh.router.scheduling.predictor import step_cost


async def test_heartbeat_carries_prefill_capacity_to_the_router_and_get_fleet() -> None:
    router = RouterServer(RouterConfig(serving={"host": "127.0.0.1", "port": 0,
                                                "router_id": "rt", "shutdown_grace_s": 0.5},
                                       membership={"heartbeat_interval_ms": 50}))
    await router.start()
    engine = SimEngine(SimEngineConfig(model_name="sim", time_scale=4.0))
    expected = engine.prefill_capacity_tokens_per_s()
    assert expected == pytest.approx(159_750.0 / 4, rel=1e-3)
    node = NodeServer(NodeConfig(engine={"kind": "sim"},
                                 serving={"port": 0, "node_id": "pc"},
                                 membership={"routers": (router.address,),
                                             "heartbeat_idle_interval_s": 0.1}),
                      engine)
    await node.start()
    try:
        deadline = time.monotonic() + 10
        while True:
            entry = router.registry.entry("pc")
            if entry is not None and entry.report is not None:
                break
            assert time.monotonic() < deadline, "no report reached the router"
            await asyncio.sleep(0.02)
        assert entry.report.load.prefill_capacity_tokens_per_s == pytest.approx(expected)
        (cand,) = router.registry.candidates("sim")
        assert cand.report is not None
        assert cand.report.prefill_capacity_tokens_per_s == pytest.approx(expected)
        # The prediction prefills at it (not at the 8,000 tokens/s default): an idle node that
        # has fitted no step model yet is priced from its measured capacity.
        cost = step_cost(cand, None)
        assert cost.source == "measured" and cost.prefill_s == pytest.approx(1 / expected)
        async with grpc.aio.insecure_channel(router.address) as ch:
            resp = await control_pb2_grpc.RouterStub(ch).GetFleet(
                control_pb2.GetFleetRequest(), timeout=5)
        (shown,) = resp.nodes
        assert shown.load.prefill_capacity_tokens_per_s == pytest.approx(expected)
    finally:
        await node.stop()
        await router.stop(0.2)


async def test_heartbeat_carries_the_decode_step_to_the_router_and_get_fleet() -> None:
    """The node's timed decode step (LoadReport.decode_step_s) is the router's step time."""
    router = RouterServer(RouterConfig(serving={"host": "127.0.0.1", "port": 0,
                                                "router_id": "rt", "shutdown_grace_s": 0.5},
                                       membership={"heartbeat_interval_ms": 50}))
    await router.start()
    # 5 ms simulated steps slowed 4x: 20 ms on the wall clock.
    engine = SimEngine(SimEngineConfig(model_name="sim", time_scale=4.0, step_a_ms=5.0,
                                       step_b_decode_ms=0.0, step_b_prefill_ms=0.0))
    node = NodeServer(NodeConfig(engine={"kind": "sim"},
                                 serving={"port": 0, "node_id": "st"},
                                 membership={"routers": (router.address,),
                                             "heartbeat_idle_interval_s": 0.1}),
                      engine)
    await node.start()
    try:
        async for _ in engine.generate(EngineRequest("r", (1, 2, 3),
                                                     Sampling(max_tokens=8, ignore_eos=True))):
            pass
        deadline = time.monotonic() + 10
        while True:
            entry = router.registry.entry("st")
            if entry is not None and entry.report is not None and entry.report.step_s:
                break
            assert time.monotonic() < deadline, "no timed step reached the router"
            await asyncio.sleep(0.02)
        assert entry.report.load.decode_step_s == pytest.approx(0.020)
        assert entry.report.step_s == pytest.approx(0.020)   # taken as reported
        async with grpc.aio.insecure_channel(router.address) as ch:
            resp = await control_pb2_grpc.RouterStub(ch).GetFleet(
                control_pb2.GetFleetRequest(), timeout=5)
        (shown,) = resp.nodes
        assert shown.load.decode_step_s == pytest.approx(0.020)
    finally:
        await node.stop()
        await router.stop(0.2)
