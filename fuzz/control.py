"""The ``control`` fuzz target: a Connect stream's messages, in any order and from any kind
of caller, through the router's real ControlPlane servicer (membership, validation,
registry, quarantine, prefix-cache index), in-process.

Input: the first byte picks the caller (``CALLERS``: open membership; the right or a wrong
join token; a node certificate for "n1", a client certificate, or none with TLS on); the rest
is length-prefixed NodeMessages (2-byte big-endian length), as the ``ingest`` target.

Properties, for any input:
- the stream ends normally or with a specific status, never INTERNAL or UNKNOWN, and no other
  exception escapes the servicer;
- a caller without valid credentials ends with UNAUTHENTICATED or PERMISSION_DENIED and
  changes nothing: empty fleet, empty quarantine, nothing written to it;
- a certificate holder only ever registers or quarantines its own id;
- every candidate the fleet would be scored from has finite numbers.

``ScriptedContext`` plays gRPC's side of one call (the messages the caller sent, its
credentials); everything it drives is the router's real code.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from gpumesh.router.api.control import RouterControlPlaneServicer
from gpumesh.router.config import RouterConfig
from gpumesh.router.fleet import Registry
from gpumesh.router.fleet.locality import PrefixLocality
from gpumesh.router.fleet.prefix_index import PrefixIndexes
from gpumesh.router.fleet.quarantine import Quarantine
from gpumesh.security.tls import JOIN_TOKEN_HEADER
from gpumesh.v1 import control_pb2 as cpb
from tests.clock import ManualClock

TOKEN = "fuzz-token"
# (name, router has TLS, router's join token, caller's metadata, caller's certificate stem)
CALLERS = (
    ("open", False, "", (), ""),
    ("token", False, TOKEN, ((JOIN_TOKEN_HEADER, TOKEN),), ""),
    ("wrong-token", False, TOKEN, ((JOIN_TOKEN_HEADER, "nope"),), ""),
    ("node-cert", True, "", (), "n1"),
    ("client-cert", True, "", (), "client"),
    ("no-cert", True, "", (), ""),
)
STRANGERS = {"wrong-token", "client-cert", "no-cert"}
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


@lru_cache(maxsize=1)
def _pems() -> dict[str, bytes]:
    from gpumesh.security.certs import make_mesh_certs

    d = Path(tempfile.mkdtemp(prefix="gpumesh-fuzz-certs-"))
    make_mesh_certs(d, node_ids=["n1"])
    return {stem: (d / f"{stem}.pem").read_bytes() for stem in ("n1", "client")}


class ScriptedContext:
    """gRPC's side of one Connect call: ``read`` hands out the caller's messages then EOF."""

    def __init__(self, messages: Sequence[cpb.NodeMessage],
                 metadata: Sequence[tuple[str, str]], cert: bytes,
                 on_read: Callable[[], None] = lambda: None) -> None:
        self._on_read = on_read   # checks the router's state between messages
        self._messages = list(messages)
        self._metadata = tuple(metadata)
        self._cert = cert
        self.written: list[cpb.RouterMessage] = []

    async def read(self) -> object:
        self._on_read()
        return self._messages.pop(0) if self._messages else grpc.aio.EOF

    async def write(self, msg: cpb.RouterMessage) -> None:
        self.written.append(msg)

    async def abort(self, code: grpc.StatusCode, details: str = "", **_: object) -> None:
        raise Aborted(code, details)

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_pem_cert": [self._cert]} if self._cert else {}

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def parse(data: bytes) -> list[cpb.NodeMessage]:
    out = []
    i = 0
    while i + 2 <= len(data):
        n = int.from_bytes(data[i:i + 2], "big")
        chunk = data[i + 2:i + 2 + n]
        i += 2 + n
        try:
            out.append(cpb.NodeMessage.FromString(chunk))
        except DecodeError:
            continue
    return out


async def _connect(data: bytes) -> tuple[grpc.StatusCode, set[str]]:
    """The stream's status and the ids quarantined by its end."""
    name, tls, token, metadata, stem = CALLERS[data[0] % len(CALLERS)] if data else CALLERS[0]
    clock = ManualClock()
    config = RouterConfig(serving={"router_id": "fuzz-router"},
                          security={"join_token": token,
                                    "tls_cert_file": "router.pem" if tls else ""})
    registry = Registry("fuzz-router", lease_ttl_s=3.0, freshness_s=1.5, clock=clock)
    quarantine = Quarantine(30.0, clock)
    locality = PrefixLocality("precise", PrefixIndexes(), clock)
    servicer = RouterControlPlaneServicer(config, registry, quarantine, locality)
    def check() -> None:
        if name in STRANGERS:
            assert not quarantine.listing() and not registry.models()
        ids = {q.node_id for q in quarantine.listing()}
        for summary in registry.models():
            assert math.isfinite(summary.capacity_weight)
            for c in registry.candidates(summary.name):
                ids.add(c.node_id)
                assert math.isfinite(c.capacity_weight) and c.capacity_weight > 0
                assert 0.0 <= c.kv_cache_usage <= 1.0 and math.isfinite(c.step_s)
        if name == "node-cert":   # a certificate holder touches its own id only
            assert ids <= {"n1"}, ids

    ctx = ScriptedContext(parse(data[1:]), metadata, _pems()[stem] if stem else b"", check)
    code = grpc.StatusCode.OK
    try:
        await servicer.Connect(iter(()), ctx)   # type: ignore[arg-type]
    except Aborted as a:
        code = a.code
    check()
    assert code not in FORBIDDEN, code
    if name in STRANGERS:
        assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), code
        assert not ctx.written
    return code, {q.node_id for q in quarantine.listing()}


_LOOP: asyncio.AbstractEventLoop | None = None


def control(data: bytes) -> tuple[grpc.StatusCode, set[str]]:
    """The target (module docstring); returns the status and the ids quarantined."""
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
    return _LOOP.run_until_complete(_connect(data))
