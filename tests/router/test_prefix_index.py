"""The router's prefix index and locality: matching, precise updates with gaps and snapshots,
approximate records that age out, the memory bound."""

from __future__ import annotations

from gpumesh.kvblocks import block_hashes
from gpumesh.router.fleet.locality import PrefixLocality
from gpumesh.router.fleet.prefix_index import PrefixIndex, PrefixIndexes
from gpumesh.router.scheduling.types import RequestInfo
from gpumesh.router.tokenizers import RouterTokenizers
from gpumesh.v1 import control_pb2, inference_pb2

A = block_hashes(list(range(160)))                 # 10 blocks
B = block_hashes(list(range(96)) + [1] * 64)       # shares A's first 6


def test_match_depth_per_node() -> None:
    ix = PrefixIndex()
    ix.add("n1", A)
    ix.add("n2", A[:3])
    ix.add("n3", B)
    assert ix.match(A) == {"n1": 10, "n2": 3, "n3": 6}
    assert ix.match(B) == {"n1": 6, "n2": 3, "n3": 10}
    assert ix.match(block_hashes(list(range(1, 161)))) == {}
    ix.forget("n1")
    assert ix.match(A) == {"n2": 3, "n3": 6}
    ix.add("n4", A)     # takes n1's slot again
    assert ix.match(A)["n4"] == 10 and ix.entries == 3 + 10 + 10


def test_an_evicted_tail_ends_the_match() -> None:
    ix = PrefixIndex()
    ix.add("n", A)
    ix.add("m", A[:7])
    ix.remove("n", A[4:])
    assert ix.match(A) == {"n": 4, "m": 7}
    ix.remove("n", A[:1])               # the head gone: nothing of the chain counts
    assert ix.match(A) == {"m": 7}


def test_memory_bound_drops_the_adding_nodes_oldest() -> None:
    ix = PrefixIndex(max_entries=12)
    ix.add("n1", A)
    ix.add("n2", B[:4])
    assert ix.entries == 12
    assert ix.match(A) == {"n1": 10}
    assert ix.match(B) == {"n1": 6}   # n2 lost its 2 oldest blocks: its chain is broken


def test_approximate_entries_age_out() -> None:
    ix = PrefixIndex(ttl_s=10.0)
    ix.add("n", A[:5], now=0.0, precise=False)
    ix.add("n", A, now=8.0, precise=False)          # re-dates the first 5 too
    assert ix.match(A, now=15.0) == {"n": 10}
    assert ix.match(A, now=19.0) == {}
    assert ix.expire(19.0) == 10 and ix.entries == 0


def update(seq: int, **kw: object) -> control_pb2.KvCacheUpdate:
    return control_pb2.KvCacheUpdate(model="m", seq=seq, block_size=16, **kw)  # type: ignore[arg-type]


def test_precise_updates_gap_and_snapshot() -> None:
    loc = PrefixLocality("auto", PrefixIndexes(), clock=lambda: 0.0)
    assert loc.apply("n", update(1, snapshot=True, stored=A[:4])) is None
    assert loc.apply("n", update(2, stored=A[4:])) is None
    ix = loc.indexes.model("m")
    assert ix.match(A) == {"n": 10}
    assert loc.apply("n", update(3, removed=A[8:])) is None
    assert ix.match(A) == {"n": 8}
    assert loc.apply("n", update(5, stored=A[8:])) == "m"    # seq 4 lost: ask for a snapshot
    assert ix.match(A) == {} and loc.gaps == 1
    assert loc.apply("n", update(6, stored=A)) is None        # ignored until the snapshot
    assert loc.apply("n", update(7, snapshot=True, stored=B)) is None
    assert ix.match(B) == {"n": 10}
    assert loc.apply("n", update(8, cleared=True, stored=A[:2])) is None
    assert ix.match(A) == {"n": 2}
    # another block size cannot match our hashes: ignored
    assert loc.apply("n2", control_pb2.KvCacheUpdate(model="m", seq=1, snapshot=True,
                                                      block_size=32, stored=A)) is None
    assert "n2" not in ix.match(A)


def test_annotate_and_approximate_routing() -> None:
    now = [1.0]
    loc = PrefixLocality("auto", PrefixIndexes(ttl_s=60.0, pending_ttl_s=5.0),
                         clock=lambda: now[0])
    info = RequestInfo("m", 170, prefix_hashes=tuple(A))
    assert loc.annotate(info).cached_tokens == {}
    loc.routed(info, "n1")                      # no events from n1: the router's record
    loc.apply("n2", update(1, snapshot=True, stored=A[:5]))
    loc.routed(info, "n2")                      # n2 streams events: pending until confirmed
    got = loc.annotate(info).cached_tokens
    assert dict(got) == {"n1": 160, "n2": 160}
    now[0] = 7.0
    assert dict(loc.annotate(info).cached_tokens) == {"n1": 160, "n2": 80}
    now[0] = 62.0
    assert dict(loc.annotate(info).cached_tokens) == {"n2": 80}
    precise = PrefixLocality("precise", PrefixIndexes(), clock=lambda: 1.0)
    precise.routed(info, "n1")                  # precise: no record for a node without events
    assert precise.annotate(info).cached_tokens == {}
    off = PrefixLocality("off", PrefixIndexes(), clock=lambda: 0.0)
    assert off.annotate(info) is info


