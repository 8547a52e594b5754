"""router.fleet.saturation: the scaling signal, table-driven over the pure function, the
tracker's at-limit fraction over an injected clock, and the gauges a real router serves to
Prometheus (names, help text, values) and GetFleet's per-model figures."""

from __future__ import annotations

import asyncio
import math
import time
import urllib.request

import grpc
import pytest

from gpumesh.router.fleet.saturation import (
    NodeDemand,
    SaturationPolicy,
    SaturationTracker,
    model_saturation,
)

P = SaturationPolicy(slo_ttft_s=2.0, target=0.8, default_slots=100, half_life_s=10.0)


def nd(busy=0, slots=100, waiting=0, pending=0, cap=10_000.0) -> NodeDemand:
    return NodeDemand(busy, slots, waiting, pending, cap)


@pytest.mark.parametrize("nodes, queued, util, backlog, sat, wanted", [
    # idle fleet: one node is enough
    ([nd(), nd()], 0, 0.0, 0.0, 0.0, 1),
    # half the slots busy: 2 x 0.5 / 0.8 -> 2 nodes
    ([nd(busy=50), nd(busy=50)], 0, 0.5, 0.0, 0.5, 2),
    # every slot taken plus 40 queued at the router: 240/200 = 1.2 -> ceil(2 x 1.2 / 0.8) = 3
    ([nd(busy=100), nd(busy=100)], 40, 1.2, 0.0, 1.2, 3),
    # few requests but 60k prompt tokens queued on 20k tok/s: 3 s backlog over a 2 s SLO
    ([nd(busy=5, pending=30_000), nd(busy=5, pending=30_000)], 0, 0.05, 3.0, 1.5, 4),
    # load spread over 4 nodes at 10 %: wants 1
    ([nd(busy=10)] * 4, 0, 0.1, 0.0, 0.1, 1),
    # declared limits count: 8 of 10 slots -> 0.8 -> exactly the target, no extra node
    ([nd(busy=8, slots=10)], 0, 0.8, 0.0, 0.8, 1),
    # KV-bound: few slots used but the KV cache 90 % full (weighted by capacity) -> 2 nodes
    ([NodeDemand(10, 100, 0, 0, 1e4, 0.95, 3000), NodeDemand(10, 100, 0, 0, 1e4, 0.8, 1000)],
     0, 0.1, 0.0, 0.9125, 3),
])
def test_model_saturation_table(nodes, queued, util, backlog, sat, wanted):
    s = model_saturation("m", nodes, queued, P)
    assert s.nodes == len(nodes) and s.queued == queued
    assert s.slot_utilization == pytest.approx(util)
    assert s.prefill_backlog_s == pytest.approx(backlog)
    assert s.saturation == pytest.approx(sat)
    assert s.nodes_wanted == wanted


def test_no_nodes_but_a_queue_wants_one_node():
    s = model_saturation("m", [], 3, P)
    assert math.isinf(s.saturation) and s.nodes_wanted == 1 and s.at_limit == 1.0
    assert model_saturation("m", [], 0, P).nodes_wanted == 0


def test_at_limit_most_of_the_time_wants_one_more_node():
    # KV-bound: engines keep requests waiting though the slots are not all taken
    nodes = [nd(busy=40, waiting=5), nd(busy=40, waiting=5)]
    assert model_saturation("m", nodes, 0, P).at_limit == 1.0
    assert model_saturation("m", nodes, 0, P, at_limit_fraction=0.4).nodes_wanted == 1
    assert model_saturation("m", nodes, 0, P, at_limit_fraction=0.6).nodes_wanted == 3


class FakeView:
    """What the tracker reads of a registry NodeView (state and the entry's fields)."""

    def __init__(self, node_id, running, waiting=0, draining=False, max_concurrency=10):
        from types import SimpleNamespace

        from gpumesh.router.scheduling.types import NodeState
        from gpumesh.types import LoadReport, ModelSpec

        self.state = NodeState.DRAINING if draining else NodeState.HEALTHY
        self.router_in_flight = 0
        reg = SimpleNamespace(node_id=node_id, max_concurrency=max_concurrency,
                              models=(ModelSpec("m"),))
        load = LoadReport(num_running=running, num_waiting=waiting, in_flight=running + waiting)
        self.entry = SimpleNamespace(registration=reg, report=SimpleNamespace(load=load))


