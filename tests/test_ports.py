"""gpumesh.ports: ports a launcher hands to child processes."""

from __future__ import annotations

import socket

from gpumesh import ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    low = ports._ephemeral_low()
    got = [ports.free_port() for _ in range(300)]
    assert len(set(got)) == len(got)
    assert all(ports._LOW <= p < low for p in got)
    with socket.socket() as s:
        s.bind(("127.0.0.1", got[-1]))


def test_a_port_in_use_is_skipped(monkeypatch) -> None:
    # The draw offers a port some other process listens on, then a free one: the bind check
    # must skip the first.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports.free_port()))
        busy.listen()
        taken = busy.getsockname()[1]
        ports._given.discard(taken)  # as if another process had bound it
        spare = ports.free_port()
        ports._given.discard(spare)
        offers = iter([taken, spare])
        monkeypatch.setattr(ports._rng, "randint", lambda lo, hi: next(offers))
        assert ports.free_port() == spare
