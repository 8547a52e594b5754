"""Router discovery by DNS with real processes: three `gpumesh router` processes on
127.0.0.1, .2 and .3 (one port; all of 127/8 is loopback on Linux) behind one name, and a
`gpumesh node --engine sim --router dns://SERVER/NAME:PORT` process.

The name is served by a small DNS server in this test (real DNS over UDP on loopback, built
with dnspython's message codec, answering A records from a table the test edits), so neither
/etc/hosts nor the machine's resolver is touched. In a cluster the same node setting is
``dns:///gpumesh-router-headless:50050`` and the cluster DNS answers."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import grpc
import pytest

from gpumesh.launcher import stop_all, wait_serving_async, wait_until_async
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc
from tests.integration.procs import Proc

NAME = "gpumesh-router-headless.test"
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
MODEL = "sim-m"


class DnsServer(asyncio.DatagramProtocol):
    """Answers A queries for the names in ``records`` (NXDOMAIN for others, no AAAA)."""

    def __init__(self, records: dict[str, list[str]]) -> None:
        self.records = records
        self.transport: asyncio.DatagramTransport | None = None
        self.queries = 0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:  # type: ignore[override]
        query = dns.message.from_wire(data)
        resp = dns.message.make_response(query)
        for q in query.question:
            self.queries += 1
            name = q.name.to_text().rstrip(".")
            if name not in self.records:
                resp.set_rcode(dns.rcode.NXDOMAIN)
            elif q.rdtype == dns.rdatatype.A and self.records[name]:
                resp.answer.append(dns.rrset.from_text(q.name, 1, "IN", "A",
                                                       *self.records[name]))
        assert self.transport is not None
        self.transport.sendto(resp.to_wire(), addr)


def port_free_on_all_hosts() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for h in HOSTS[1:]:
                with socket.socket() as s:
                    s.bind((h, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every loopback address")


@contextlib.asynccontextmanager
async def dns_server(records: dict[str, list[str]]) -> AsyncIterator[tuple[DnsServer, int]]:
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(lambda: DnsServer(records),
                                                           local_addr=("127.0.0.1", 0))
    try:
        yield proto, transport.get_extra_info("sockname")[1]
    finally:
        transport.close()


async def fleet(address: str) -> cpb.GetFleetResponse:
    async with grpc.aio.insecure_channel(address) as ch:
        return await cpb_grpc.RouterStub(ch).GetFleet(cpb.GetFleetRequest(), timeout=10)


@pytest.mark.slow
async def test_node_heartbeats_to_every_replica_behind_a_name_and_follows_it():
    port = port_free_on_all_hosts()
    routers = {h: f"{h}:{port}" for h in HOSTS}
    records = {NAME: list(HOSTS)}
    procs: list[Proc] = []
    async with dns_server(records) as (server, dns_port):
        try:
            for i, h in enumerate(HOSTS):
                procs.append(Proc(f"router-{i}", [
                    "router", "--host", h, "--port", str(port), "--membership.lease-ttl-s", "10",
                    "--membership.freshness-s", "5"], env={"GPUMESH_ROUTER_SERVING__ROUTER_ID": f"r{i}"}))
            for h, p in zip(HOSTS, procs):
                await wait_serving_async(routers[h], 60, watch=[p])
            node = Proc("dns-node", [
                "node", "--engine", "sim", "--served-name", MODEL, "--port", "0",
                "--node-id", "dn", "--router", f"dns://127.0.0.1:{dns_port}/{NAME}:{port}",
                "--membership.router-resolve-interval-s", "0.5",
                "--membership.heartbeat-idle-interval-s", "0.2"])
            procs.append(node)

            async def registered_with(hosts: tuple[str, ...]) -> bool:
                views = [await fleet(routers[h]) for h in HOSTS]
                want = {f"r{i}" for i, h in enumerate(HOSTS) if h in hosts}
                for h, view in zip(HOSTS, views):
                    ids = [n.node_id for n in view.nodes]
                    if (h in hosts) != (ids == ["dn"]):
                        return False
                    if h in hosts and set(view.nodes[0].router_ids) != want:
                        return False
                return True

            await wait_until_async(lambda: registered_with(HOSTS), 60, watch=procs,
                                   what="node registered with all three routers")
            assert server.queries > 0

            # Requests through each replica: every one counted once, by the router it came
            # through (the node's per-router accounts).
            sent = {"r0": 3, "r1": 5, "r2": 7}
            for i, h in enumerate(HOSTS):
                async with grpc.aio.insecure_channel(routers[h]) as ch:
                    stub = pb_grpc.InferenceStub(ch)
                    await asyncio.gather(*(stub.Generate(pb.GenerateRequest(
                        model=MODEL, text=f"q{k}", sampling=pb.SamplingParams(max_tokens=3)),
                        timeout=30) for k in range(sent[f"r{i}"])))

            async def accounted() -> bool:
                view = await fleet(routers[HOSTS[0]])
                accounts = {a.router_id: a for a in view.nodes[0].load.router_accounts}
                return {r: a.admitted_requests for r, a in accounts.items()} == sent and all(
                    a.finished_requests == sent[r] for r, a in accounts.items())

            await wait_until_async(accounted, 30, watch=procs,
                                   what="per-router accounts equal the requests sent")
            for h in HOSTS:   # each replica holds none of its requests on the node any more
                (n,) = (await fleet(routers[h])).nodes
                assert n.router_in_flight == 0

            # The name loses .3: the node deregisters there and stays with the others.
            records[NAME] = list(HOSTS[:2])
            await wait_until_async(lambda: registered_with(HOSTS[:2]), 30, watch=procs,
                                   what="node left the replica the name no longer lists")
            # ... and comes back when the name lists it again.
            records[NAME] = list(HOSTS)
            await wait_until_async(lambda: registered_with(HOSTS), 30, watch=procs,
                                   what="node back on all three")
        finally:
            stop_all(procs, 15)


@pytest.mark.slow
async def test_discovery_over_tls_verifies_routers_by_the_name(tmp_path):
    """Routers on 127.0.0.2/.3 serve a certificate for the DNS name (and loopback names, not
    those addresses): the node's streams to the discovered addresses verify it against the
    name they came from, and register over mutual TLS on the routers' control port."""
    from gpumesh.security.certs import make_mesh_certs
    from gpumesh.security.client import ClientTls, open_channel

    certs = tmp_path / "certs"
    make_mesh_certs(str(certs), router_id="r", node_ids=["tn"], hosts=[NAME])
    hosts = HOSTS[1:]
    port = port_free_on_all_hosts()
    control = port_free_on_all_hosts()   # nodes use the routers' mutual-TLS control port
    records = {NAME: list(hosts)}
    tls = ["--tls-cert-file", str(certs / "router.pem"), "--tls-key-file",
           str(certs / "router.key"), "--tls-ca-file", str(certs / "ca.pem")]
    operator = ClientTls(str(certs / "ca.pem"), str(certs / "operator.pem"),
                         str(certs / "operator.key"), NAME)

    async def tls_fleet(h: str) -> cpb.GetFleetResponse:
        async with open_channel(f"{h}:{port}", (), operator) as ch:
            return await cpb_grpc.RouterStub(ch).GetFleet(cpb.GetFleetRequest(), timeout=10)

    procs: list[Proc] = []
    async with dns_server(records) as (_, dns_port):
        try:
            for i, h in enumerate(hosts):
                procs.append(Proc(f"tls-router-{i}", [
                    "router", "--host", h, "--port", str(port), "--serving.control-port",
                    str(control), *tls],
                    env={"GPUMESH_ROUTER_SERVING__ROUTER_ID": f"t{i}"}))
            procs.append(Proc("tls-node", [
                "node", "--engine", "sim", "--served-name", MODEL, "--port", "0",
                "--node-id", "tn", "--router", f"dns://127.0.0.1:{dns_port}/{NAME}:{control}",
                "--tls-cert-file", str(certs / "tn.pem"), "--tls-key-file",
                str(certs / "tn.key"), "--tls-ca-file", str(certs / "ca.pem")]))

            async def registered() -> bool:
                views = [await tls_fleet(h) for h in hosts]
                return all([n.node_id for n in v.nodes] == ["tn"]
                           and set(v.nodes[0].router_ids) == {"t0", "t1"} for v in views)

            await wait_until_async(registered, 60, watch=procs,
                                   what="node registered over TLS with both routers")
        finally:
            stop_all(procs, 15)