def test_tracker_weights_the_at_limit_fraction_by_time_and_skips_draining_nodes():
    views = [FakeView("a", 10), FakeView("b", 10), FakeView("c", 10, draining=True)]
    tracker = SaturationTracker(P, lambda: views, lambda m: 0)
    s = tracker.sample(0.0)["m"]
    assert s.nodes == 2 and s.at_limit == 1.0 and s.at_limit_fraction == 1.0
    views[:2] = [FakeView("a", 1), FakeView("b", 1)]
    s = tracker.sample(10.0)["m"]          # one half-life later, no longer at the limit
    assert s.at_limit == 0.0 and s.at_limit_fraction == pytest.approx(0.5)
    s = tracker.sample(30.0)["m"]
    assert s.at_limit_fraction == pytest.approx(0.125)
    assert s.nodes_wanted == 1


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


async def test_router_serves_the_signal_to_prometheus_and_getfleet():
    from gpumesh import telemetry as gt
    from gpumesh.node.app import NodeServer, build_engine
    from gpumesh.node.config import NodeConfig
    from gpumesh.ports import free_port
    from gpumesh.router.app import RouterServer
    from gpumesh.router.config import RouterConfig
    from gpumesh.router.telemetry import RouterTelemetry
    from gpumesh.v1 import control_pb2 as cpb
    from gpumesh.v1 import control_pb2_grpc as cpb_grpc

    port = free_port()
    tel = gt.init(gt.ROUTER_SERVICE, "sat", environ={gt.PROMETHEUS_PORT_ENV: str(port)})
    cfg = RouterConfig(serving={"host": "127.0.0.1", "port": 0, "router_id": "sat"},
                       membership={"lease_ttl_s": 5.0})
    router = RouterServer(cfg, telemetry=None)
    router.telemetry = RouterTelemetry(tel, "sat", router.registry)
    router.telemetry.register_gauges()
    router.telemetry.register_saturation(lambda: router.saturation.latest)
    await router.start()
    ncfg = NodeConfig(engine={"kind": "sim", "served_name": "m"},
                      serving={"port": 0, "node_id": "n1", "max_concurrency": 4},
                      membership={"routers": (router.address,), "heartbeat_idle_interval_s": 0.2})
    node = NodeServer(ncfg, build_engine(ncfg))
    await node.start()
    try:
        deadline = time.monotonic() + 30
        while "m" not in router.saturation.latest:
            assert time.monotonic() < deadline, "no sample for the model"
            await asyncio.sleep(0.05)
        text = await asyncio.to_thread(_scrape, port)
        for name in ("gpumesh_router_model_saturation", "gpumesh_router_model_nodes_wanted",
                     "gpumesh_router_model_slot_utilization",
                     "gpumesh_router_model_at_limit_fraction",
                     "gpumesh_router_model_kv_utilization",
                     "gpumesh_router_model_prefill_backlog_seconds",
                     "gpumesh_router_model_nodes"):
            help_line = next((ln for ln in text.splitlines()
                              if ln.startswith(f"# HELP {name}")), None)
            assert help_line and len(help_line) > len(name) + 20, (name, text[:2000])
            assert any(ln.startswith(name) and 'model="m"' in ln
                       for ln in text.splitlines()), name
        wanted = next(ln for ln in text.splitlines()
                      if ln.startswith("gpumesh_router_model_nodes_wanted") and "{" in ln)
        assert wanted.rsplit(" ", 1)[1] in ("1", "1.0")
        async with grpc.aio.insecure_channel(router.address) as ch:
            fleet = await cpb_grpc.RouterStub(ch).GetFleet(cpb.GetFleetRequest(), timeout=10)
        (m,) = fleet.models
        assert (m.model, m.nodes, m.nodes_wanted) == ("m", 1, 1)
    finally:
        await node.stop(0.2)
        await router.stop(0.2)
