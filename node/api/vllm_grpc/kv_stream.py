"""``KvEventLog``: the node's KV block events in the form vLLM's ``SubscribeKvEvents`` carries
them (``smg.grpc.common.KvEventBatch``), for SMG's event-driven (exact) ``cache_aware`` mode.

What SMG consumes (its ``KvEventMonitor`` / ``PositionalIndexer``): ``KvBlocksStored`` with, per
block, an opaque 64-bit ``block_hash`` (the block's identity, used for removals and as the
parent link), the block's ``token_ids`` (SMG hashes them itself, xxh3 of the ids, and matches
a request's own token blocks by position and content) and ``block_size``; the event's
``parent_block_hash`` places the blocks after their parent (a block whose parent SMG does not
know is placed at position 0, so it is never sent). ``KvBlocksRemoved`` lists hashes,
``KvCacheCleared`` drops the worker's blocks. Batches carry consecutive ``sequence_number``s;
SMG reconnects with its last one.

The node's engine reports only block hashes (``gpumesh.kvblocks``, 16-token blocks) to its
``KvPublisher``. This log learns each hash's tokens and parent from the prompts that reach the
``VllmEngine`` service (``learn``), keeps at most ``max_learned`` not-yet-stored blocks (LRU),
and announces a stored block when it knows its tokens and its parent is announced (or it has
none). Blocks computed for requests that came another way (a gpumesh router's
``Inference`` stream) are therefore not announced: SMG's index covers what SMG sent.

Sequence and recovery: every flush with events makes one batch (``seq`` + 1) kept in a history
of ``history`` batches. A subscriber with ``start_sequence_number`` 0 gets a snapshot of the
announced blocks first (``KvSnapshotChunk`` chunks, the first beginning with a clear, parents
before children, numbered so that they end at the log's sequence), then live batches; one with
a cursor the history still covers gets the batches after it; otherwise ``covers`` is False (the
servicer answers OUT_OF_RANGE and SMG clears the worker and subscribes from 0).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

from smg_grpc_proto.generated import common_pb2 as cpb

from gpumesh.kvblocks import BLOCK_SIZE, chain_hash

_I64 = 1 << 63


def to_int64(h: int) -> int:
    """A 64-bit hash as the proto's signed ``int64`` (same bit pattern)."""
    h &= (1 << 64) - 1
    return h - (1 << 64) if h >= _I64 else h


