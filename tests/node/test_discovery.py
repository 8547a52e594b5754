"""gpumesh.node.discovery: target parsing, and RouterDiscovery's follow-the-name behaviour with
an injected resolver (no DNS needed; tests/integration/test_router_discovery.py asks a real
DNS server)."""

from __future__ import annotations

import asyncio

import pytest

from gpumesh.node.discovery import DnsTarget, RouterDiscovery, parse_target, resolve


@pytest.mark.parametrize("target, expected", [
    ("10.0.0.2:50050", None),
    ("dns:///gpumesh-router-headless:50050", DnsTarget("gpumesh-router-headless", 50050)),
    ("dns:gpumesh-router:7", DnsTarget("gpumesh-router", 7)),
    ("dns://10.96.0.10/r.ns.svc.cluster.local:50050",
     DnsTarget("r.ns.svc.cluster.local", 50050, ("10.96.0.10", 53))),
    ("dns://127.0.0.1:5353/r:1", DnsTarget("r", 1, ("127.0.0.1", 5353))),
    ("dns://[::1]:5353/r:1", DnsTarget("r", 1, ("::1", 5353))),
])
def test_parse_target(target, expected):
    assert parse_target(target) == expected


@pytest.mark.parametrize("bad", ["dns:///r", "dns://x", "dns:///r:0", "dns:///:5",
                                 "dns:///r:http"])
def test_parse_target_rejects(bad):
    with pytest.raises(ValueError):
        parse_target(bad)


class Table:
    """An injected resolver whose answers the test changes."""

    def __init__(self, answers: dict[str, list[str] | Exception]) -> None:
        self.answers = answers
        self.calls = 0

    async def __call__(self, host, port, server):
        self.calls += 1
        a = self.answers[host]
        if isinstance(a, Exception):
            raise a
        return [f"{ip}:{port}" for ip in a]


async def test_follows_changes_and_keeps_last_answer_on_failure():
    table = Table({"r": ["127.0.0.1", "127.0.0.2"]})
    seen: list[list[str]] = []
    d = RouterDiscovery(["dns:///r:50", "10.0.0.9:1"], seen.append, interval_s=0.05,
                        resolver=table, min_gap_s=0.0)
    assert d.static == ("10.0.0.9:1",)
    await d.start()
    try:
        assert seen == [["127.0.0.1:50", "127.0.0.2:50"]]
        table.answers["r"] = ["127.0.0.2", "127.0.0.3"]
        for _ in range(200):
            if len(seen) == 2:
                break
            await asyncio.sleep(0.01)
        assert seen[-1] == ["127.0.0.2:50", "127.0.0.3:50"]
        table.answers["r"] = OSError("SERVFAIL")
        calls = table.calls
        while table.calls < calls + 3:
            await asyncio.sleep(0.01)
        assert len(seen) == 2 and d.addresses == ["127.0.0.2:50", "127.0.0.3:50"]
    finally:
        await d.close()


async def test_a_lost_stream_resolves_again_before_the_interval():
    table = Table({"r": ["127.0.0.1"]})
    d = RouterDiscovery(["dns:///r:50"], lambda a: None, interval_s=3600, resolver=table,
                        min_gap_s=0.0)
    await d.start()
    try:
        assert table.calls == 1
        d.poke("127.0.0.1:50")
        for _ in range(200):
            if table.calls == 2:
                break
            await asyncio.sleep(0.01)
        assert table.calls == 2
    finally:
        await d.close()


async def test_no_dns_target_means_no_task():
    d = RouterDiscovery(["127.0.0.1:1"], lambda a: pytest.fail("no change expected"))
    await d.start()
    assert d._task is None and d.static == ("127.0.0.1:1",)
    await d.close()


async def test_system_resolver_gives_every_address_with_the_port():
    assert await resolve("127.0.0.1", 7, None) == ["127.0.0.1:7"]
    with pytest.raises(OSError):
        await resolve("no-such-name.invalid", 7, None)


async def test_discovered_addresses_keep_their_name_for_tls():
    from gpumesh.node.heartbeat import HeartbeatClient
    from gpumesh.v1 import control_pb2 as cpb

    table = Table({"routers.example": ["127.0.0.1"]})
    hb = HeartbeatClient((), cpb.Registration, cpb.LoadReport, max_backoff_s=0.1)
    d = RouterDiscovery(["dns:///routers.example:1"],
                        lambda addrs: hb.set_discovered(addrs, d.hosts), resolver=table)
    await d.start()
    try:
        assert d.hosts == {"127.0.0.1:1": "routers.example"}
        assert hb.channel_options("127.0.0.1:1") == [
            ("grpc.ssl_target_name_override", "routers.example")]
        assert hb.channel_options("10.0.0.1:1") == []   # a configured address: as given
    finally:
        await d.close()
        await hb.close(timeout_s=1)
