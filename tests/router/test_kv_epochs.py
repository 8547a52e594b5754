"""KV index truth: engine epochs from the node's publisher to the router's prefix index.

A newer epoch (an engine restart, a prefix-cache reset, vLLM's AllBlocksCleared) drops every
block the router indexed for the node, pending and approximate ones included; an update of an
older epoch is ignored; the new fields are validated where they enter the router."""

from __future__ import annotations

import pytest

from gpumesh import wire
from gpumesh.kvblocks import block_hashes
from gpumesh.node.cache import KvPublisher
from gpumesh.node.cache.publisher import next_epoch
from gpumesh.router.fleet.locality import PrefixLocality
from gpumesh.router.fleet.prefix_index import PrefixIndexes
from gpumesh.router.fleet.validation import (
    MAX_EPOCH,
    InvalidNodeInput,
    NodeLimits,
    valid_kv_update,
    valid_load,
)
from gpumesh.router.scheduling.types import RequestInfo
from gpumesh.types import LoadReport
from gpumesh.v1 import control_pb2

A = block_hashes(list(range(160)))                 # 10 blocks
B = block_hashes(list(range(500, 660)))


def update(seq: int, epoch: int, **kw: object) -> control_pb2.KvCacheUpdate:
    return control_pb2.KvCacheUpdate(model="m", seq=seq, block_size=16, epoch=epoch,
                                     **kw)  # type: ignore[arg-type]


def test_publisher_epoch_moves_on_clear_and_the_cleared_update_goes_at_once() -> None:
    pub = KvPublisher("m", min_interval_s=10.0)
    first = pub.epoch
    assert first >= 1
    sub = pub.subscribe()
    (snap,) = sub.take(0.0)
    assert snap.snapshot and snap.epoch == first
    pub.stored([1, 2])
    assert sub.take(1.0) == []                  # rate bound: the next batch waits 10 s
    pub.cleared()
    assert pub.epoch > first and not pub.held
    assert sub.due_in(1.0) == 0.0               # ... but a new epoch is sent at once
    (u,) = sub.take(1.0)
    assert u.cleared and u.epoch == pub.epoch and list(u.stored) == []
    pub.stored([3])
    assert sub.take(2.0) == []                  # back to the rate bound
    (u,) = sub.take(11.0)
    assert list(u.stored) == [3] and u.epoch == pub.epoch and not u.cleared


def test_a_clear_during_a_pending_snapshot_sends_it_with_the_new_epoch() -> None:
    pub = KvPublisher("m", min_interval_s=10.0)
    pub.stored([1])
    sub = pub.subscribe()
    sub.take(0.0)
    sub.resnapshot()
    pub.stored([2])
    pub.cleared()
    pub.stored([4])
    (u,) = sub.take(1.0)
    assert u.snapshot and list(u.stored) == [4] and u.epoch == pub.epoch


def test_epochs_increase_even_within_one_millisecond() -> None:
    e = next_epoch()
    assert next_epoch(e) > e and next_epoch(e + 10**9) == e + 10**9 + 1


def test_a_newer_epoch_drops_the_node_and_an_older_one_is_ignored() -> None:
    loc = PrefixLocality("auto", PrefixIndexes(), clock=lambda: 1.0)
    loc.apply("n", update(1, 100, snapshot=True, stored=A))
    loc.apply("m2", update(1, 7, snapshot=True, stored=A[:3]))
    ix = loc.indexes.model("m")
    assert ix.match(A) == {"n": 10, "m2": 3}
    # the router sent B there: a pending entry until the node's events confirm it
    loc.routed(RequestInfo("m", 160, prefix_hashes=tuple(B)), "n")
    assert ix.match(B, 1.0) == {"n": 10}
    # the engine restarted: its first update (here a plain delta) carries a new epoch
    assert loc.apply("n", update(2, 200, stored=A[:2])) is None
    assert ix.match(A) == {"n": 2, "m2": 3} and ix.match(B, 1.0) == {}
    assert ix.epoch("n") == 200
    # late updates of the old epoch change nothing, snapshots included
    assert loc.apply("n", update(3, 100, stored=A)) is None
    assert loc.apply("n", update(4, 100, snapshot=True, stored=A)) is None
    assert ix.match(A)["n"] == 2 and ix.stale_updates == 2
    # epoch 0 (a node that stamps none) is always current
    assert loc.apply("n", update(3, 0, stored=A[2:4])) is None
    assert ix.match(A)["n"] == 4


