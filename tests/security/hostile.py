"""The three security modes of docs/security.md as real meshes, the credentials an attacker
may hold in each, and a snapshot of every piece of state a stranger must not change.

Modes (one router process and one simulated node "good", API keys in every mode):
- ``token``: plaintext; membership by the join token.
- ``mtls``: TLS with client certificates required on the one port; membership by certificate.
- ``control``: TLS on the public port without required client certificates (clients use API
  keys), and a ``control_port`` where nodes register with their certificates.

Attacker credentials (``Attacker.cred``):
- ``none``: nothing (plaintext, or TLS without a client certificate, on the public port);
- ``bad``: a wrong join token, or a certificate that is not a node's (CN=client, OU=client);
- ``member``: a valid node credential of ANOTHER member (the join token every node shares, or
  the certificate of node "other");
- ``control-none``: (control mode) the control port without a client certificate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from gpumesh.client import MeshClient
from gpumesh.router.auth.keys import hash_key
from gpumesh.security.certs import make_mesh_certs
from gpumesh.security.client import ClientTls
from gpumesh.security.tls import JOIN_TOKEN_HEADER, channel_credentials
from gpumesh.v1 import control_pb2 as cpb
from tests.integration.procs import free_port
from tests.security.mesh import Mesh, mesh

TOKEN = "hostile-suite-join-token"
CLIENT_KEY, OPERATOR_KEY = "suite-client-key", "suite-operator-key"
MODES = ("token", "mtls", "control")
CREDS = ("none", "bad", "member")


def keys_toml() -> str:
    return (f'[[key]]\nname = "client"\nsha256 = "{hash_key(CLIENT_KEY)}"\nrole = "client"\n'
            f'[[key]]\nname = "ops"\nsha256 = "{hash_key(OPERATOR_KEY)}"\nrole = "operator"\n')


@dataclass
class Secured:
    mode: str
    mesh: Mesh
    certs: Path

    def _tls(self, stem: str = "") -> ClientTls:
        d = self.certs
        if not stem:
            return ClientTls(str(d / "ca.pem"))
        return ClientTls(str(d / "ca.pem"), str(d / f"{stem}.pem"), str(d / f"{stem}.key"))

    def operator(self) -> MeshClient:
        """A legitimate operator (reads the fleet)."""
        if self.mode == "token":
            return MeshClient(self.mesh.router_address, api_key=OPERATOR_KEY)
        if self.mode == "control":   # the public port asks for no client certificate
            return MeshClient(self.mesh.router_address, tls=self._tls(), api_key=OPERATOR_KEY)
        return MeshClient(self.mesh.router_address, tls=self._tls("operator"))

    def client(self) -> MeshClient:
        """A legitimate client: the victim's traffic."""
        tls = None if self.mode == "token" else self._tls("client" if self.mode == "mtls" else "")
        return MeshClient(self.mesh.router_address, tls=tls, api_key=CLIENT_KEY)

    def attacker(self, cred: str) -> tuple[grpc.aio.Channel, Sequence[tuple[str, str]]]:
        """A channel to where nodes register, and the metadata, for an attacker holding
        ``cred`` (module docstring)."""
        d, m = self.certs, self.mesh
        if self.mode == "token":
            md = {"none": (), "bad": ((JOIN_TOKEN_HEADER, "wrong-token"),),
                  "member": ((JOIN_TOKEN_HEADER, TOKEN),)}[cred]
            return grpc.aio.insecure_channel(m.router_address), md
        stem = {"none": "", "bad": "client", "member": "other", "control-none": ""}[cred]
        # the public port for "none"; the control port (which asks for a client
        # certificate; the public port does not, in control mode) for the others
        target = m.router_address if cred == "none" else m.node_router
        creds = channel_credentials(str(d / "ca.pem"), *(
            (str(d / f"{stem}.pem"), str(d / f"{stem}.key")) if stem else ()))
        return grpc.aio.secure_channel(target, creds), ()


