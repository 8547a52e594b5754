"""Membership by join token (TLS off) and the plaintext binding rule, over real processes."""

from __future__ import annotations

import time

import grpc
import pytest

from gpumesh.client import MeshClient
from gpumesh.security.tls import JOIN_TOKEN_HEADER
from gpumesh.v1 import control_pb2 as cpb
from tests.integration.procs import Proc, free_port, node_proc
from tests.security.mesh import HostileNode, mesh, registration, served_by

TOKEN = "join-token-for-tests"


@pytest.fixture(scope="module")
async def token_mesh(tmp_path_factory):
    async with mesh(tmp_path_factory.mktemp("token"), ("good",),
                    router_env={"GPUMESH_JOIN_TOKEN": TOKEN},
                    node_toml=f'[security]\njoin_token = "{TOKEN}"\n') as m:
        yield m




@pytest.mark.parametrize("metadata,code", [
    ((), grpc.StatusCode.UNAUTHENTICATED),
    (((JOIN_TOKEN_HEADER, "wrong"),), grpc.StatusCode.UNAUTHENTICATED),
    (((JOIN_TOKEN_HEADER, TOKEN),), grpc.StatusCode.ALREADY_EXISTS),   # the id is live
])
async def test_join_token_membership(token_mesh, metadata, code):
    m = token_mesh
    async with grpc.aio.insecure_channel(m.router_address) as ch, \
            MeshClient(m.router_address) as client:
        evil = HostileNode(ch, metadata)
        await evil.send(registration("good", f"127.0.0.1:{free_port()}"))
        assert await evil.read() is None
        assert await evil.code() == code
        evil.close()
        fleet = await client.fleet(timeout=30)
        assert [(n.node_id, n.address) for n in fleet.nodes] == [("good", m.nodes["good"][1])]
        assert await served_by(client, 6) == {"good": 6}


async def test_a_node_with_the_token_joins(token_mesh):
    m = token_mesh
    async with grpc.aio.insecure_channel(m.router_address) as ch:
        ok = HostileNode(ch, ((JOIN_TOKEN_HEADER, TOKEN),))
        await ok.send(registration("newcomer", f"127.0.0.1:{free_port()}",
                                   [cpb.ServedModel(name="other-model")]))
        hello = await ok.read()
        assert hello is not None and hello.WhichOneof("kind") == "hello"
        ok.close()


def _wait_exit(p: Proc, timeout_s: float = 60.0) -> int | None:
    deadline = time.monotonic() + timeout_s
    while p.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    return p.returncode


@pytest.mark.parametrize("role", ["router", "node"])
def test_plaintext_on_a_non_loopback_address_refuses_to_start(role):
    port = free_port()
    if role == "router":
        p = Proc("router-bind", ["router", "--host", "0.0.0.0", "--port", str(port)])
    else:
        p = node_proc("node-bind", port, [], engine="sim", model="sim",
                      extra=["--host", "0.0.0.0"])
    try:
        assert _wait_exit(p) not in (None, 0)
        assert "refusing to serve plaintext" in p.log()
    finally:
        p.close()


def test_insecure_allows_it_and_says_so():
    port = free_port()
    p = Proc("router-insecure", ["router", "--host", "0.0.0.0", "--port", str(port),
                                 "--insecure"])
    try:
        deadline = time.monotonic() + 60
        while "listening on" not in p.log() and time.monotonic() < deadline:
            assert p.alive(), p.log()
            time.sleep(0.2)
        assert "PLAINTEXT" in p.log() and p.alive()
    finally:
        p.close()


async def test_heartbeats_and_deregistration_only_on_the_registering_stream(token_mesh):
    """A stream that did not register the node can neither report for it nor remove it."""
    from tests.security.mesh import heartbeat

    m = token_mesh
    async with grpc.aio.insecure_channel(m.router_address) as ch, \
            MeshClient(m.router_address) as client:
        hb = HostileNode(ch, ((JOIN_TOKEN_HEADER, TOKEN),))
        await hb.send(heartbeat(10**6, draining=True, kv_cache_usage=0.99))
        assert await hb.read() is None
        assert await hb.code() == grpc.StatusCode.FAILED_PRECONDITION
        hb.close()
        bye = HostileNode(ch, ((JOIN_TOKEN_HEADER, TOKEN),))
        await bye.send(cpb.NodeMessage(deregistration=cpb.Deregistration(reason="hijack")))
        assert await bye.read() is None
        bye.close()
        fleet = await client.fleet(timeout=30)
        good = [n for n in fleet.nodes if n.node_id == "good"]
        assert good and good[0].state == cpb.NODE_STATE_HEALTHY
        assert await served_by(client, 4) == {"good": 4}
