"""`gpumesh status --json/--check/--watch`, `gpumesh drain` / `undrain`: the real command line
against two real routers (in-process gRPC servers on loopback) and simulated nodes (real
NodeServers: heartbeats, drain orders, gRPC health)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpumesh.cli import main
from gpumesh.node.app import LIVENESS_SERVICE, NodeServer, build_engine
from gpumesh.node.config import NodeConfig
from gpumesh.router.app import RouterServer
from gpumesh.router.config import RouterConfig
from gpumesh.status import SCHEMA, Exit
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc

MODEL = "sim-m"


async def wait_for(pred: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met in time: {what}")
        await asyncio.sleep(0.02)


@dataclass
class Mesh:
    routers: list[RouterServer]
    nodes: dict[str, NodeServer]

    def view(self, router: int, node_id: str):
        return next((v for v in self.routers[router].registry.fleet()
                     if v.entry.node_id == node_id), None)


@contextlib.asynccontextmanager
async def mesh(policy: str = "") -> AsyncIterator[Mesh]:
    """Two routers and two simulated nodes; ``policy``: the routers' routing policy (their
    default when empty)."""
    routers = []
    for rid in ("ra", "rb"):
        r = RouterServer(RouterConfig(serving={"host": "127.0.0.1", "port": 0, "router_id": rid,
                                               "shutdown_grace_s": 0.5},
                                      membership={"lease_ttl_s": 5.0, "freshness_s": 2.0},
                                      routing={"policy": policy} if policy else {}))
        await r.start()
        routers.append(r)
    nodes: dict[str, NodeServer] = {}
    for nid in ("na", "nb"):
        cfg = NodeConfig(engine={"kind": "sim", "served_name": MODEL, "sim": {"step_a_ms": 20.0}},
                         serving={"port": 0, "node_id": nid, "drain_timeout_s": 5.0},
                         membership={"routers": tuple(r.address for r in routers),
                                     "heartbeat_busy_interval_s": 0.05,
                                     "heartbeat_idle_interval_s": 0.2})
        node = NodeServer(cfg, build_engine(cfg))
        await node.start()
        nodes[nid] = node
    m = Mesh(routers, nodes)
    try:
        await wait_for(lambda: all(
            (v := m.view(i, n)) is not None and v.entry.report is not None
            and len(v.entry.report.router_ids) == 2 for i in range(2) for n in nodes),
            what="both nodes reporting both routers to both routers")
        yield m
    finally:
        for n in nodes.values():
            await n.stop(0.2)
        for r in routers:
            await r.stop(0.2)


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = await asyncio.to_thread(main, list(argv))
    return code, capsys.readouterr().out


async def health(node: NodeServer, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10)
        return resp.status


async def served_by(router: RouterServer, n: int) -> set[str]:
    out = set()
    async with grpc.aio.insecure_channel(router.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        for i in range(n):
            call = stub.Generate(pb.GenerateRequest(
                model=MODEL, text=f"hello {i}", sampling=pb.SamplingParams(max_tokens=2)),
                timeout=30)
            await call
            out.add(dict(await call.trailing_metadata())["x-gpumesh-node-id"])
    return out


async def test_status_json_lists_addresses_routers_and_states(capsys):
    async with mesh() as m:
        code, out = await cli(capsys, "status", "--router", m.routers[0].address, "--json",
                              "--check")
        assert code == Exit.OK
        doc = json.loads(out)
        assert doc["schema"] == SCHEMA and doc["router"]["id"] == "ra"
        assert doc["summary"] == {"nodes": 2, "healthy": 2, "stale": 0, "draining": 0,
                                  "quarantined": 0}
        by_id = {n["node_id"]: n for n in doc["nodes"]}
        for nid, node in m.nodes.items():
            entry = by_id[nid]
            assert entry["address"] == node.address and entry["state"] == "healthy"
            assert entry["state_reason"] == "" and entry["routers"] == ["ra", "rb"]
            assert entry["models"][0]["name"] == MODEL and entry["engine"] == "sim"
            assert 0 <= entry["heartbeat_age_s"] < 5 and entry["load"]["draining"] is False

        code, out = await cli(capsys, "status", "--router", m.routers[1].address)
        assert code == Exit.OK
        lines = out.splitlines()
        assert lines[1].split()[:3] == ["node", "address", "state"]
        assert lines[2].split()[:3] == ["na", m.nodes["na"].address, "healthy"]
        assert lines[2].split()[-2:] == ["2", "-"]   # reports to both routers; no prediction

        code, out = await cli(capsys, "status", "--router", m.routers[0].address, "--json",
                              "--watch", "0.05", "--count", "3")
        docs = [json.loads(line) for line in out.splitlines()]
        assert code == Exit.OK and len(docs) == 3 and all(d["schema"] == SCHEMA for d in docs)


async def test_drain_and_undrain_through_either_router(capsys):
    # round_robin: sequential requests alternate over the routable nodes, so "no request goes
    # to the drained node" and "the undrained node serves again" are both visible (an idle
    # fleet under predicted_latency sends them all to the node predicted fastest)
    async with mesh("round_robin") as m:
        ra, rb = (r.address for r in m.routers)
        assert await served_by(m.routers[0], 4) == {"na", "nb"}
        assert await served_by(m.routers[1], 4) == {"na", "nb"}
        code, out = await cli(capsys, "drain", "na", "--router", ra, "--reason", "kernel update",
                              "--wait", "30")
        assert code == Exit.OK, out
        assert "drain ordered by an operator" in out and "kernel update" in out
        assert "drained" in out
        # the node itself drains: not ready, still alive, and every router sees it
        assert await health(m.nodes["na"]) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await health(m.nodes["na"], LIVENESS_SERVICE) == \
            health_pb2.HealthCheckResponse.SERVING
        na_addr = f"127.0.0.1:{m.nodes['na'].port}"   # what the probes run
        assert (await cli(capsys, "health", na_addr))[0] == 1
        assert (await cli(capsys, "health", na_addr, "--service", "liveness"))[0] == 0
        assert (await cli(capsys, "health", ra, "--service", "liveness"))[0] == 0
        await wait_for(lambda: m.view(1, "na").entry.draining, what="rb sees na draining")
        code, out = await cli(capsys, "status", "--router", rb, "--json", "--check")
        assert code == Exit.NOT_HEALTHY
        na = next(n for n in json.loads(out)["nodes"] if n["node_id"] == "na")
        assert na["state"] == "draining" and na["state_reason"] == "the node reports draining"
        code, out = await cli(capsys, "status", "--router", ra)
        assert "draining na: drain ordered by an operator: kernel update" in out
        assert await served_by(m.routers[0], 4) == {"nb"}
        assert await served_by(m.routers[1], 4) == {"nb"}

        # undrain through the OTHER router: the node serves again, and the router that
        # ordered the drain follows the node's report
        code, out = await cli(capsys, "undrain", "na", "--router", rb)
        assert code == Exit.OK and "undrain" in out
        await wait_for(lambda: not m.view(0, "na").entry.draining
                       and not m.view(1, "na").entry.draining, what="na healthy everywhere")
        assert await health(m.nodes["na"]) == health_pb2.HealthCheckResponse.SERVING
        assert (await cli(capsys, "health", na_addr))[0] == 0
        code, _ = await cli(capsys, "status", "--router", ra, "--check")
        assert code == Exit.OK
        assert await served_by(m.routers[0], 4) == {"na", "nb"}
        assert await served_by(m.routers[1], 4) == {"na", "nb"}


async def test_drain_wait_times_out_while_a_stream_runs(capsys):
    async with mesh() as m:
        ra = m.routers[0].address
        async with grpc.aio.insecure_channel(f"127.0.0.1:{m.nodes['na'].port}") as ch:
            call = pb_grpc.InferenceStub(ch).GenerateStream(pb.GenerateRequest(
                model=MODEL, text="long", sampling=pb.SamplingParams(max_tokens=300,
                                                                     ignore_eos=True)),
                timeout=60)
            await call.read()   # the stream has started on na
            code, _ = await cli(capsys, "drain", "na", "--router", ra, "--wait", "0.3")
            assert code == Exit.DRAIN_TIMEOUT
            while await call.read() is not grpc.aio.EOF:   # a drain lets the stream finish
                pass
            assert await call.code() == grpc.StatusCode.OK
        code, _ = await cli(capsys, "drain", "na", "--router", ra, "--wait", "30")
        assert code == Exit.OK


async def test_exit_codes_for_unknown_node_and_unreachable_router(capsys):
    async with mesh() as m:
        code, _ = await cli(capsys, "drain", "nope", "--router", m.routers[0].address)
        assert code == Exit.NODE_NOT_FOUND
        code, _ = await cli(capsys, "undrain", "nope", "--router", m.routers[0].address)
        assert code == Exit.NODE_NOT_FOUND
    code, _ = await cli(capsys, "status", "--router", "127.0.0.1:1", "--timeout", "2")
    assert code == Exit.ROUTER_ERROR
    code, _ = await cli(capsys, "drain", "na", "--router", "127.0.0.1:1", "--timeout", "2")
    assert code == Exit.ROUTER_ERROR

