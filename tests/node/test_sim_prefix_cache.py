"""The simulated engine's prefix cache: shared prefixes skip prefill, LRU eviction, events."""

from __future__ import annotations

import dataclasses

from gpumesh.kvblocks import block_hashes, chain_hash
from gpumesh.node.engines.base import EngineRequest, Sampling
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig
from gpumesh.node.engines.sim.prefix_cache import PrefixCache

FAST = SimEngineConfig(time_scale=0.0)


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[str, tuple[int, ...]]] = []

    def stored(self, hashes: object) -> None:
        self.events.append(("stored", tuple(hashes)))  # type: ignore[arg-type]

    def removed(self, hashes: object) -> None:
        self.events.append(("removed", tuple(hashes)))  # type: ignore[arg-type]

    def cleared(self) -> None:
        self.events.append(("cleared", ()))


def test_hash_chain_is_prefix_consistent() -> None:
    a = block_hashes(list(range(100)))
    b = block_hashes(list(range(64)) + [7] * 36)
    assert len(a) == 6 and len(b) == 6          # full blocks only
    assert a[:4] == b[:4] and a[4] != b[4]       # equal up to the first differing block
    assert a[1] == chain_hash(a[0], range(16, 32))
    assert block_hashes(list(range(100)), seed=1)[0] != a[0]
    assert block_hashes(list(range(100)), limit=2) == a[:2]


def test_refcounts_and_lru_eviction() -> None:
    sink = Sink()
    c = PrefixCache(16, sink)
    assert c.insert(1) and c.insert(2) and not c.insert(1)
    assert c.match([1, 2, 3]) == 2
    assert c.release([1, 2]) == 2 and c.evictable == 2
    assert c.acquire([1]) == 1 and c.evictable == 1
    c.make_room(free_blocks=2, need=2)            # one empty + one evictable: evict block 2
    assert c.match([1, 2]) == 1
    assert sink.events == [("stored", (1,)), ("stored", (2,)), ("removed", (2,))]


async def _run(eng: SimEngine, rid: str, ids: tuple[int, ...]) -> None:
    async for _ in eng.generate(EngineRequest(rid, ids, Sampling(max_tokens=2, ignore_eos=True))):
        pass


async def test_shared_prefix_skips_prefill_and_reports_hit_rate() -> None:
    eng = SimEngine(FAST)
    await eng.start()
    try:
        system = tuple(range(1, 4001))
        await _run(eng, "a", system + (9, 9, 9))
        first = eng.stats.prefill_tokens
        await _run(eng, "b", system + (5, 5, 5, 5))
        second = eng.stats.prefill_tokens - first
        assert first >= 4003
        assert second < 40                       # 4000 cached tokens (250 blocks) skipped
        load = eng.load()
        assert 0.45 < load.prefix_cache_hit_rate < 0.5   # 4000 of 8007 tokens
        assert eng.free_kv_blocks == eng.load().kv_capacity_tokens // 16   # all freed
    finally:
        await eng.shutdown()


async def test_off_and_eviction_under_pressure() -> None:
    off = SimEngine(dataclasses.replace(FAST, prefix_caching=False))
    small = SimEngine(dataclasses.replace(FAST, kv_capacity_tokens=8704, max_context_length=8704))
    await off.start()
    await small.start()
    try:
        p = tuple(range(1, 2001))
        await _run(off, "a", p)
        await _run(off, "b", p)
        assert off.stats.prefill_tokens >= 4000 and off.load().prefix_cache_hit_rate == 0.0
        for i in range(8):   # 8 distinct 2000-token prompts through a 544-block cache
            await _run(small, f"r{i}", tuple(range(i * 5000 + 1, i * 5000 + 2001)))
        assert small.prefix is not None
        assert small.prefix.cached_blocks <= 544
        before = small.stats.prefill_tokens
        await _run(small, "again", tuple(range(7 * 5000 + 1, 7 * 5000 + 2001)))  # newest: kept
        assert small.stats.prefill_tokens - before < 20
        before = small.stats.prefill_tokens
        await _run(small, "old", tuple(range(1, 2001)))                            # evicted
        assert small.stats.prefill_tokens - before >= 2000
    finally:
        await off.shutdown()
        await small.shutdown()
