"""Per-key fair queuing (router.dispatch.fairqueue): round robin between keys, FIFO within
one, a full line shared fairly."""

from __future__ import annotations

from dataclasses import dataclass

from gpumesh.router.dispatch.fairqueue import FairQueue


@dataclass(eq=False)
class W:
    key: str
    n: int


def drain(q: FairQueue[W]) -> list[tuple[str, int]]:
    out = []
    while (w := q.peek()) is not None:
        assert q.pop() is w
        out.append((w.key, w.n))
    return out


def test_one_key_is_plain_fifo() -> None:
    q: FairQueue[W] = FairQueue(10)
    for i in range(4):
        assert q.push(W("", i)) == (True, None)
    assert drain(q) == [("", 0), ("", 1), ("", 2), ("", 3)]


def test_a_burst_does_not_starve_another_key() -> None:
    q: FairQueue[W] = FairQueue(100)
    for i in range(20):
        q.push(W("burst", i))
    q.push(W("quiet", 0))
    q.push(W("quiet", 1))
    order = drain(q)
    assert order[:4] == [("burst", 0), ("quiet", 0), ("burst", 1), ("quiet", 1)]
    assert [n for k, n in order if k == "burst"] == list(range(20))   # FIFO within a key


def test_full_line_displaces_the_heaviest_keys_newest() -> None:
    q: FairQueue[W] = FairQueue(4)
    for i in range(4):
        assert q.push(W("burst", i))[0]
    ok, displaced = q.push(W("quiet", 0))
    assert ok and displaced is not None and (displaced.key, displaced.n) == ("burst", 3)
    assert q.push(W("burst", 9)) == (False, None)   # over its share: refused itself
    ok, displaced = q.push(W("quiet", 1))
    assert ok and displaced is not None and displaced.n == 2
    assert q.push(W("quiet", 2)) == (False, None)   # now at its share (4 / 2 keys)
    assert len(q) == 4 and q.queued("burst") == 2 and q.queued("quiet") == 2


def test_remove_and_contains() -> None:
    q: FairQueue[W] = FairQueue(4)
    a, b = W("k", 0), W("k", 1)
    q.push(a)
    q.push(b)
    assert a in q and q.remove(a) and a not in q and not q.remove(a)
    assert len(q) == 1 and q.peek() is b


async def test_quiet_key_is_served_through_another_keys_burst(tmp_path) -> None:
    """One node taking 1 request at a time; key "burst" queues 12 streams, then key "quiet"
    sends one: it is served second-next (round robin), not after the whole burst."""
    import asyncio

    from gpumesh.client import MeshClient, build_request
    from gpumesh.router.auth.keys import entry_toml
    from tests.router.test_router_grpc import fleet

    keys = tmp_path / "keys.toml"
    keys.write_text(entry_toml("burst", "k-burst") + entry_toml("quiet", "k-quiet"))
    async with fleet({"node_id": "a", "max_concurrency": 1, "token_s": 0.05},
                     api_keys_file=str(keys), queue_bound=64) as f:
        addr = f.router.address
        done: list[str] = []
        async with MeshClient(addr, api_key="k-burst") as burst, \
                MeshClient(addr, api_key="k-quiet") as quiet:
            async def one(client: MeshClient, who: str) -> None:
                async for _ in client.stream(build_request("x", max_tokens=5), timeout=60):
                    pass
                done.append(who)

            tasks = [asyncio.create_task(one(burst, "burst")) for _ in range(12)]
            await asyncio.sleep(0.3)   # the burst is queued
            tasks.append(asyncio.create_task(one(quiet, "quiet")))
            await asyncio.gather(*tasks)
        # FIFO would serve it last (13th); round robin right after the one running and the
        # burst key's next turn
        assert done.index("quiet") <= 4, done
