"""``KvPublisher``: the engine's cached prefix blocks, mirrored and streamed to routers.

The engine reports block events (``stored`` / ``removed`` / ``cleared``, hashes from
``gpumesh.kvblocks``) into the publisher, on the event loop. The publisher keeps the set of
blocks the engine holds and, per router stream, a ``KvSubscription``: the changes that stream
has not been sent yet, coalesced (a block stored then removed before a flush is sent as
neither). A stream's first update is a snapshot of every block held; so is its next update
after the router asked for one (it saw a gap in ``seq``) or after the pending changes outgrew
``max_pending`` (the changes are dropped and the snapshot replaces them: memory stays bounded).

Bounds: each update carries at most ``max_hashes_per_update`` hashes (a snapshot is split
into a first ``snapshot`` part and plain ``stored`` parts, each with the next ``seq``); a
subscription sends at most one batch of updates per ``min_interval_s``.

Epochs: every update carries the publisher's ``epoch`` (``KvCacheUpdate.epoch``; heartbeats
carry it as ``LoadReport.engine_epoch``). It is set when the engine starts (the node process
creates its publisher) and moves on every ``cleared`` (a prefix-cache reset, vLLM's
AllBlocksCleared, a gap in the engine's events): the cleared update then goes out at once,
without waiting for ``min_interval_s``, and a router drops everything it indexed for the
node when it sees a newer epoch and ignores updates of an older one. Epochs are wall-clock
milliseconds at the engine start, strictly increasing within a process, so a restarted node
continues above the epochs it used before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from gpumesh.kvblocks import chain_hash
from gpumesh.node.engines.base import KvEventSink
from gpumesh.v1 import control_pb2 as cpb


def next_epoch(previous: int = 0) -> int:
    """A new engine epoch: wall-clock milliseconds now, and above ``previous``."""
    return max(previous + 1, time.time_ns() // 1_000_000)


class KvSubscription:
    """One router stream's view of the publisher: its pending changes and its ``seq``."""

    def __init__(self, publisher: KvPublisher) -> None:
        self._pub = publisher
        self.seq = 0
        self._stored: dict[int, None] = {}
        self._removed: dict[int, None] = {}
        self._cleared = False
        self._snapshot = True          # the first update is always a snapshot
        self.ready = asyncio.Event()
        self.ready.set()
        self._last_flush = -1e9
        self._epoch_sent = publisher.epoch   # an epoch change is sent without waiting

    # called by the publisher (a KvEventSink of its changes: new blocks, removals of held
    # ones) --------------------------------------------------------------------------------

    def stored(self, hashes: Sequence[int]) -> None:
        self._pend(hashes, self._stored, self._removed)

    def removed(self, hashes: Sequence[int]) -> None:
        self._pend(hashes, self._removed, self._stored)

    def _pend(self, hashes: Sequence[int], into: dict[int, None],
              opposite: dict[int, None]) -> None:
        """Adds changes to the pending ones (a snapshot pending: nothing to add); a change
        cancels its pending opposite (a block stored then removed before a flush is sent as
        neither)."""
        if self._snapshot:
            return
        for h in hashes:
            if opposite.pop(h, 0) is not None:   # (None: it was pending)
                into[h] = None
        self._check()

    def cleared(self) -> None:
        if self._snapshot:
            self.ready.set()   # the snapshot goes out at once, with the new epoch
            return
        self._stored.clear()
        self._removed.clear()
        self._cleared = True
        self.ready.set()

    def _check(self) -> None:
        if len(self._stored) + len(self._removed) > self._pub.max_pending:
            self.resnapshot()
        else:
            self.ready.set()

    # called by the stream ---------------------------------------------------------------

    def resnapshot(self) -> None:
        """The next update is a full snapshot (the router saw a gap, or asked after a
        restart); pending changes are dropped."""
        self._snapshot = True
        self._stored.clear()
        self._removed.clear()
        self._cleared = False
        self.ready.set()

    def due_in(self, now: float) -> float:
        """Seconds until this subscription may flush (0: now; always 0 when the epoch moved
        since the last update sent: a router must forget the node's blocks at once)."""
        if self._pub.epoch != self._epoch_sent:
            return 0.0
        return max(0.0, self._last_flush + self._pub.min_interval_s - now)

    def take(self, now: float) -> list[cpb.KvCacheUpdate]:
        """The updates to send now (empty when nothing changed or too soon after the last)."""
        if not self.ready.is_set() or self.due_in(now) > 0:
            return []
        self.ready.clear()
        pub, cap = self._pub, self._pub.max_hashes_per_update
        epoch = self._epoch_sent = pub.epoch
        out: list[cpb.KvCacheUpdate] = []
        if self._snapshot:
            self._snapshot = False
            held = list(pub.held)
            for i in range(0, max(len(held), 1), cap):
                self.seq += 1
                out.append(cpb.KvCacheUpdate(
                    model=pub.model, seq=self.seq, snapshot=(i == 0),
                    block_size=pub.block_size, stored=held[i:i + cap], epoch=epoch))
        else:
            stored, removed = list(self._stored), list(self._removed)
            cleared = self._cleared
            self._stored.clear()
            self._removed.clear()
            self._cleared = False
            if not (stored or removed or cleared):
                return []
            first = True
            while first or stored or removed:
                s, stored = stored[:cap], stored[cap:]
                r, removed = removed[:cap - len(s)], removed[cap - len(s):]
                self.seq += 1
                out.append(cpb.KvCacheUpdate(model=pub.model, seq=self.seq,
                                             cleared=cleared and first,
                                             block_size=pub.block_size, stored=s, removed=r,
                                             epoch=epoch))
                first = False
        self._last_flush = now
        return out