class KvEventLog:
    """The announced blocks, the pending events and the batch history (module doc).
    Implements the engines' block-event sink (``stored`` / ``removed`` / ``cleared``)."""

    def __init__(self, block_size: int = BLOCK_SIZE, *, history: int = 4096,
                 max_learned: int = 65_536, chunk_blocks: int = 2048) -> None:
        self.block_size = block_size
        self.max_learned = max_learned
        self.chunk_blocks = max(1, chunk_blocks)
        # hash -> (parent hash or None, depth, token ids)
        self._learned: OrderedDict[int, tuple[int | None, int, tuple[int, ...]]] = OrderedDict()
        self.held: dict[int, tuple[int | None, int, tuple[int, ...]]] = {}
        self._pending: list[cpb.KvCacheEvent] = []
        self._event_id = 0
        self.seq = 0
        self.history: deque[cpb.KvEventBatch] = deque(maxlen=max(1, history))
        self.waiters: set[asyncio.Event] = set()
        self.unknown = 0        # stored blocks whose tokens were never seen here
        self.orphans = 0        # stored blocks whose parent was not announced

    # --- learning ----------------------------------------------------------------------

    def learn(self, token_ids: Sequence[int]) -> None:
        """Records the tokens and parent of each full block of a prompt (about 1 us a block)."""
        size, learned, held = self.block_size, self._learned, self.held
        parent: int | None = None
        for i in range(len(token_ids) // size):
            part = tuple(token_ids[i * size:(i + 1) * size])
            h = chain_hash(0 if parent is None else parent, part)
            if h not in held:
                learned[h] = (parent, i, part)
                learned.move_to_end(h)
            parent = h
        while len(learned) > self.max_learned:
            learned.popitem(last=False)

    # --- the engine's sink ---------------------------------------------------------------

    def stored(self, hashes: Sequence[int]) -> None:
        held = self.held
        for h in hashes:
            if h in held:
                continue
            rec = self._learned.pop(h, None)
            if rec is None:
                self.unknown += 1
                continue
            parent = rec[0]
            if parent is not None and parent not in held:
                self.orphans += 1
                continue
            held[h] = rec
            self._add_stored(h, rec)
        self._notify()

    def _add_stored(self, h: int, rec: tuple[int | None, int, tuple[int, ...]]) -> None:
        block = cpb.KvBlock(block_hash=to_int64(h), token_ids=rec[2], block_size=self.block_size,
                            cache_level=0)
        last = self._pending[-1] if self._pending else None
        if (last is not None and last.WhichOneof("data") == "stored"
                and last.stored.blocks[-1].block_hash == to_int64(rec[0] or 0)
                and rec[0] is not None):
            last.stored.blocks.append(block)   # the chain continues: one event
            return
        self._pending.append(self._event(stored=self._stored_msg([block], rec[0])))

    @staticmethod
    def _stored_msg(blocks: list[cpb.KvBlock], parent: int | None) -> cpb.KvBlocksStored:
        msg = cpb.KvBlocksStored(blocks=blocks, tier=cpb.KV_CACHE_TIER_DEVICE,
                                 locality=cpb.KV_CACHE_LOCALITY_LOCAL)
        if parent is not None:
            msg.parent_block_hash = to_int64(parent)
        return msg

    def _event(self, **data: object) -> cpb.KvCacheEvent:
        self._event_id += 1
        return cpb.KvCacheEvent(event_id=self._event_id, **data)

    def removed(self, hashes: Sequence[int]) -> None:
        gone = [to_int64(h) for h in hashes if self.held.pop(h, None) is not None]
        if gone:
            self._pending.append(self._event(removed=cpb.KvBlocksRemoved(
                block_hashes=gone, cache_level=0, tier=cpb.KV_CACHE_TIER_DEVICE,
                locality=cpb.KV_CACHE_LOCALITY_LOCAL)))
            self._notify()

    def cleared(self) -> None:
        self.held.clear()
        self._pending.append(self._event(cleared=cpb.KvCacheCleared()))
        self._notify()

    def _notify(self) -> None:
        if self._pending:
            for w in self.waiters:
                w.set()

    # --- batches -------------------------------------------------------------------------

    def flush(self) -> None:
        """The pending events become the next batch (none when nothing is pending)."""
        if not self._pending:
            return
        self.seq += 1
        self.history.append(cpb.KvEventBatch(sequence_number=self.seq, timestamp=time.time(),
                                             events=self._pending, dp_rank=0))
        self._pending = []

    def covers(self, cursor: int) -> bool:
        """Whether every batch after ``cursor`` is still in the history."""
        if cursor > self.seq:
            return False   # a sequence this log never issued (the node restarted)
        return cursor == self.seq or (bool(self.history)
                                      and self.history[0].sequence_number <= cursor + 1)

    def after(self, cursor: int) -> list[cpb.KvEventBatch]:
        """The batches numbered above ``cursor`` (call ``covers`` first)."""
        if cursor >= self.seq:
            return []
        skip = max(0, len(self.history) - (self.seq - cursor))
        return [self.history[i] for i in range(skip, len(self.history))]

    def snapshot(self) -> list[cpb.KvEventBatch]:
        """The announced blocks as ``KvSnapshotChunk`` batches ending at ``seq`` (module doc);
        the sequence numbers they take are recorded as empty batches for other subscribers."""
        self.flush()
        order = self._chain_order()
        count = max(1, math.ceil(len(order) / self.chunk_blocks))
        first = self.seq + 1
        for i in range(count):
            self.seq += 1
            self.history.append(cpb.KvEventBatch(sequence_number=self.seq,
                                                 timestamp=time.time(), dp_rank=0))
        out = []
        for i in range(count):
            part = order[i * self.chunk_blocks:(i + 1) * self.chunk_blocks]
            events: list[cpb.KvCacheEvent] = []
            if i == 0:
                events.append(cpb.KvCacheEvent(cleared=cpb.KvCacheCleared()))
            prev: int | None = None
            for h in part:
                parent, _, tokens = self.held[h]
                block = cpb.KvBlock(block_hash=to_int64(h), token_ids=tokens,
                                    block_size=self.block_size, cache_level=0)
                if events and prev is not None and parent == prev \
                        and events[-1].WhichOneof("data") == "stored":
                    events[-1].stored.blocks.append(block)
                else:
                    events.append(cpb.KvCacheEvent(stored=self._stored_msg([block], parent)))
                prev = h
            out.append(cpb.KvEventBatch(
                sequence_number=first + i, timestamp=time.time(), events=events, dp_rank=0,
                snapshot=cpb.KvSnapshotChunk(index=i, count=count, blocks=len(order))))
        return out

    def _chain_order(self) -> list[int]:
        """Announced blocks reachable from a root, depth first (parents before children);
        a block whose parent was removed since is left out with its descendants."""
        children: dict[int | None, list[int]] = {}
        for h, (parent, depth, _) in self.held.items():
            children.setdefault(parent, []).append(h)
        out: list[int] = []
        stack = list(reversed(children.get(None, [])))
        while stack:
            h = stack.pop()
            out.append(h)
            stack.extend(reversed(children.get(h, [])))
        return out