def test_a_heartbeat_epoch_drops_the_node_before_any_update() -> None:
    loc = PrefixLocality("auto", PrefixIndexes(), clock=lambda: 1.0)
    loc.apply("n", update(1, 100, snapshot=True, stored=A))
    loc.engine_epoch("n", 100)                       # same epoch: nothing happens
    assert loc.indexes.model("m").match(A) == {"n": 10}
    loc.engine_epoch("n", 150)
    assert loc.indexes.model("m").match(A) == {}
    # the node's cleared update with that epoch follows; its seq continues
    assert loc.apply("n", update(2, 150, cleared=True, stored=A[:1])) is None
    assert loc.indexes.model("m").match(A) == {"n": 1}
    # approximate records (a node without events) are dropped too
    approx = PrefixLocality("approximate", PrefixIndexes(ttl_s=60.0), clock=lambda: 1.0)
    approx.routed(RequestInfo("m", 160, prefix_hashes=tuple(A)), "w")
    assert approx.indexes.model("m").match(A, 1.0) == {"w": 10}
    approx.engine_epoch("w", 5)
    assert approx.indexes.model("m").match(A, 1.0) == {}
    # a node that left and came back starts over: its old epoch is forgotten
    loc.node_left("n")
    assert loc.apply("n", update(1, 120, snapshot=True, stored=A)) is None
    assert loc.indexes.model("m").match(A) == {"n": 10}


def test_engine_epoch_rides_the_load_report() -> None:
    msg = wire.load_report_to_proto(LoadReport(engine_epoch=1_765_000_000_000))
    assert msg.engine_epoch == 1_765_000_000_000
    assert valid_load(msg, NodeLimits()).engine_epoch == 1_765_000_000_000


@pytest.mark.parametrize(("kw", "reason"), [
    ({"epoch": MAX_EPOCH + 1}, "epoch"),
    ({"seq": MAX_EPOCH + 1}, "seq"),
    ({"block_size": 1 << 21}, "block_size"),
    ({"model": "m" * 300}, "model"),
    ({"stored": list(range(8193))}, "hashes"),
    ({"removed": list(range(8193))}, "hashes"),
])
def test_kv_update_fields_are_bounded(kw: dict[str, object], reason: str) -> None:
    base: dict[str, object] = {"model": "m", "seq": 1, "block_size": 16, "epoch": 5}
    base.update(kw)
    with pytest.raises(InvalidNodeInput, match=reason):
        valid_kv_update(control_pb2.KvCacheUpdate(**base), NodeLimits())  # type: ignore[arg-type]
    bad = wire.load_report_to_proto(LoadReport())
    bad.engine_epoch = MAX_EPOCH + 1
    with pytest.raises(InvalidNodeInput, match="engine_epoch"):
        valid_load(bad, NodeLimits())


def test_a_valid_kv_update_passes() -> None:
    msg = update(1, MAX_EPOCH, stored=A)
    assert valid_kv_update(msg, NodeLimits()) is msg


def test_heartbeats_carry_the_publishers_epoch() -> None:
    from gpumesh.node.heartbeat import HeartbeatClient

    pub = KvPublisher("m")
    hb = HeartbeatClient((), lambda: control_pb2.Registration(),
                         lambda: control_pb2.LoadReport(num_running=1), kv_publishers=(pub,))
    first = hb._report()
    assert first.engine_epoch == pub.epoch and first.num_running == 1
    pub.cleared()
    assert hb._report().engine_epoch == pub.epoch > first.engine_epoch
    plain = HeartbeatClient((), lambda: control_pb2.Registration(),
                            lambda: control_pb2.LoadReport())
    assert plain._report().engine_epoch == 0          # no publisher: no epoch
