"""The simulated engine's prefix cache, modelled on vLLM's automatic prefix caching.

The KV cache is paged in blocks of ``kv_block_size`` tokens. A FULL prompt block, once
computed, is kept under its chained hash (``gpumesh.kvblocks``) with a reference count: the
requests using it. A new request looks up its prompt's hash chain; the leading blocks found
are shared with it and skip prefill (at least one prompt token is always computed, as vLLM
recomputes the last token of a fully cached prompt). When a request ends, its cached blocks
lose a reference; a block no request uses stays cached but counts as free, and is evicted
least-recently-freed first when the scheduler needs empty blocks (vLLM frees a request's
blocks tail first, so a chain's tail goes before its head). Two requests that compute the
same block at once keep one copy cached, the other private (as vLLM does).

Accounting contract with ``SimScheduler``: its ``free`` block count includes the evictable
cached blocks here; ``acquire`` and ``release`` return how many blocks move out of / into that
free count; ``make_room(n)`` evicts until n of the free blocks are empty.

Every change is reported to ``sink`` (when set) as vLLM's KV events are: ``stored(hashes)``,
``removed(hashes)``, ``cleared()`` (``gpumesh.node.cache`` relays them to routers). The hit
rate is over the last ``HIT_WINDOW`` lookups, as vLLM's ``prefix_cache_hit_rate`` metric is.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from gpumesh.node.engines.base import KvEventSink

HIT_WINDOW = 1000   # lookups in the hit-rate window (vLLM's CachingMetrics default)


class PrefixCache:
    """Cached blocks by hash: reference counts, and the LRU order of the unreferenced ones."""

    __slots__ = ("_hits", "_lru", "_queries", "_recent", "_refs", "hit_tokens", "query_tokens",
                 "sink", "block_size")

    def __init__(self, block_size: int, sink: KvEventSink | None = None) -> None:
        self.block_size = block_size
        self.sink = sink
        self._refs: dict[int, int] = {}                 # hash -> requests using the block
        self._lru: OrderedDict[int, None] = OrderedDict()  # refcount 0, oldest first
        self._recent: deque[tuple[int, int]] = deque()  # (query, hit) tokens per lookup
        self._queries = 0   # sums over _recent
        self._hits = 0
        self.query_tokens = 0   # cumulative, since start
        self.hit_tokens = 0

    # --- lookups -------------------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are cached (no state change)."""
        refs = self._refs
        n = 0
        for h in hashes:
            if h not in refs:
                break
            n += 1
        return n

    def record_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        """Counts one request's lookup in the hit rate (tokens asked, tokens found)."""
        self.query_tokens += prompt_tokens
        self.hit_tokens += hit_tokens
        r = self._recent
        r.append((prompt_tokens, hit_tokens))
        self._queries += prompt_tokens
        self._hits += hit_tokens
        if len(r) > HIT_WINDOW:
            q, h = r.popleft()
            self._queries -= q
            self._hits -= h

    @property
    def hit_rate(self) -> float:
        """Hit tokens / queried tokens over the last ``HIT_WINDOW`` lookups (0 before any)."""
        return self._hits / self._queries if self._queries > 0 else 0.0

    # --- references ----------------------------------------------------------------------

    def acquire(self, hashes: Iterable[int]) -> int:
        """A request takes a reference on each (cached) block; returns how many of them were
        unreferenced, i.e. leave the scheduler's free count."""
        refs, lru = self._refs, self._lru
        taken = 0
        for h in hashes:
            n = refs[h]
            if n == 0:
                del lru[h]
                taken += 1
            refs[h] = n + 1
        return taken

    def insert(self, h: int) -> bool:
        """A request computed a full block: cache it with one reference (True), or, when that
        hash is cached already, leave it the request's private block (False)."""
        if h in self._refs:
            return False
        self._refs[h] = 1
        if self.sink is not None:
            self.sink.stored((h,))
        return True

    def release(self, hashes: Sequence[int]) -> int:
        """A request drops its references (tail first); returns how many blocks became
        unreferenced, i.e. join the scheduler's free count (still cached, evictable)."""
        refs, lru = self._refs, self._lru
        freed = 0
        for h in reversed(hashes):
            n = refs.get(h)
            if n is None:
                continue
            if n <= 1:
                refs[h] = 0
                lru[h] = None
                freed += 1
            else:
                refs[h] = n - 1
        return freed

    # --- eviction ------------------------------------------------------------------------

    @property
    def evictable(self) -> int:
        """Cached blocks no request uses (part of the scheduler's free count)."""
        return len(self._lru)

    @property
    def cached_blocks(self) -> int:
        return len(self._refs)

    def make_room(self, free_blocks: int, need: int) -> None:
        """Evicts least-recently-freed blocks until ``need`` of the scheduler's
        ``free_blocks`` are empty (free minus evictable)."""
        excess = need - (free_blocks - len(self._lru))
        if excess <= 0:
            return
        lru, refs = self._lru, self._refs
        gone: list[int] = []
        while excess > 0 and lru:
            h, _ = lru.popitem(last=False)
            del refs[h]
            gone.append(h)
            excess -= 1
        if gone and self.sink is not None:
            self.sink.removed(gone)

    def clear(self) -> int:
        """Drops every unreferenced block (vLLM's reset_prefix_cache); returns how many."""
        gone = list(self._lru)
        for h in gone:
            del self._refs[h]
        self._lru.clear()
        if self.sink is not None:
            if self._refs:
                self.sink.removed(gone)
            else:
                self.sink.cleared()
        return len(gone)

    def hashes(self) -> list[int]:
        """Every cached block's hash (a snapshot for a subscriber that (re)connects)."""
        return list(self._refs)
