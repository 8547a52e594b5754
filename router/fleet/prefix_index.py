"""Which node holds which prompt prefix in its KV cache: the router's prefix index.

One ``PrefixIndex`` per model maps a block hash (``gpumesh.kvblocks``: a chained hash, so a
hash stands for the whole prefix up to its block) to the nodes holding that block, as a
bitmask over node slots. ``match(hashes)`` walks a request's chain and returns, per node, how
many leading blocks it holds: O(blocks matched), independent of the fleet size.

Two sources fill it, per node:

- **precise**: the node streams its engine's KV events (``stored`` / ``removed`` /
  ``cleared``, and a full ``snapshot`` on (re)connect or after a gap) over the control plane;
  the index mirrors them and never expires them.
- **approximate**: a node without events (a stock vLLM gRPC worker, events switched off): the
  router records the blocks of each request it sent there (``routed``); they age out after
  ``ttl_s`` (and are re-dated by the next request with the same prefix).
- **pending**, on a precise node: the blocks of a request the router just sent there, held
  until the node's events confirm them (they then become precise entries) for at most
  ``pending_ttl_s``. Without them a burst of one prefix would scatter over the fleet while
  its first request still queues for prefill, before any event can say where it lives.

Engine epochs: a node stamps its updates and heartbeats with its engine epoch (a new one per
engine start and per prefix-cache reset; ``gpumesh.node.cache``). ``observe_epoch`` drops
everything the index holds for a node (precise, pending and approximate entries) as soon as
a newer epoch is seen, and tells the caller to ignore an update of an older one: the router
never counts on blocks a restarted or reset engine no longer holds.

Memory is bounded: at most ``max_entries`` (node, block) pairs per model; past it, the node
that is adding loses its oldest blocks first. Each pair costs about 110 bytes (a Python dict
entry per node, a shared dict entry and bitmask per block; docs/routing.md). Not thread-safe:
the router's event loop owns it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class _Node:
    slot: int
    precise: bool
    # hash -> time added (in order); 0.0 = confirmed by the node's events (precise nodes)
    blocks: dict[int, float] = field(default_factory=dict)
    # precise nodes: hashes the router sent but the events have not confirmed yet, by time
    pending: dict[int, float] = field(default_factory=dict)
    seq: int = 0            # last event batch applied (precise)
    awaiting: bool = False  # a gap was seen: updates are ignored until the next snapshot


@dataclass(slots=True, eq=False)
class PrefixIndex:
    """Block hash -> nodes for one model (module docstring)."""

    max_entries: int = 4_000_000
    ttl_s: float = 120.0
    pending_ttl_s: float = 5.0
    entries: int = field(init=False, default=0)
    stale_updates: int = field(init=False, default=0)   # updates ignored: from an older epoch
    _blocks: dict[int, int] = field(init=False, default_factory=dict)  # hash -> node bitmask
    _nodes: dict[str, _Node] = field(init=False, default_factory=dict)
    _by_slot: dict[int, str] = field(init=False, default_factory=dict)
    _free_slots: list[int] = field(init=False, default_factory=list)
    _next_slot: int = field(init=False, default=0)
    # node id -> newest engine epoch seen
    _epochs: dict[str, int] = field(init=False, default_factory=dict)

    # --- reads ---------------------------------------------------------------------------

    def match(self, hashes: Sequence[int], now: float = 0.0) -> dict[str, int]:
        """Node id -> how many of ``hashes``' leading blocks it holds (nodes holding none are
        absent). Approximate entries older than ``ttl_s`` and pending ones older than
        ``pending_ttl_s`` at ``now`` do not count.

        Bisection over the chain with node bitmasks: the nodes holding the first block are
        split by whether they hold the middle one, and so on, so a lookup costs about
        log2(blocks) mask operations per group of nodes holding the same depth, not one per
        block. It assumes a node holds a prefix of the chain (engines evict a chain from its
        tail; the memory bound drops a node's oldest, i.e. first, blocks): a block missing
        inside a held chain is not seen."""
        blocks = self._blocks
        if not hashes or not blocks:
            return {}
        top = blocks.get(hashes[0], 0)
        if not top:
            return {}
        out: dict[str, int] = {}
        stack = [(1, len(hashes), top)]   # the nodes in mask hold a depth in [lo, hi]
        while stack:
            lo, hi, mask = stack.pop()
            if lo == hi:
                self._settle(mask, lo, out)
                continue
            mid = (lo + hi + 1) // 2
            deep = mask & blocks.get(hashes[mid - 1], 0)
            if deep:
                stack.append((mid, hi, deep))
                mask &= ~deep
            if mask:
                stack.append((lo, mid - 1, mask))
        if out:
            self._age(out, hashes, now)
        return out

    def _settle(self, mask: int, depth: int, out: dict[str, int]) -> None:
        by_slot = self._by_slot
        while mask:
            low = mask & -mask
            out[by_slot[low.bit_length() - 1]] = depth
            mask ^= low

    def _age(self, out: dict[str, int], hashes: Sequence[int], now: float) -> None:
        """A match stops at the node's first expired block (approximate or pending), found
        by bisection too (a chain is added and renewed as a whole)."""
        for node_id, depth in list(out.items()):
            n = self._nodes[node_id]
            if n.precise:
                if not n.pending:
                    continue
                ttl = self.pending_ttl_s
            elif self.ttl_s > 0:
                ttl = self.ttl_s
            else:
                continue
            horizon = now - ttl
            own, confirmed = n.blocks, n.precise   # time 0.0: confirmed by events
            lo, hi = 0, depth                      # the first lo blocks are valid
            while lo < hi:
                mid = (lo + hi + 1) // 2
                t = own.get(hashes[mid - 1])
                if t is not None and (t >= horizon or (confirmed and t == 0.0)):
                    lo = mid
                else:
                    hi = mid - 1
            if lo:
                out[node_id] = lo
            else:
                del out[node_id]

    def node_blocks(self, node_id: str) -> int:
        n = self._nodes.get(node_id)
        return len(n.blocks) if n is not None else 0

    def known_blocks(self, node_id: str) -> int | None:
        """Blocks indexed for ``node_id``; None when the index has never heard of it."""
        n = self._nodes.get(node_id)
        return len(n.blocks) if n is not None else None

    def nodes(self) -> Mapping[str, int]:
        """Node id -> blocks indexed for it."""
        return {k: len(v.blocks) for k, v in self._nodes.items()}

    def last_seq(self, node_id: str) -> int:
        n = self._nodes.get(node_id)
        return n.seq if n is not None else 0

    def awaiting_snapshot(self, node_id: str) -> bool:
        n = self._nodes.get(node_id)
        return n is not None and n.awaiting

    def is_precise(self, node_id: str) -> bool:
        n = self._nodes.get(node_id)
        return n is not None and n.precise

    def epoch(self, node_id: str) -> int:
        """The newest engine epoch seen for the node (0 = none)."""
        return self._epochs.get(node_id, 0)

    # --- writes --------------------------------------------------------------------------

    def _node(self, node_id: str, precise: bool) -> _Node:
        n = self._nodes.get(node_id)
        if n is None:
            slot = self._free_slots.pop() if self._free_slots else self._next_slot
            if slot == self._next_slot:
                self._next_slot += 1
            n = self._nodes[node_id] = _Node(slot, precise)
            self._by_slot[slot] = node_id
        elif precise and not n.precise:
            self._clear(n)
            n.precise = True
        return n

    def add(self, node_id: str, hashes: Iterable[int], now: float = 0.0,
            precise: bool = True) -> None:
        """The node holds these blocks: ``precise`` (its events; they confirm pending ones),
        or the router's record at ``now`` > 0 (approximate; pending on a precise node)."""
        n = self._node(node_id, precise)
        bit = 1 << n.slot
        blocks, own, pending = self._blocks, n.blocks, n.pending
        if precise:
            for h in hashes:
                t = own.get(h)
                if t is None:
                    own[h] = 0.0
                    blocks[h] = blocks.get(h, 0) | bit
                    self.entries += 1
                elif t:
                    own[h] = 0.0
                    pending.pop(h, None)
        else:
            for h in hashes:
                t = own.get(h)
                if t is None:
                    own[h] = now
                    blocks[h] = blocks.get(h, 0) | bit
                    self.entries += 1
                    if n.precise:
                        pending[h] = now
                elif not n.precise:
                    del own[h]   # re-dated: moves to the newest end
                    own[h] = now
                elif t:
                    own[h] = now
                    del pending[h]
                    pending[h] = now
        if self.entries > self.max_entries:
            self._shed(n, self.entries - self.max_entries)

    def remove(self, node_id: str, hashes: Iterable[int]) -> None:
        n = self._nodes.get(node_id)
        if n is None:
            return
        self._drop(n, [h for h in hashes if h in n.blocks])

    def _drop(self, n: _Node, hashes: Iterable[int]) -> None:
        keep = ~(1 << n.slot)
        blocks, own, pending = self._blocks, n.blocks, n.pending
        for h in hashes:
            if own.pop(h):
                pending.pop(h, None)
            rest = blocks[h] & keep
            if rest:
                blocks[h] = rest
            else:
                del blocks[h]
            self.entries -= 1

    def _shed(self, n: _Node, count: int) -> None:
        it = iter(n.blocks)
        self._drop(n, [next(it) for _ in range(min(count, len(n.blocks)))])

    def expire(self, now: float) -> int:
        """Drops approximate entries older than ``ttl_s`` and pending ones older than
        ``pending_ttl_s``; returns how many (housekeeping: ``match`` already ignores them)."""
        dropped = 0
        for n in self._nodes.values():
            if n.precise:
                record, horizon = n.pending, now - self.pending_ttl_s
            elif self.ttl_s > 0:
                record, horizon = n.blocks, now - self.ttl_s
            else:
                continue
            old = []
            for h, t in record.items():
                if t >= horizon:
                    break
                old.append(h)
            self._drop(n, old)
            dropped += len(old)
        return dropped

    def _clear(self, n: _Node) -> None:
        self._drop(n, list(n.blocks))

    def clear_node(self, node_id: str) -> None:
        """The node's cache was cleared (AllBlocksCleared): it holds nothing now."""
        n = self._nodes.get(node_id)
        if n is not None:
            self._clear(n)

    def replace(self, node_id: str, hashes: Iterable[int], seq: int) -> None:
        """A snapshot: the node holds exactly these blocks as of event batch ``seq``."""
        n = self._node(node_id, True)
        self._clear(n)
        self.add(node_id, hashes)
        n.seq = seq
        n.awaiting = False

    def advance(self, node_id: str, seq: int) -> None:
        """Event batch ``seq`` of a precise node is being applied."""
        self._nodes[node_id].seq = seq

    def lost_track(self, node_id: str) -> None:
        """A gap in a precise node's updates: its blocks are dropped until a snapshot."""
        n = self._node(node_id, True)
        self._clear(n)
        n.awaiting = True

    def observe_epoch(self, node_id: str, epoch: int) -> bool:
        """The node reports engine epoch ``epoch`` (0 = unknown: always current). A newer one
        than seen before drops every block indexed for the node; returns False for an older
        one (the caller ignores what came with it)."""
        if not epoch:
            return True
        known = self._epochs.get(node_id, 0)
        if epoch < known:
            self.stale_updates += 1
            return False
        if epoch > known:
            self._epochs[node_id] = epoch
            n = self._nodes.get(node_id)
            if n is not None and n.blocks:
                self._clear(n)
        return True

    def forget(self, node_id: str) -> None:
        """The node left the fleet."""
        self._epochs.pop(node_id, None)
        n = self._nodes.pop(node_id, None)
        if n is None:
            return
        self._clear(n)
        del self._by_slot[n.slot]
        self._free_slots.append(n.slot)


@dataclass(slots=True, eq=False)
class PrefixIndexes:
    """The per-model indexes of one router (``PrefixIndex`` each, with these limits), created
    on first use."""

    max_entries: int = 4_000_000
    ttl_s: float = 120.0
    pending_ttl_s: float = 5.0
    _models: dict[str, PrefixIndex] = field(init=False, default_factory=dict)

    def model(self, name: str) -> PrefixIndex:
        ix = self._models.get(name)
        if ix is None:
            ix = self._models[name] = PrefixIndex(self.max_entries, self.ttl_s,
                                                  self.pending_ttl_s)
        return ix

    def get(self, name: str) -> PrefixIndex | None:
        return self._models.get(name)

    def forget(self, node_id: str) -> None:
        for ix in self._models.values():
            ix.forget(node_id)

    def observe_epoch(self, node_id: str, epoch: int) -> None:
        """A node's heartbeat carries engine epoch ``epoch``: a newer one drops what every
        model's index holds for the node (``PrefixIndex.observe_epoch``)."""
        for ix in self._models.values():
            ix.observe_epoch(node_id, epoch)

    def expire(self, now: float) -> int:
        return sum(ix.expire(now) for ix in self._models.values())