class KvPublisher:
    """The blocks one model's engine holds, fanned out to router streams (module doc).
    Implements the engines' block-event sink (``stored`` / ``removed`` / ``cleared``).
    ``epoch``: the engine epoch of the blocks held (module doc)."""

    def __init__(self, model: str, block_size: int = 16, *, max_hashes_per_update: int = 4096,
                 min_interval_s: float = 0.05, max_pending: int = 65_536) -> None:
        self.model = model
        self.block_size = block_size
        self.max_hashes_per_update = max(1, max_hashes_per_update)
        self.min_interval_s = min_interval_s
        self.max_pending = max_pending
        self.epoch = next_epoch()
        self.held: dict[int, None] = {}
        self._subs: list[KvSubscription] = []
        self._listeners: list[KvEventSink] = []

    def add_listener(self, sink: KvEventSink) -> None:
        """Also reports block changes to ``sink`` (new blocks only, removals of held ones),
        e.g. the VllmEngine service's ``SubscribeKvEvents`` log."""
        self._listeners.append(sink)

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids``' leading full blocks the engine holds (at most all but the
        last token, as the engine recomputes that one): hashes block by block, stopping at the
        first block not held."""
        held, size = self.held, self.block_size
        if not held:
            return 0
        parent, n = 0, 0
        for i in range(min(len(token_ids) - 1, len(token_ids) // size * size) // size):
            parent = chain_hash(parent, token_ids[i * size:(i + 1) * size])
            if parent not in held:
                break
            n += size
        return n

    def subscribe(self) -> KvSubscription:
        sub = KvSubscription(self)
        self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: KvSubscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)

    # the engine's sink --------------------------------------------------------------------

    # (each change goes to every router stream's subscription, then to the listeners)

    def stored(self, hashes: Sequence[int]) -> None:
        held = self.held
        new = [h for h in dict.fromkeys(hashes) if h not in held]
        if new:
            held.update(dict.fromkeys(new))
            for sink in (*self._subs, *self._listeners):
                sink.stored(new)

    def removed(self, hashes: Sequence[int]) -> None:
        held = self.held
        gone = [h for h in dict.fromkeys(hashes) if h in held]
        if gone:
            for h in gone:
                del held[h]
            for sink in (*self._subs, *self._listeners):
                sink.removed(gone)

    def cleared(self) -> None:
        """The engine holds nothing any more: a new epoch, sent to every router at once."""
        self.held.clear()
        self.epoch = next_epoch(self.epoch)
        for sink in (*self._subs, *self._listeners):
            sink.cleared()