async def test_hashes_from_token_ids_and_sim_text() -> None:
    tokenizers = RouterTokenizers(engine_of=lambda model: "sim")
    loc = PrefixLocality("auto", PrefixIndexes(), clock=lambda: 0.0, tokenizers=tokenizers)
    req = inference_pb2.GenerateRequest(model="m", token_ids=inference_pb2.TokenIds(
        ids=list(range(160))))
    assert await loc.hashes(req, "m") == (160, tuple(A))
    from gpumesh.node.engines.sim import SimEngine
    text = "the same long system prompt " * 40
    want = block_hashes(SimEngine().tokenize(text))
    n, got = await loc.hashes(inference_pb2.GenerateRequest(model="m", text=text), "m")
    assert got == tuple(want) and len(got) > 5 and n == len(SimEngine().tokenize(text))
    tokenizers.close()


async def test_an_adapters_prefix_is_its_own() -> None:
    """The same prompt under two LoRA adapters and the base model hashes to three disjoint
    chains (the engine keys adapter blocks apart), so a node that served it under one adapter
    is no holder for the others."""
    tokenizers = RouterTokenizers(engine_of=lambda model: "sim")
    loc = PrefixLocality("auto", PrefixIndexes(), clock=lambda: 0.0, tokenizers=tokenizers)
    ids = inference_pb2.TokenIds(ids=list(range(160)))
    chains = {}
    for adapter in ("", "alpha", "beta"):
        req = inference_pb2.GenerateRequest(model="m", token_ids=ids, adapter=adapter)
        n, chains[adapter] = await loc.hashes(req, "m")
        assert n == 160 and len(chains[adapter]) == 10
    assert chains[""] == tuple(A)
    assert len(set(chains[""]) | set(chains["alpha"]) | set(chains["beta"])) == 30
    loc.routed(RequestInfo("m", 160, prefix_hashes=chains["alpha"]), "lv")
    assert dict(loc.annotate(RequestInfo("m", 160, prefix_hashes=chains["alpha"]))
                .cached_tokens) == {"lv": 160}
    assert loc.annotate(RequestInfo("m", 160, prefix_hashes=chains["beta"])).cached_tokens == {}
    tokenizers.close()


def test_sampled_decisions_include_the_holders() -> None:
    import random

    from gpumesh.router.fleet import Registry
    from gpumesh.router.scheduling import (
        RoutingSettings,
        build_policy,
        default_filters,
        select_from,
    )
    from gpumesh.types import LoadReport, ModelSpec, Registration

    reg = Registry("rt", lease_ttl_s=30.0, freshness_s=30.0, max_concurrency_default=0,
                   known_model_retention_s=60.0, clock=lambda: 100.0)
    for i in range(64):
        nid = f"n{i:02d}"
        reg.register(Registration(nid, f"h:{i}", (ModelSpec("m", (), 8192, 1, 1.0),), "x"), i)
        reg.heartbeat(nid, i, 1, 0, LoadReport(num_running=2, prefill_capacity_tokens_per_s=1e4,
                                              kv_capacity_tokens=10**6))
    profile = build_policy(RoutingSettings(policy="predicted_latency"))
    info = RequestInfo("m", 4200, prefix_hashes=tuple(A), cached_tokens={"n37": 4000})
    rng = random.Random(0)
    picks = {select_from(profile, reg.candidate_source("m"), info, rng,
                         default_filters(0.99), sample_size=4).node_id for _ in range(20)}
    assert picks == {"n37"}
    plain = RequestInfo("m", 4200)
    assert len({select_from(profile, reg.candidate_source("m"), plain, rng,
                            default_filters(0.99), sample_size=4).node_id
                for _ in range(20)}) > 1


def test_pending_entries_until_events_confirm_them() -> None:
    ix = PrefixIndex(pending_ttl_s=5.0)
    ix.add("n", A[:2])                                  # events: n is precise
    ix.add("n", A, now=10.0, precise=False)             # the router sent A there
    assert ix.match(A, now=12.0) == {"n": 10}
    assert ix.match(A, now=16.0) == {"n": 2}            # unconfirmed blocks lapse
    ix.add("n", A[2:6])                                 # events confirm four of them
    assert ix.match(A, now=16.0) == {"n": 6}
    assert ix.expire(16.0) == 4 and ix.entries == 6
    ix.add("n", A, now=20.0, precise=False)
    ix.remove("n", A[6:])                               # evicted before confirmation
    assert ix.match(A, now=21.0) == {"n": 6} and ix.entries == 6
