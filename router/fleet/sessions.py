"""Session affinity's memory: which node served each routing key last.

``SessionTable`` maps (model, ``GenerateRequest.routing_key``) to the node the router last
dispatched that key to. The prediction (``scheduling.predictor``) counts that node, read from
here as ``RequestInfo.session_node``, as an expected prefix hit, and the policy keeps the
request there while its prediction is as good as the best within resolution
(``policies.predicted``). It is the only state affinity has.

Bounded, least recently used first out:

- At most ``max_keys`` entries; inserting beyond evicts the least recently used key.
- An entry unused for ``ttl_s`` seconds is gone (read as absent, and dropped when met).
- Keys are stored as a 64-bit BLAKE2b digest of model and key, not the key itself, so an entry
  costs the same whatever the client sends (the digest, the node id shared with the fleet,
  a timestamp, and the dict's and LRU's links). Two keys colliding (chance ~ n^2 / 2^65) only
  share a preference.

Who calls it: the dispatcher, once per routing decision (``lookup`` before, ``remember`` after
the node is chosen, so a retry elsewhere moves the session too). A key whose node left the
fleet stays until it ages out or is overwritten: that node is simply not a candidate. Not
thread-safe: one event loop. Times are the injected clock's (seconds, monotonic).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable


def session_digest(model: str, routing_key: str) -> int:
    """The table's key for (model, routing_key): 64 bits of BLAKE2b over both."""
    h = hashlib.blake2b(digest_size=8)
    h.update(model.encode())
    h.update(b"\x00")
    h.update(routing_key.encode())
    return int.from_bytes(h.digest(), "little")


class SessionTable:
    """(model, routing key) -> last node, LRU and TTL bounded (module doc)."""

    __slots__ = ("_clock", "_entries", "evictions", "max_keys", "ttl_s")

    def __init__(self, max_keys: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_keys < 0 or ttl_s <= 0:
            raise ValueError("max_keys must be >= 0 and ttl_s > 0")
        self.max_keys = max_keys
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self.evictions = 0   # entries dropped for room (not for age)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, model: str, routing_key: str) -> str:
        """The node that served this key last, or "" (no key, unknown, or expired)."""
        if not routing_key or self.max_keys == 0:
            return ""
        d = session_digest(model, routing_key)
        hit = self._entries.get(d)
        if hit is None:
            return ""
        node, at = hit
        if self._clock() - at > self.ttl_s:
            del self._entries[d]
            return ""
        return node

    def remember(self, model: str, routing_key: str, node_id: str) -> None:
        """Records that ``node_id`` now serves the key (refreshing its age and LRU place)."""
        if not routing_key or self.max_keys == 0:
            return
        d = session_digest(model, routing_key)
        entries = self._entries
        entries[d] = (node_id, self._clock())
        entries.move_to_end(d)
        while len(entries) > self.max_keys:
            entries.popitem(last=False)
            self.evictions += 1
