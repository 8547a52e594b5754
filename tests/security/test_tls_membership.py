"""TLS on every hop and authenticated membership, over real processes: a router and
simulated nodes with certificates from ``gpumesh certs``, a client over TLS, and hostile
nodes (an impostor with another node's id, a client certificate, a foreign CA, an expired
certificate, a second stream for a live id). Each gets its status, never joins the fleet,
and every request keeps going to the real node."""

from __future__ import annotations

import datetime as dt
import urllib.request

import grpc
import pytest

from gpumesh.client import MeshClient, build_request
from gpumesh.security.certs import issue, make_mesh_certs
from gpumesh.security.client import ClientTls
from gpumesh.security.tls import channel_credentials
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc
from gpumesh.v1 import inference_pb2_grpc as pb_grpc
from tests.integration.procs import free_port
from tests.security.mesh import HostileNode, mesh, registration, served_by, wait_for


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    make_mesh_certs(d, node_ids=["good", "other"])
    # an expired node certificate of the same CA, and a whole foreign CA
    issue(d, "node-expired", "expired", "node",
          not_before=dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=10), days=1)
    foreign = tmp_path_factory.mktemp("foreign")
    make_mesh_certs(foreign, node_ids=["good"])
    return d, foreign


def _tls_args(d, stem):
    return ["--tls-cert-file", str(d / f"{stem}.pem"), "--tls-key-file", str(d / f"{stem}.key"),
            "--tls-ca-file", str(d / "ca.pem")]


@pytest.fixture(scope="module")
async def tls_mesh(certs, tmp_path_factory):
    d, _ = certs
    prom = free_port()
    async with mesh(tmp_path_factory.mktemp("tls"), ("good",),
                    router_args=[*_tls_args(d, "router"), "--tls-require-client-cert"],
                    router_env={"GPUMESH_PROMETHEUS_PORT": str(prom)},
                    node_args_for=lambda n: _tls_args(d, n),
                    client_kwargs={"tls": ClientTls(str(d / "ca.pem"), str(d / "operator.pem"),
                                                    str(d / "operator.key"))}) as m:
        m.prom = prom
        yield m, d


def _client_tls(d, stem="client"):
    return ClientTls(str(d / "ca.pem"), str(d / f"{stem}.pem"), str(d / f"{stem}.key"))


def _node_channel(address, d, stem):
    return grpc.aio.secure_channel(address, channel_credentials(
        str(d / "ca.pem"), str(d / f"{stem}.pem"), str(d / f"{stem}.key")))


