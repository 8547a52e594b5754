"""The quarantine's bounds and the control plane's stream bounds, table-driven on the plain
classes (the processes' behaviour is in test_hostile_peers.py)."""

from __future__ import annotations

from gpumesh.router.auth.streams import peer_host
from gpumesh.router.fleet.quarantine import MAX_ENTRIES, Quarantine
from gpumesh.security.tls import certificate_name
from tests.clock import ManualClock


def test_quarantine_holds_at_most_max_entries_dropping_the_oldest():
    clock = ManualClock()
    q = Quarantine(30.0, clock)
    for i in range(MAX_ENTRIES + 10):
        q.add(f"n{i}", "h:1", "garbage")
        clock.t += 0.001
    listed = {e.node_id for e in q.listing()}
    assert len(listed) == MAX_ENTRIES
    assert "n0" not in listed and f"n{MAX_ENTRIES + 9}" in listed
    clock.t += 31
    assert q.listing() == []   # and they expire


def test_peer_host_drops_the_port():
    assert peer_host("ipv4:10.0.0.1:5000") == "ipv4:10.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"


def test_certificate_names_bind_the_cn_and_the_role():
    assert certificate_name("node-a", "node") == "node-a.node.gpumesh"
    assert certificate_name("node-a", "client") == "node-a.client.gpumesh"
    # not a lower-case DNS label: hex, in a form no plain id takes (plain ids hold no '.')
    assert certificate_name("Node-A", "node") == "4e6f64652d41.hex.node.gpumesh"
    assert certificate_name("*", "node") == "2a.hex.node.gpumesh"
    assert certificate_name("a/b", "node") != certificate_name("a-b", "node")
