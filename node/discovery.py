"""Router discovery: a node finds every router replica behind one DNS name.

A router target in ``NodeConfig.membership.routers`` is either a plain ``host:port`` (used
as given) or a gRPC-style DNS name, resolved to *all* its addresses:

- ``dns:///NAME:PORT`` (or ``dns:NAME:PORT``): the system resolver (``getaddrinfo``: search
  domains, /etc/hosts and the cluster DNS apply; a Kubernetes headless Service name resolves to
  every ready router pod);
- ``dns://SERVER[:SERVERPORT]/NAME:PORT``: ask that DNS server directly (A and AAAA records,
  through dnspython), as gRPC's own ``dns`` resolver does with an authority.

``RouterDiscovery`` resolves every name at start, again every ``interval_s`` and soon after a
heartbeat stream breaks (``poke``), and hands the union of the addresses to ``on_change``
whenever it differs (``HeartbeatClient.set_discovered``: the node heartbeats to every address,
and deregisters from addresses that disappeared). A failed lookup keeps the last good answer
for that name (a DNS outage does not disconnect a node from routers it can still reach).
The resolver is injectable: ``Resolver(host, port, server) -> addresses``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

Resolver = Callable[[str, int, "tuple[str, int] | None"], Awaitable[list[str]]]


@dataclass(frozen=True)
class DnsTarget:
    """A router target to resolve: ``host`` at ``port``, through ``server`` (None: the
    system resolver)."""

    host: str
    port: int
    server: tuple[str, int] | None = None

    def __str__(self) -> str:
        auth = "" if self.server is None else f"{self.server[0]}:{self.server[1]}"
        return f"dns://{auth}/{self.host}:{self.port}"


def _host_port(text: str, default_port: int | None, what: str) -> tuple[str, int]:
    if text.startswith("["):                 # [v6] or [v6]:port
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:                                    # a name or address without a port
        host, port = text, ""
    if not port and default_port is not None:
        port = str(default_port)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {text!r}: expected host:port")
    return host, int(port)


def parse_target(target: str) -> DnsTarget | None:
    """The DNS target ``target`` names, or None for a plain ``host:port``.

    Raises ValueError for a malformed ``dns:`` target."""
    if not target.startswith("dns:"):
        return None
    rest = target[len("dns:"):]
    server = None
    if rest.startswith("//"):
        auth, sep, rest = rest[2:].partition("/")
        if not sep:
            raise ValueError(f"router target {target!r}: expected dns://[SERVER]/NAME:PORT")
        if auth:
            server = _host_port(auth, 53, "DNS server")
    host, port = _host_port(rest, None, "router target")
    return DnsTarget(host, port, server)


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


async def resolve(host: str, port: int, server: tuple[str, int] | None) -> list[str]:
    """Every address of ``host`` as ``ip:port`` (sorted, no duplicates). Raises OSError when
    the name does not resolve."""
    if server is None:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)
        return sorted({_address(str(info[4][0]), port) for info in infos})
    import dns.asyncresolver
    import dns.exception
    import dns.resolver

    res = dns.asyncresolver.Resolver(configure=False)
    res.nameservers = [server[0]]
    res.port = server[1]
    res.lifetime = 5.0
    found: set[str] = set()
    for rdtype in ("A", "AAAA"):
        try:
            answer = await res.resolve(host, rdtype, search=False)
        except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
            continue
        except dns.exception.DNSException as exc:
            raise OSError(f"DNS lookup of {host} at {server[0]}:{server[1]}: {exc}") from exc
        found |= {_address(r.address, port) for r in answer}
    if not found:
        raise OSError(f"{host} has no A or AAAA record at {server[0]}:{server[1]}")
    return sorted(found)


class RouterDiscovery:
    """Keeps the node's router addresses in step with DNS. ``static``: the plain targets;
    ``names``: the DNS targets. ``start()`` resolves once before returning (a failure is
    logged, and retried on the interval)."""

    def __init__(self, targets: Iterable[str], on_change: Callable[[list[str]], None],
                 interval_s: float = 10.0, resolver: Resolver = resolve,
                 min_gap_s: float = 1.0) -> None:
        targets = tuple(targets)
        parsed = [(t, parse_target(t)) for t in targets]
        self.static = tuple(t for t, d in parsed if d is None)
        self.names = tuple(d for _, d in parsed if d is not None)
        self._on_change = on_change
        self._interval = interval_s
        self._resolver = resolver
        self._min_gap = min_gap_s            # stream losses re-resolve at most this often
        self._last: dict[DnsTarget, list[str]] = {}
        self.addresses: list[str] = []       # what on_change last got
        # address -> the DNS name it came from: the name a router's TLS certificate carries
        # (a pod IP is in no certificate)
        self.hosts: dict[str, str] = {}
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.resolutions = 0

    async def start(self) -> None:
        if not self.names:
            return
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="router-discovery")

    def poke(self, _addr: str = "") -> None:
        """Re-resolve soon (a heartbeat stream broke: the replica may be gone)."""
        self._poke.set()

    async def refresh(self) -> list[str]:
        """Resolves every name now; calls ``on_change`` if the union changed."""
        for target in self.names:
            try:
                self._last[target] = await self._resolver(target.host, target.port,
                                                          target.server)
            except (OSError, asyncio.TimeoutError) as exc:
                log.warning("router discovery: %s did not resolve (%s); keeping %s", target,
                            exc, self._last.get(target, []))
        self.resolutions += 1
        found = sorted({a for addrs in self._last.values() for a in addrs})
        self.hosts = {a: t.host for t, addrs in self._last.items() for a in addrs}
        if found != self.addresses:
            log.info("router discovery: %s -> %s", ", ".join(map(str, self.names)), found)
            self.addresses = found
            self._on_change(found)
        return found

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._poke.wait(), self._interval)
            if self._poke.is_set():
                await asyncio.sleep(self._min_gap)   # let a burst of losses settle
                self._poke.clear()
            await self.refresh()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