def expected(mode: str, cred: str, claims_live_id: bool = True) -> grpc.StatusCode:
    """The status a Connect stream of ``cred`` in ``mode`` ends with, whatever it sends
    (credentials are checked before content): a member claiming a live id gets
    ALREADY_EXISTS under the join token (any id is a token holder's to claim) and
    PERMISSION_DENIED under certificates (its certificate names another id)."""
    S = grpc.StatusCode
    if cred == "member":
        if mode == "token":
            return S.ALREADY_EXISTS if claims_live_id else S.OK
        return S.PERMISSION_DENIED
    if mode == "token":
        return S.UNAUTHENTICATED
    if mode == "mtls":
        return S.UNAVAILABLE if cred == "none" else S.PERMISSION_DENIED
    if cred == "control-none":
        return S.UNAVAILABLE
    return S.UNAUTHENTICATED if cred == "none" else S.PERMISSION_DENIED


def _tls_args(d: Path, stem: str) -> list[str]:
    return ["--tls-cert-file", str(d / f"{stem}.pem"), "--tls-key-file", str(d / f"{stem}.key"),
            "--tls-ca-file", str(d / "ca.pem")]


@asynccontextmanager
async def secured_mesh(mode: str, tmp: Path) -> AsyncIterator[Secured]:
    d = tmp / "certs"
    d.mkdir()
    make_mesh_certs(d, node_ids=["good", "other"])
    keys = tmp / "keys.toml"
    keys.write_text(keys_toml())
    router_args = ["--api-keys-file", str(keys), "--membership.quarantine-s", "30"]
    kw: dict = {}
    if mode == "token":
        kw = dict(router_env={"GPUMESH_JOIN_TOKEN": TOKEN},
                  node_toml=f'[security]\njoin_token = "{TOKEN}"\n',
                  client_kwargs={"api_key": OPERATOR_KEY})
    else:
        router_args += _tls_args(d, "router")
        if mode == "mtls":
            router_args.append("--tls-require-client-cert")
        kw = dict(node_args_for=lambda n: _tls_args(d, n),
                  client_kwargs=(
                      {"tls": ClientTls(str(d / "ca.pem")), "api_key": OPERATOR_KEY}
                      if mode == "control" else
                      {"tls": ClientTls(str(d / "ca.pem"), str(d / "operator.pem"),
                                        str(d / "operator.key"))}),
                  control_port=free_port() if mode == "control" else 0)
    async with mesh(tmp, ("good",), router_args=router_args, **kw) as m:
        yield Secured(mode, m, d)


def assert_unchanged(before: tuple, after: tuple) -> None:
    """Fleet entries equal; accounts equal wherever both snapshots carry them (a heartbeat
    may omit a node's accounts)."""
    strip = tuple(n[:-1] for n in before), tuple(n[:-1] for n in after)
    assert strip[0] == strip[1]
    for b, a in zip(before, after, strict=True):
        ba, aa = dict((r, c) for r, *c in b[-1]), dict((r, c) for r, *c in a[-1])
        for router_id in ba.keys() & aa.keys():
            assert ba[router_id] == aa[router_id], (b[0], router_id)


async def state(s: Secured, settle_s: float = 15.0) -> tuple:
    """Everything a stranger must not change, as the router shows it: the fleet (ids,
    addresses, states, models, quarantine entries and reasons) and each node's accounts
    with this router (requests admitted and finished, in flight). Taken once every request
    that was sent has finished and been reported (so two snapshots compare)."""
    deadline = time.monotonic() + settle_s
    await asyncio.sleep(0.5)   # the idle node's next report (heartbeat_idle_interval_s 0.3)
    while True:
        nodes = await _snapshot(s)
        settled = all(n[5] == 0 and all(a == f for _, a, f in n[6]) for n in nodes)
        if settled or time.monotonic() > deadline:
            return nodes
        await asyncio.sleep(0.2)


async def _snapshot(s: Secured) -> tuple:
    async with s.operator() as op:
        fleet = await op.fleet(timeout=30)
    nodes = []
    for n in sorted(fleet.nodes, key=lambda n: n.node_id):
        accounts = tuple(sorted((a.router_id, a.admitted_requests, a.finished_requests)
                                for a in n.load.router_accounts))
        # STALE is HEALTHY with a late report (a loaded test machine), not a change of state
        st = cpb.NODE_STATE_HEALTHY if n.state == cpb.NODE_STATE_STALE else n.state
        nodes.append((n.node_id, n.address, cpb.NodeState.Name(st),
                      tuple(sorted(m.name for m in n.models)), n.quarantine_reason,
                      n.router_in_flight, accounts))
    return tuple(nodes)
