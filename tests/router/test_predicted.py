"""The predictive policy (``predicted_latency``): the predictor's terms table-driven over
in-memory candidates, each objective, determinism across replicas, and an end-to-end check
through a real router over real gRPC that a prefix holder and a session's node win by the
prediction where least_request would send the request elsewhere."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from gpumesh.router.scheduling import (
    Candidate,
    ListCandidates,
    NodeState,
    RequestInfo,
    RoutingSettings,
    build_policy,
    default_filters,
    select,
    select_from,
)
from gpumesh.router.scheduling.policies.predicted import PredictedLatency, builtin_profile_for
from gpumesh.router.scheduling.predictor import StepCost, predict, prefix_keeper, step_cost
from gpumesh.router.scheduling.filters import whole_request
from gpumesh.types import LoadReport, StepModel
from gpumesh.v1 import inference_pb2
from tests.router.test_router_grpc import fleet, wait_for

COST = StepCost(a_s=0.01, decode_s=0.001, prefill_s=0.0001, budget=1000, source="fitted")
KW: dict[str, Any] = {"out": 10, "best_held": 0, "out_default": 100, "adapter_load_s": 2.0}


def cand(node_id: str = "n", *, running: int = 0, pending: int = 0, waiting: int = 0,
         kv: float = 0.0, kv_cap: int = 0, weight: float = 1.0, loaded: tuple[str, ...] = (),
         unreported: int = 0, unreported_n: int = 0, outstanding_n: int = 0,
         scale: float = 1.0, role: str = "both", step_model: StepModel | None = None,
         capacity: float = 0.0, step_s: float = 0.0, stale: bool = False,
         in_flight: int = 0, out_mean: float = 0.0) -> Candidate:
    report = None if stale else LoadReport(
        num_running=running, num_waiting=waiting, pending_prefill_tokens=pending,
        kv_cache_usage=kv, kv_capacity_tokens=kv_cap, loaded_adapters=loaded,
        prefill_capacity_tokens_per_s=capacity, step_model=step_model,
        output_tokens_mean=out_mean)
    return Candidate(node_id=node_id, address=f"{node_id}:1",
                     state=NodeState.STALE if stale else NodeState.HEALTHY,
                     capacity_weight=weight, max_concurrency=0, report=report,
                     report_age_s=0.1, kv_cache_usage=kv, router_in_flight=in_flight,
                     outstanding_prompt_tokens=unreported, outstanding_requests=outstanding_n,
                     unreported_prompt_tokens=unreported, unreported_requests=unreported_n,
                     decode_delta=unreported_n, step_s=step_s, prediction_scale=scale,
                     role=role, adapters=("lora",))


# (candidate, request, expected ttft_s, expected completion_s, expected imposed_s)
# step = a + b_decode * R; ttft = (0.5 + ceil(work / chunk)) * step + b_prefill * work
CASES = [
    ("idle", cand(), RequestInfo("m", 100),
     1.5 * 0.01 + 0.0001 * 100, None, 0.0),
    ("queue ahead", cand(pending=1900), RequestInfo("m", 100),
     2.5 * 0.01 + 0.0001 * 2000, None, 0.0),
    ("unreported work counts", cand(pending=900, unreported=1000, unreported_n=1),
     RequestInfo("m", 100), 3.5 * 0.011 + 0.0001 * 2000, None, 1 * 0.0001 * 100 + 0.001 * 10),
    ("running streams lengthen steps and pay the prefill", cand(running=4),
     RequestInfo("m", 100), 1.5 * 0.014 + 0.0001 * 100, None, 4 * 0.0001 * 100 + 4 * 0.001 * 10),
    ("a holder prefills the rest only", cand("h"),
     RequestInfo("m", 1000, cached_tokens={"h": 900}), 1.5 * 0.01 + 0.0001 * 100, None, 0.0),
    ("a session's node is an expected hit", cand("s"),
     RequestInfo("m", 1000, session_node="s"), 1.5 * 0.01 + 0.0001 * 500, None, 0.0),
    ("an adapter not loaded costs its load", cand(),
     RequestInfo("m", 100, adapter="lora"), 1.5 * 0.01 + 0.0001 * 100 + 2.0, None, 0.0),
    ("a loaded adapter costs nothing", cand(loaded=("lora",)),
     RequestInfo("m", 100, adapter="lora"), 1.5 * 0.01 + 0.0001 * 100, None, 0.0),
    ("prediction_scale multiplies the ttft", cand(scale=2.0), RequestInfo("m", 100),
     2 * (1.5 * 0.01 + 0.0001 * 100), None, 0.0),
    ("stale: this router's own counts", cand(stale=True, in_flight=2, unreported=400),
     RequestInfo("m", 100), 1.5 * 0.012 + 0.0001 * 500, None, 2 * 0.0001 * 100 + 2 * 0.001 * 10),
]


@pytest.mark.parametrize("name, c, req, ttft, completion, imposed", CASES,
                         ids=[c[0] for c in CASES])
def test_prediction_terms(name: str, c: Candidate, req: RequestInfo, ttft: float,
                          completion: float | None, imposed: float) -> None:
    p = predict(c, req, COST, **KW)
    assert p.ttft_s == pytest.approx(ttft)
    running = c.report.num_running + c.unreported_requests if c.report else c.router_in_flight
    assert p.completion_s == pytest.approx(ttft + 10 * (0.01 + 0.001 * (running + 1)))
    assert p.imposed_s == pytest.approx(imposed)


def test_a_miss_pays_the_eviction_of_a_prefix_held_elsewhere() -> None:
    req = RequestInfo("m", 1000, cached_tokens={"h": 900})
    miss = predict(cand("o"), req, COST, **{**KW, "best_held": 900})
    hit = predict(cand("h"), req, COST, **{**KW, "best_held": 900})
    assert miss.imposed_s == pytest.approx(0.0001 * 900) and hit.imposed_s == 0.0
    assert miss.ttft_s - hit.ttft_s == pytest.approx(0.0001 * 900)


def test_a_copy_costs_others_hits_only_where_its_stores_evict() -> None:
    """The eviction terms count only what the request's stores (its uncached prompt and its
    output) push out of the node's prefix cache: nothing where the cache has room, all of
    the copy where it is full, and all of it where the index does not know the node."""
    kw = {**KW, "best_held": 900}
    base = {"cached_tokens": {"h": 900}}
    # 10,000 KV tokens; the request stores 1,000 - 0 + 10 output on "o"
    roomy = RequestInfo("m", 1000, **base, indexed_tokens={"o": 2_000})
    tight = RequestInfo("m", 1000, **base, indexed_tokens={"o": 9_500})
    full = RequestInfo("m", 1000, **base, indexed_tokens={"o": 10_000})
    unknown = RequestInfo("m", 1000, **base)
    o = cand("o", kv_cap=10_000)
    assert predict(o, roomy, COST, **kw).imposed_s == 0.0
    assert predict(o, tight, COST, **kw).imposed_s == pytest.approx(0.0001 * 510)  # 9,500 + 1,010 - 10,000
    assert predict(o, full, COST, **kw).imposed_s == pytest.approx(0.0001 * 900)   # at most the copy
    assert predict(o, unknown, COST, **kw).imposed_s == pytest.approx(0.0001 * 900)
    # the duplicate holder's refresh likewise: free where its cache has room
    cs = [cand("a", kv_cap=100_000), cand("b", kv_cap=100_000)]
    req = RequestInfo("m", 1008, prefix_hashes=tuple(range(1, 64)),
                      cached_tokens={"a": 960, "b": 960}, indexed_tokens={"a": 960, "b": 960})
    keeper = prefix_keeper(cs, req, 960)
    other = next(c for c in cs if c.node_id != keeper)
    assert predict(other, req, COST, **{**KW, "best_held": 960, "keeper": keeper}
                   ).imposed_s == 0.0


def test_the_locality_index_tells_how_full_each_nodes_cache_is() -> None:
    from gpumesh.kvblocks import BLOCK_SIZE
    from gpumesh.router.fleet.locality import IndexedTokens
    from gpumesh.router.fleet.prefix_index import PrefixIndex

    ix = PrefixIndex()
    ix.add("a", range(1, 11))
    view = IndexedTokens(ix)
    assert view.get("a") == 10 * BLOCK_SIZE and view["a"] == 10 * BLOCK_SIZE
    assert view.get("never") is None and "never" not in view and list(view) == ["a"]


def test_a_prefix_held_twice_has_one_keeper_and_the_other_copy_pays_its_eviction() -> None:
    hashes = tuple(range(1, 64))
    reqs = [RequestInfo("m", 1008 + 16 * i, prefix_hashes=hashes,
                        cached_tokens={"a": 960, "b": 960, "c": 320}) for i in range(3)]
    cs = [cand("a", running=2), cand("b", running=2), cand("c")]
    keepers = {prefix_keeper(cs, r, 960) for r in reqs}
    assert len(keepers) == 1 and keepers <= {"a", "b"}     # one keeper for every request
    assert prefix_keeper(list(reversed(cs)), reqs[0], 960) in keepers   # on every replica
    keeper = keepers.pop()
    other = "b" if keeper == "a" else "a"
    kw = {**KW, "best_held": 960, "keeper": keeper}
    p_keep = predict(next(c for c in cs if c.node_id == keeper), reqs[0], COST, **kw)
    p_dup = predict(next(c for c in cs if c.node_id == other), reqs[0], COST, **kw)
    assert p_dup.imposed_s - p_keep.imposed_s == pytest.approx(0.0001 * 960)
    assert p_dup.ttft_s == p_keep.ttft_s
    # equal load: the keeper wins; a copy elsewhere is refreshed only when the keeper is
    # busier by more than the eviction it saves
    assert select(policy(), cs[:2], reqs[0], RNG, ()).node_id == keeper
    busy = [cand(keeper, running=2, pending=4000), cand(other, running=2)]
    assert select(policy(), busy, reqs[0], RNG, ()).node_id == other
    # one holder: no keeper, nothing charged
    assert prefix_keeper(cs, RequestInfo("m", 1000, cached_tokens={"a": 960}), 960) == ""


def test_full_slots_and_full_kv_wait() -> None:
    base = predict(cand(running=10), RequestInfo("m", 100), COST, **KW).ttft_s
    # 3 waiting (this router's 3 reported ones) + 1: 4 finishes, at 10 per 100 steps (the
    # running requests' output, out_default: R finish per mean output of steps)
    slots = predict(cand(running=10, waiting=3, outstanding_n=3), RequestInfo("m", 100), COST,
                    **KW).ttft_s
    assert slots - base == pytest.approx(4 * 100 * 0.02 / 10)
    roomy = predict(cand(running=10, kv=0.5, kv_cap=10_000), RequestInfo("m", 100), COST, **KW)
    full = predict(cand(running=10, kv=0.99, kv_cap=10_000), RequestInfo("m", 100), COST, **KW)
    assert roomy.ttft_s == pytest.approx(base) and full.ttft_s > base
    assert full.imposed_s > roomy.imposed_s     # it preempts someone to fit


def test_the_output_a_node_measured_sets_how_soon_its_slots_and_kv_free() -> None:
    """A node whose finished requests had 10 output tokens frees a slot ten times as often
    as the default (100) says; one with 400-token outputs four times as seldom."""
    req = RequestInfo("m", 100)
    base = predict(cand(running=10), req, COST, **KW).ttft_s
    waits = {out: predict(cand(running=10, waiting=3, outstanding_n=3, out_mean=out), req,
                          COST, **KW).ttft_s - base for out in (0.0, 10.0, 400.0)}
    assert waits[0.0] == pytest.approx(4 * 100 * 0.02 / 10)   # none reported: the default
    assert waits[10.0] == pytest.approx(4 * 10 * 0.02 / 10)
    assert waits[400.0] == pytest.approx(4 * 400 * 0.02 / 10)
    # KV: the unreported requests count at their prompt plus the node's measured output
    short = cand(running=10, kv=0.5, kv_cap=10_000, unreported=1000, unreported_n=10,
                 out_mean=20.0)
    long = cand(running=10, kv=0.5, kv_cap=10_000, unreported=1000, unreported_n=10,
                out_mean=500.0)
    assert predict(short, req, COST, **KW).ttft_s < predict(long, req, COST, **KW).ttft_s


@pytest.mark.parametrize("c, source, a_s, prefill_s", [
    (cand(step_model=StepModel(2.0, 0.1, 0.01, 50, 0.0)), "fitted", 0.002, 0.00001),
    (cand(step_model=StepModel(2.0, 0.1, 0.01, 3, 0.0), capacity=10_000.0, step_s=0.004),
     "measured", 0.004, 0.0001),                 # too few steps fitted: not trusted yet
    (cand(capacity=10_000.0), "measured", 256 / 10_000.0, 0.0001),
    (cand(weight=2.0), "default", 0.01, 1 / 16_000.0),
])
def test_step_cost_sources(c: Candidate, source: str, a_s: float, prefill_s: float) -> None:
    cost = step_cost(c, None)
    assert (cost.source, cost.a_s, cost.prefill_s) == (source, pytest.approx(a_s),
                                                       pytest.approx(prefill_s))


def test_the_models_builtin_profile_is_used_scaled_by_weight() -> None:
    prof = builtin_profile_for("qwen2.5-7b")
    assert prof is not None and builtin_profile_for("no-such-model") is None
    cost = step_cost(cand(weight=2.0), prof)
    assert cost.source == "profile" and cost.a_s == pytest.approx(prof.a_ms / 1e3 / 2)
    assert cost.budget == prof.max_num_batched_tokens


def policy(**kw: Any) -> PredictedLatency:
    p = build_policy(RoutingSettings(**kw))
    assert isinstance(p, PredictedLatency)
    return p


RNG = random.Random(0)


@pytest.mark.parametrize("objective, slo, expect", [
    # fast: short queue, busy; quiet: longer queue, nobody running
    ("min_ttft", 0.0, "fast"),
    ("slo_then_completion", 0.0, "quiet"),     # fast's 20 streams would each wait 10 ms
    ("max_slo_attainment", 0.0, "quiet"),      # least delay imposed on running streams
    ("max_slo_attainment", 0.05, "fast"),      # only fast meets a 50 ms SLO
    ("slo_then_completion", 0.001, "fast"),    # nobody meets it: the least ttft
])
def test_objectives(objective: str, slo: float, expect: str) -> None:
    fast = cand("fast", running=20, step_model=StepModel(1.0, 0.0, 0.01, 50, 0.0))
    quiet = cand("quiet", pending=8000, step_model=StepModel(1.0, 0.0, 0.01, 50, 0.0))
    req = RequestInfo("m", 1000, output_tokens=10, ttft_slo_s=slo)
    d = select(policy(objective=objective), [fast, quiet], req, RNG, default_filters(0.92))
    assert d.node_id == expect
    assert d.predicted_ttft_s is not None and d.predicted_completion_s is not None
    assert d.predicted_completion_s > d.predicted_ttft_s > 0
    assert {s.node_id for s in d.considered} == {"fast", "quiet"}
    chosen = next(s for s in d.considered if s.node_id == expect)
    assert chosen.scores["ttft_s"] == d.predicted_ttft_s == chosen.expected_wait_s


def test_nodes_serving_one_leg_are_not_candidates() -> None:
    cs = [cand("p", role="prefill"), cand("d", role="decode"), cand("b", running=30)]
    d = select(policy(), cs, RequestInfo("m", 100), RNG,
               (*default_filters(0.92), whole_request))
    assert d.node_id == "b" and set(d.filtered) == {"p", "d"}


def test_replicas_decide_alike_and_ties_follow_the_request_not_the_rng() -> None:
    cs = [cand(f"n{i}") for i in range(8)]          # an idle, equal fleet: all tie
    reqs = [RequestInfo("m", 100, routing_key=f"k{i}") for i in range(200)]
    a = [select(policy(), cs, r, random.Random(1), ()).node_id for r in reqs]
    b = [select(policy(), list(reversed(cs)), r, random.Random(99), ()).node_id for r in reqs]
    assert a == b                                   # other replica, other RNG, other order
    assert len(set(a)) == 8                         # ties spread over the nodes by key
    # sampled on a large fleet: a keyed request gets the same sample on every replica
    big = [cand(f"n{i:03d}", pending=i % 7 * 100) for i in range(300)]
    pick = [select_from(policy(sample_size=16), ListCandidates(big), r, random.Random(s), (),
                        16).node_id for s in (1, 2) for r in reqs[:50]]
    assert pick[:50] == pick[50:]


def test_sampled_decisions_include_the_holder_and_the_session_node() -> None:
    big = [cand(f"n{i:03d}", running=5) for i in range(300)]
    req = RequestInfo("m", 2000, cached_tokens={"n123": 1984})
    assert select_from(policy(sample_size=8), ListCandidates(big), req, RNG, (), 8).node_id \
        == "n123"
    req = RequestInfo("m", 2000, session_node="n222")
    assert select_from(policy(sample_size=8), ListCandidates(big), req, RNG, (), 8).node_id \
        == "n222"


def test_settings_are_few_described_and_validated() -> None:
    fields = RoutingSettings.model_fields
    assert len(fields) <= 10 and all(f.description for f in fields.values())
    with pytest.raises(ValueError):
        RoutingSettings(objective="fastest")       # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RoutingSettings(sample_size=-1)
    with pytest.raises(ValueError):
        RoutingSettings(wait_weight=1.0)            # type: ignore[call-arg]


# --- end to end: a real router over real gRPC, fake nodes ---------------------------------

def _ids(n: int) -> inference_pb2.TokenIds:
    return inference_pb2.TokenIds(ids=list(range(1, n + 1)))


async def _served_by(f: Any, request: inference_pb2.GenerateRequest) -> str:
    call = f.stub.GenerateStream(request)
    async for _ in call:
        pass
    return dict(await call.trailing_metadata())["x-gpumesh-node-id"]


def _settled(f: Any, node: str) -> bool:
    """``node``'s last report holds every request this router sent it (none unreported)."""
    return any(c.node_id == node and c.unreported_requests == 0 and c.report is not None
               for c in f.router.registry.candidates("m"))


