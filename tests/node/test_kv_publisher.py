"""KvPublisher: coalesced deltas per subscription, snapshots, size and rate bounds."""

from __future__ import annotations

from gpumesh.node.cache import KvPublisher


def test_first_update_is_a_snapshot_then_coalesced_deltas() -> None:
    pub = KvPublisher("m", max_hashes_per_update=3, min_interval_s=1.0)
    pub.stored([1, 2, 3, 4])
    sub = pub.subscribe()
    ups = sub.take(0.0)
    assert [(u.seq, u.snapshot, list(u.stored)) for u in ups] == [
        (1, True, [1, 2, 3]), (2, False, [4])]
    pub.stored([5, 6])
    pub.removed([6, 1])        # 6 stored and removed before a flush: neither is sent
    assert sub.take(0.5) == []                       # rate bound: one batch per second
    (u,) = sub.take(1.0)
    assert (u.seq, list(u.stored), list(u.removed)) == (3, [5], [1])
    assert sub.take(5.0) == []                       # nothing changed
    pub.cleared()
    pub.stored([7])
    (u,) = sub.take(5.0)
    assert u.cleared and list(u.stored) == [7] and u.seq == 4


def test_gap_request_and_overflow_turn_into_a_snapshot() -> None:
    pub = KvPublisher("m", max_pending=4, min_interval_s=0.0)
    sub = pub.subscribe()
    sub.take(0.0)
    pub.stored(range(10, 20))            # more than max_pending: dropped for a snapshot
    (u,) = sub.take(1.0)
    assert u.snapshot and sorted(u.stored) == list(range(10, 20)) and u.seq == 2
    sub.resnapshot()
    (u,) = sub.take(2.0)
    assert u.snapshot and u.seq == 3
    pub.unsubscribe(sub)
    pub.stored([99])
    assert sub.take(3.0) == []


def test_cached_prefix_tokens_follows_the_held_chain() -> None:
    from gpumesh.kvblocks import block_hashes

    pub = KvPublisher("m")
    ids = list(range(1, 101))                   # 6 full blocks + 4 tokens
    assert pub.cached_prefix_tokens(ids) == 0
    pub.stored(block_hashes(ids)[:4])
    assert pub.cached_prefix_tokens(ids) == 64
    assert pub.cached_prefix_tokens(ids[:64]) == 48   # the last token is always computed
    assert pub.cached_prefix_tokens([0] + ids[1:]) == 0
