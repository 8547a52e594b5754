"""KvEventLog: the node's block events in SubscribeKvEvents' form (SMG's exact mode)."""

from __future__ import annotations

from gpumesh.kvblocks import block_hashes
from gpumesh.node.api.vllm_grpc.kv_stream import KvEventLog, to_int64
from gpumesh.node.cache import KvPublisher


def _log() -> tuple[KvPublisher, KvEventLog]:
    pub = KvPublisher("m")
    log = KvEventLog(16, history=8, chunk_blocks=2)
    pub.add_listener(log)
    return pub, log


def test_stored_blocks_carry_tokens_and_parent_chain():
    pub, log = _log()
    ids = list(range(1000, 1000 + 16 * 3 + 5))
    hs = block_hashes(ids)
    log.learn(ids)
    pub.stored(hs[:1])
    pub.stored(hs[1:])
    log.flush()
    (batch,) = log.after(0)
    assert batch.sequence_number == 1 and log.seq == 1
    (ev,) = batch.events      # one chain: one event
    assert not ev.stored.HasField("parent_block_hash")
    assert [b.block_hash for b in ev.stored.blocks] == [to_int64(h) for h in hs]
    assert list(ev.stored.blocks[2].token_ids) == ids[32:48]
    assert all(b.block_size == 16 for b in ev.stored.blocks)
    pub.removed(hs[2:])
    log.flush()
    (batch,) = log.after(1)
    assert list(batch.events[0].removed.block_hashes) == [to_int64(hs[2])]


def test_unknown_tokens_and_orphans_are_not_announced():
    pub, log = _log()
    ids = list(range(64))
    hs = block_hashes(ids)
    pub.stored(hs[:1])               # never learned
    log.learn(ids)
    pub.stored(hs[2:3])              # parent hs[1] not announced
    log.flush()
    assert log.unknown == 1 and log.orphans == 1 and not log.held and log.seq == 0
    pub.removed(hs[:1])              # never announced: no removal either
    log.flush()
    assert log.seq == 0


def test_snapshot_chunks_end_at_the_sequence_and_history_bounds():
    pub, log = _log()
    for base in (0, 5000):
        ids = list(range(base, base + 16 * 3))
        log.learn(ids)
        pub.stored(block_hashes(ids))
    log.flush()
    assert log.seq == 1
    snap = log.snapshot()
    assert [b.sequence_number for b in snap] == [2, 3, 4] and log.seq == 4
    assert snap[0].events[0].HasField("cleared")
    assert [b.snapshot.index for b in snap] == [0, 1, 2]
    assert all(b.snapshot.count == 3 and b.snapshot.blocks == 6 for b in snap)
    seen: set[int] = set()
    for b in snap:                   # parents before children
        for e in b.events:
            if e.HasField("stored"):
                if e.stored.HasField("parent_block_hash"):
                    assert e.stored.parent_block_hash in seen
                seen.update(x.block_hash for x in e.stored.blocks)
    assert len(seen) == 6
    assert log.covers(1) and [b.sequence_number for b in log.after(1)] == [2, 3, 4]
    assert not log.covers(99)        # never issued (a restarted node)
    for i in range(10):              # history of 8 batches rolls past the cursor
        pub.cleared()
        log.flush()
    assert not log.covers(1) and log.covers(log.seq)
