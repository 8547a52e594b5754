"""Heartbeat and registration input that cannot poison routing, over real processes: a router,
a real simulated node, and a hostile node speaking the control protocol by hand. Each garbage
input gets INVALID_ARGUMENT, the sender is quarantined with a reason GetFleet shows, and the
good node keeps serving every request."""

from __future__ import annotations

import math
import time

import grpc
import pytest

from gpumesh.client import MeshClient
from gpumesh.v1 import control_pb2 as cpb
from tests.integration.procs import free_port
from tests.security.mesh import HostileNode, heartbeat, mesh, registration, served_by, wait_for

pytestmark = pytest.mark.timeout(300) if hasattr(pytest.mark, "timeout") else []


@pytest.fixture(scope="module")
async def one_node(tmp_path_factory):
    async with mesh(tmp_path_factory.mktemp("input"), ("good",),
                    router_args=("--membership.quarantine-s", "60")) as m:
        yield m


BAD_LOADS = [
    {"kv_cache_usage": math.nan},
    {"kv_cache_usage": math.inf},
    {"kv_cache_usage": 1.5},
    {"decode_step_s": math.nan},
    {"decode_step_s": -1.0},
    {"output_tokens_mean": math.nan},
    {"output_tokens_mean": -1.0},
    {"generation_tokens_per_s": math.inf},
    {"prefill_capacity_tokens_per_s": -math.inf},
    {"prefix_cache_hit_rate": -0.1},
    {"pending_prefill_tokens": 2**63},
]


@pytest.mark.parametrize("load", BAD_LOADS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
async def test_garbage_heartbeat_quarantines_the_sender_and_routing_goes_on(one_node, load):
    m = one_node
    hostile_id = f"evil-{free_port()}"
    async with grpc.aio.insecure_channel(m.router_address) as ch, \
            MeshClient(m.router_address) as client:
        evil = HostileNode(ch)
        await evil.send(registration(hostile_id, f"127.0.0.1:{free_port()}"))
        hello = await evil.read()
        assert hello is not None and hello.WhichOneof("kind") == "hello"
        await evil.send(heartbeat(1, **load))
        assert await evil.read() is None
        assert await evil.code() == grpc.StatusCode.INVALID_ARGUMENT
        fleet = await client.fleet(timeout=30)
        q = [n for n in fleet.nodes if n.node_id == hostile_id]
        assert q and q[0].state == cpb.NODE_STATE_QUARANTINED
        assert next(iter(load)) in q[0].quarantine_reason
        # every request still routes, to the good node
        assert await served_by(client, 8) == {"good": 8}
        # and the quarantined id cannot come back meanwhile
        again = HostileNode(ch)
        await again.send(registration(hostile_id, f"127.0.0.1:{free_port()}"))
        assert await again.read() is None
        assert await again.code() == grpc.StatusCode.FAILED_PRECONDITION
        evil.close()
        again.close()
    assert m.alive()


BAD_REGISTRATIONS = {
    "absurd-weight": dict(models=[cpb.ServedModel(name="sim", capacity_weight=1e9)]),
    "nan-weight": dict(models=[cpb.ServedModel(name="sim", capacity_weight=math.nan)]),
    "inf-weight": dict(models=[cpb.ServedModel(name="sim", capacity_weight=math.inf)]),
    "too-many-models": dict(models=[cpb.ServedModel(name=f"m{i}") for i in range(5000)]),
    "duplicate-model": dict(models=[cpb.ServedModel(name="sim")] * 2),
    "long-name": dict(models=[cpb.ServedModel(name="x" * 5000)]),
    "space-in-name": dict(models=[cpb.ServedModel(name="a b")]),
    "too-many-aliases": dict(models=[cpb.ServedModel(name="sim",
                                                     aliases=[f"a{i}" for i in range(500)])]),
    "bad-address": dict(address="not an address"),
    "bad-port": dict(address="127.0.0.1:99999"),
    "non-ascii-id": dict(node_id="n\u00e9\u0000"),
    "dotted-id": dict(node_id="a.b"),
}


@pytest.mark.parametrize("name", list(BAD_REGISTRATIONS))
async def test_garbage_registration_is_refused_and_routing_goes_on(one_node, name):
    m = one_node
    kw = dict(BAD_REGISTRATIONS[name])
    node_id = kw.pop("node_id", f"evil-{name}")
    address = kw.pop("address", f"127.0.0.1:{free_port()}")
    async with grpc.aio.insecure_channel(m.router_address) as ch, \
            MeshClient(m.router_address) as client:
        evil = HostileNode(ch)
        t0 = time.monotonic()
        await evil.send(registration(node_id, address, **kw))
        assert await evil.read() is None
        assert await evil.code() == grpc.StatusCode.INVALID_ARGUMENT
        evil.close()
        fleet = await client.fleet(timeout=30)
        assert {n.node_id for n in fleet.nodes
                if n.state != cpb.NODE_STATE_QUARANTINED} == {"good"}
        assert await served_by(client, 8) == {"good": 8}
        assert time.monotonic() - t0 < 60
    assert m.alive()


async def test_a_huge_registration_does_not_stall_heartbeats(one_node):
    """Registrations with the most models a message can carry, back to back, while the good
    node heartbeats: it is never evicted (lease 3 s) and requests keep routing."""
    m = one_node
    models = [cpb.ServedModel(name=f"model-{i:06d}", aliases=[f"alias-{i:06d}"])
              for i in range(60_000)]
    async with grpc.aio.insecure_channel(
            m.router_address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch, \
            MeshClient(m.router_address) as client:
        for i in range(5):
            evil = HostileNode(ch)
            await evil.send(registration(f"huge-{i}", f"127.0.0.1:{free_port()}", models))
            assert await evil.read() is None
            assert await evil.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                         grpc.StatusCode.RESOURCE_EXHAUSTED)
            evil.close()
        assert await served_by(client, 8) == {"good": 8}
        fleet = await client.fleet(timeout=30)
        good = [n for n in fleet.nodes if n.node_id == "good"]
        assert good and good[0].state == cpb.NODE_STATE_HEALTHY


async def test_a_heartbeat_flood_is_dropped_not_applied(one_node):
    """Heartbeats far beyond the per-node rate: the excess is dropped (fewer acks than sent)
    and the stream stays up."""
    m = one_node
    async with grpc.aio.insecure_channel(m.router_address) as ch:
        evil = HostileNode(ch)
        await evil.send(registration("flooder", f"127.0.0.1:{free_port()}",
                                     [cpb.ServedModel(name="flood-model")]))
        assert (await evil.read()).WhichOneof("kind") == "hello"
        sent = 2000
        for seq in range(1, sent + 1):
            await evil.send(heartbeat(seq))
        await evil.send(cpb.NodeMessage(deregistration=cpb.Deregistration(reason="done")))
        acks = 0
        while (msg := await evil.read()) is not None:
            acks += msg.WhichOneof("kind") == "ack"
        assert await evil.code() == grpc.StatusCode.OK
        assert 0 < acks < sent / 2


def test_status_shows_why_a_node_is_quarantined():
    from gpumesh.status import fleet_table

    fleet = cpb.GetFleetResponse(router_id="r", policy="p", nodes=[cpb.NodeStatus(
        node_id="bad", state=cpb.NODE_STATE_QUARANTINED,
        quarantine_reason="kv_cache_usage is not finite (nan)")])
    table = fleet_table(fleet)
    assert "quarantined" in table and "kv_cache_usage is not finite" in table