async def test_requests_route_over_tls_end_to_end(tls_mesh):
    m, d = tls_mesh
    async with MeshClient(m.router_address, tls=_client_tls(d)) as client:
        assert await served_by(client, 6) == {"good": 6}
    # plaintext to a TLS port fails at the transport, before any servicer
    async with MeshClient(m.router_address) as plain:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await plain.list_models(timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # and without a client certificate (the router requires one)
    async with MeshClient(m.router_address, tls=ClientTls(str(d / "ca.pem"))) as anon:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await anon.list_models(timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("stem,claimed,code", [
    ("other", "good", grpc.StatusCode.PERMISSION_DENIED),     # impostor: another's id
    ("client", "client", grpc.StatusCode.PERMISSION_DENIED),       # not a node certificate
    ("good", "good", grpc.StatusCode.ALREADY_EXISTS),         # id held by a live stream
])
async def test_hostile_registrations_are_refused(tls_mesh, stem, claimed, code):
    m, d = tls_mesh
    async with _node_channel(m.router_address, d, stem) as ch, \
            MeshClient(m.router_address, tls=_client_tls(d, "operator")) as client:
        evil = HostileNode(ch)
        await evil.send(registration(claimed, f"127.0.0.1:{free_port()}"))
        assert await evil.read() is None
        assert await evil.code() == code
        evil.close()
        fleet = await client.fleet(timeout=30)
        assert [(n.node_id, n.state) for n in fleet.nodes] == [("good", cpb.NODE_STATE_HEALTHY)]
        good = fleet.nodes[0]
        assert good.address == m.nodes["good"][1]
        assert await served_by(client, 6) == {"good": 6}


@pytest.mark.parametrize("which", ["foreign-ca", "expired"])
async def test_foreign_or_expired_certificates_fail_the_handshake(tls_mesh, certs, which):
    m, d = tls_mesh
    _, foreign = certs
    creds = (channel_credentials(str(d / "ca.pem"), str(foreign / "good.pem"),
                                 str(foreign / "good.key")) if which == "foreign-ca"
             else channel_credentials(str(d / "ca.pem"), str(d / "node-expired.pem"),
                                      str(d / "node-expired.key")))
    async with grpc.aio.secure_channel(m.router_address, creds) as ch, \
            MeshClient(m.router_address, tls=_client_tls(d, "operator")) as client:
        evil = HostileNode(ch)
        await evil.send(registration("good" if which == "foreign-ca" else "expired",
                                     f"127.0.0.1:{free_port()}"))
        assert await evil.read() is None
        assert await evil.code() == grpc.StatusCode.UNAVAILABLE
        evil.close()
        assert {n.node_id for n in (await client.fleet(timeout=30)).nodes} == {"good"}


async def test_operator_api_needs_an_operator_certificate(tls_mesh):
    m, d = tls_mesh
    async with MeshClient(m.router_address, tls=_client_tls(d, "client")) as client:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.fleet(timeout=30)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with MeshClient(m.router_address, tls=_client_tls(d, "operator")) as op:
        assert [n.node_id for n in (await op.fleet(timeout=30)).nodes] == ["good"]


async def test_rejections_are_counted_in_a_metric(tls_mesh):
    m, d = tls_mesh
    async with _node_channel(m.router_address, d, "other") as ch:
        evil = HostileNode(ch)
        await evil.send(registration("good", f"127.0.0.1:{free_port()}"))
        await evil.code()
        evil.close()

    async def scraped() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{m.prom}/metrics", timeout=5) as r:
            text = r.read().decode()
        return text if "auth_rejections" in text and 'kind="node"' in text else ""

    text = await wait_for(scraped, 60, "auth rejection metric")
    assert 'status="PERMISSION_DENIED"' in text


async def test_certificates_are_reloaded_without_a_restart(tls_mesh, certs):
    """A router certificate issued again with one more name: new connections that verify
    that name succeed once the files change, with no restart."""
    m, d = tls_mesh
    opts = [("grpc.ssl_target_name_override", "rotated.example")]
    creds = channel_credentials(str(d / "ca.pem"), str(d / "operator.pem"),
                                str(d / "operator.key"))

    async def fleet_ok() -> bool:
        async with grpc.aio.secure_channel(m.router_address, creds, options=opts) as ch:
            try:
                await cpb_grpc.RouterStub(ch).GetFleet(cpb.GetFleetRequest(), timeout=5)
                return True
            except grpc.aio.AioRpcError:
                return False

    assert not await fleet_ok()
    issue(d, "router", "router", "router", hosts=["rotated.example"])
    await wait_for(fleet_ok, 30, "the rotated certificate in use")
    assert m.alive()


@pytest.fixture(scope="module")
async def router_only_mesh(certs, tmp_path_factory):
    d, _ = certs
    secret = "router-only-secret"
    async with mesh(tmp_path_factory.mktemp("ronly"), ("good",),
                    router_args=[*_tls_args(d, "router"), "--tls-require-client-cert"],
                    router_env={"GPUMESH_TICKET_SECRET": secret},
                    node_toml=f'[security]\nticket_secret = "{secret}"\nrouter_only = true\n'
                              'tls_require_client_cert = true\n',
                    node_args_for=lambda n: _tls_args(d, n),
                    client_kwargs={"tls": _client_tls(d, "operator")}) as m:
        yield m, d


async def test_router_only_node_refuses_direct_and_forged_calls(router_only_mesh):
    """A direct call with a valid client certificate, even with a forged router id, is
    PERMISSION_DENIED; calls through the router (its certificate) and lookaside calls with
    the router's ticket are served."""
    m, d = router_only_mesh
    node_addr = m.nodes["good"][1]
    req = build_request("hello", model="sim", max_tokens=4)
    async with _node_channel(node_addr, d, "client") as ch:
        stub = pb_grpc.InferenceStub(ch)
        for md in ((), (("x-gpumesh-router-id", "router-forged"),)):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(req, timeout=30, metadata=md)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with MeshClient(m.router_address, tls=_client_tls(d)) as client:
        assert await served_by(client, 4) == {"good": 4}
    async with MeshClient(m.router_address, lookaside=True, tls=_client_tls(d, "operator")) as la:
        resp = await la.generate(req, timeout=30)
        assert resp.usage.completion_tokens >= 1