def _req(max_tokens: int, **kw: Any) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        model="m", sampling=inference_pb2.SamplingParams(max_tokens=max_tokens), **kw)


@pytest.mark.parametrize("policy_name, by_prediction", [("predicted_latency", True),
                                                        ("least_request", False)])
async def test_a_prefix_holder_and_a_sessions_node_win_by_prediction(
        policy_name: str, by_prediction: bool) -> None:
    async with fleet({"node_id": "a", "token_s": 0.005}, {"node_id": "b", "token_s": 0.005},
                     prefix_locality="approximate", routing={"policy": policy_name}) as f:
        # a long request with a 2,000-token prompt runs on one node, which now holds it
        busy = asyncio.ensure_future(_served_by(f, _req(1000, token_ids=_ids(2000))))
        await wait_for(lambda: sum(n.active for n in f.nodes.values()) == 1)
        holder = next(n for n, node in f.nodes.items() if node.active == 1)
        other = "b" if holder == "a" else "a"
        await wait_for(lambda: _settled(f, holder))
        # the same prefix again: least_request sends it to the idle node, the prediction to
        # the holder (1 token to prefill there against 2,001 and an eviction elsewhere)
        ids = _ids(2000)
        ids.ids.append(7)
        assert await _served_by(f, _req(2, token_ids=ids)) == (
            holder if by_prediction else other)
        busy.cancel()
        await wait_for(lambda: sum(n.active for n in f.nodes.values()) == 0)
        # a session (text prompts: no prefix index here): its node is an expected hit
        busy = asyncio.ensure_future(_served_by(f, _req(1000, text="y" * 4000,
                                                        routing_key="s1")))
        await wait_for(lambda: sum(n.active for n in f.nodes.values()) == 1)
        first = next(n for n, node in f.nodes.items() if node.active == 1)
        await wait_for(lambda: _settled(f, first))
        second = await _served_by(f, _req(2, text="z" * 4000, routing_key="s1"))
        assert (second == first) is by_prediction
        busy.cancel()
