"""Prefill and decode pools in the fleet simulator: the KV transfer time, the pool choice and
the rule (pure functions, table-driven), the role-aware fleet spec, the simulated engine's two
legs, and small end-to-end runs where every disaggregated request completes and its time to
first token holds the transfer."""

from __future__ import annotations

import math

import pytest

from gpumesh.node.engines.sim import SimEngineConfig
from gpumesh.node.engines.sim.request import SimRequest
from gpumesh.node.engines.sim.scheduler import SimScheduler
from gpumesh.profiles import (
    ProfileError,
    builtin_profile,
    dumps_profile,
    kv_bytes_per_token,
    loads_profile,
)
from gpumesh.router.scheduling.settings import RoutingSettings
from gpumesh_bench.sim import cli, core, fleets, metrics, pdtable
from gpumesh_bench.sim import workloads as wl
from gpumesh_bench.sim.pools import KvLink, PdRule, PoolNode, choose_decode, choose_prefill, pays

# --- the KV bytes and the transfer time ---------------------------------------------------


@pytest.mark.parametrize("tokens, bpt, gbs, lat, want", [
    (8192, 57344, 25.0, 0.001, 0.001 + 8192 * 57344 / 25e9),     # 7B, 8k prompt: 19.8 ms
    (32768, 12288, 12.5, 0.0, 32768 * 12288 / 12.5e9),          # 0.5B over 100 GbE
    (0, 57344, 25.0, 0.002, 0.002),                              # nothing to move: latency
])
def test_transfer_time(tokens: int, bpt: int, gbs: float, lat: float, want: float) -> None:
    assert KvLink(gbs * 1e9, lat).transfer_s(tokens, bpt) == pytest.approx(want, rel=1e-12)


def test_bad_links_are_refused() -> None:
    for bw, lat in ((0.0, 0.0), (math.inf, 0.0), (1e9, -1.0), (1e9, math.nan)):
        with pytest.raises(ValueError):
            KvLink(bw, lat)
    with pytest.raises(ValueError):
        KvLink().transfer_s(-1, 10)


def test_kv_bytes_per_token_from_model_configs() -> None:
    """2 x layers x KV heads x head dim x dtype bytes; the built-in profiles carry theirs."""
    qwen7b = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
              "hidden_size": 3584, "torch_dtype": "bfloat16"}
    assert kv_bytes_per_token(qwen7b) == 2 * 28 * 4 * 128 * 2 == 57344
    assert kv_bytes_per_token(qwen7b, "fp8") == 28672
    assert kv_bytes_per_token({**qwen7b, "head_dim": 64}) == 28672
    mha = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
           "torch_dtype": "float32"}   # no num_key_value_heads: every head has its KV
    assert kv_bytes_per_token(mha) == 2 * 2 * 4 * 64 * 4
    with pytest.raises(ProfileError, match="torch_dtype"):
        kv_bytes_per_token({**qwen7b, "torch_dtype": "int3"})
    with pytest.raises(ProfileError, match="num_hidden_layers"):
        kv_bytes_per_token({**qwen7b, "num_hidden_layers": 0})
    assert {n: builtin_profile(n).kv_bytes_per_token for n in ("0.5b-h200", "7b-h200",
                                                               "tiny-cpu")} == {
        "0.5b-h200": 12288, "7b-h200": 57344, "tiny-cpu": 512}
    p = builtin_profile("7b-h200")
    assert "bytes_per_token = 57344" in dumps_profile(p)
    assert loads_profile(dumps_profile(p)) == p
    with pytest.raises(ProfileError, match="kv.bytes_per_token"):
        loads_profile(dumps_profile(p).replace("bytes_per_token = 57344",
                                               "bytes_per_token = -1"))
    assert SimEngineConfig.for_shape("7b-h200").kv_bytes_per_token == 57344


# --- the pool choice and the rule (pure) --------------------------------------------------


def node(nid: str, role: str, backlog: int = 0, rate: float = 40_000.0, requests: int = 0,
         free: int = 1_000_000, a: float = 0.005, b: float = 0.0001) -> PoolNode:
    return PoolNode(nid, role, backlog, rate, requests, free, a, b)


@pytest.mark.parametrize("nodes, want", [
    ([node("p0", "prefill", 8000), node("p1", "prefill", 4000)], "p1"),
    # a faster node with more queued finishes first
    ([node("p0", "prefill", 8000, rate=80_000), node("p1", "prefill", 4000)], "p0"),
    # ties: fewer requests, then node id
    ([node("p0", "prefill", 0, requests=2), node("p1", "prefill", 0, requests=1)], "p1"),
    ([node("p1", "prefill"), node("p0", "prefill")], "p0"),
    # decode and both nodes are not the prefill pool
    ([node("d0", "decode"), node("b0", "both"), node("p0", "prefill", 10**6)], "p0"),
    ([node("d0", "decode"), node("b0", "both")], None),
])
def test_choose_prefill(nodes: list[PoolNode], want: str | None) -> None:
    got = choose_prefill(nodes, 2048)
    assert (got.node_id if got else None) == want


@pytest.mark.parametrize("nodes, need, want, room", [
    ([node("d0", "decode", requests=9), node("d1", "decode", requests=3)], 100, "d1", True),
    # the step model, not the count: a cheaper step per sequence wins
    ([node("d0", "decode", requests=9, b=0.00001), node("d1", "decode", requests=3)], 100,
     "d0", True),
    # only nodes with KV room for the prompt and its output
    ([node("d0", "decode", free=50), node("d1", "decode", requests=30)], 100, "d1", True),
    # none has room: the least loaded of all, room False
    ([node("d0", "decode", free=50, requests=5), node("d1", "decode", free=60)], 100, "d1",
     False),
    ([node("p0", "prefill")], 100, None, False),
])
def test_choose_decode(nodes: list[PoolNode], need: int, want: str | None, room: bool) -> None:
    got, has_room = choose_decode(nodes, need)
    assert ((got.node_id if got else None), has_room) == (want, room)


P = node("p0", "prefill")                                # idle prefill node
BUSY_D = node("d0", "decode", requests=40)               # 40 streams decoding
IDLE_D = node("d0", "decode")


@pytest.mark.parametrize("tokens, prefill, decode, room, transfer, rule, want", [
    (100, P, BUSY_D, True, 0.001, PdRule(), (False, "short prompt")),
    (8192, P, BUSY_D, False, 0.02, PdRule(), (False, "no decode room")),
    (8192, P, BUSY_D, True, 1.0, PdRule(), (False, "transfer slower than prefill")),
    # nothing to stall on an idle decode node: whole is faster (no transfer, no hop)
    (8192, P, IDLE_D, True, 0.02, PdRule(), (False, "whole is faster")),
    (8192, P, BUSY_D, True, 0.02, PdRule(), (True, "disaggregated")),
    # a prefill pool 5 s behind: losing 5 s of TTFT costs more than 40 x 0.2 s x 0.1 stalled
    (8192, node("p0", "prefill", 200_000), BUSY_D, True, 0.02, PdRule(stall_weight=0.1),
     (False, "prefill pool too slow")),
    # ... but not at weight 1 (8 s of stalled streams)
    (8192, node("p0", "prefill", 200_000), BUSY_D, True, 0.02, PdRule(stall_weight=1.0),
     (True, "disaggregated")),
    # the default weight, 0.1: 0.8 s of stalled streams outweigh 0.7 s of TTFT, not 1 s
    (8192, node("p0", "prefill", 28_000), BUSY_D, True, 0.02, PdRule(), (True, "disaggregated")),
    (8192, node("p0", "prefill", 40_000), BUSY_D, True, 0.02, PdRule(),
     (False, "prefill pool too slow")),
    # an infinite weight disaggregates even onto an idle decode node
    (8192, P, IDLE_D, True, 0.02, PdRule(stall_weight=math.inf), (True, "disaggregated")),
    (300, P, BUSY_D, True, 0.001, PdRule(min_prompt_tokens=0), (True, "disaggregated")),
])
def test_pays(tokens: int, prefill: PoolNode, decode: PoolNode, room: bool, transfer: float,
              rule: PdRule, want: tuple[bool, str]) -> None:
    assert pays(tokens, prefill, decode, room, transfer, 0.001, rule) == want


# --- the role-aware fleet spec ------------------------------------------------------------


def test_inline_fleet_with_roles() -> None:
    f = fleets.resolve("2xprefill:7b-h200:max_context_length=33792,1xdecode:7b-h200")
    assert [(n.role, n.engine.max_context_length) for n in f.nodes] == [
        ("prefill", 33792), ("prefill", 33792), ("decode", 8704)]
    assert f.disaggregated and f.link == KvLink() and f.pd_rule == PdRule()
    assert all(n.engine.kv_bytes_per_token == 57344 and n.engine.time_scale == 1.0
               for n in f.nodes)
    assert len({n.node_id for n in f.nodes}) == 3
    plain = fleets.resolve("4x0.5b-h200")
    assert {n.role for n in plain.nodes} == {"both"} and not plain.disaggregated
    assert not fleets.resolve("homo").disaggregated


@pytest.mark.parametrize("spec, match", [
    ("2xprefill:7b-h200", "needs decode nodes"),
    ("2xdecode:7b-h200", "needs decode nodes"),
    ("2xprefill:13b,1xdecode:7b-h200", "unknown shape"),
    ("2xprefil:7b-h200,1xdecode:7b-h200", "expected COUNTxROLE"),
    ("2xprefill:7b-h200,1xdecode:7b-h200:warp=2", "unknown engine field"),
    ("2xprefill:7b-h200,decode", "expected COUNTxROLE"),
])
def test_bad_inline_fleets(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fleets.parse_inline(spec)


def test_toml_fleet_with_roles_and_link() -> None:
    f = fleets.from_dict({"shape": "0.5b-h200", "pd": {"link_gbytes_per_s": 12.5,
                                                        "link_latency_ms": 0.5,
                                                        "min_prompt_tokens": 1024},
                          "group": [{"count": 3, "role": "prefill", "prefix": "p"},
                                    {"count": 1, "role": "decode", "prefix": "d"},
                                    {"count": 2}]})
    assert [n.role for n in f.nodes] == ["prefill"] * 3 + ["decode", "both", "both"]
    assert f.link == KvLink(12.5e9, 0.0005) and f.pd_rule.min_prompt_tokens == 1024
    with pytest.raises(ValueError, match="unknown role"):
        fleets.from_dict({"group": [{"count": 1, "role": "verify"}]})
    with pytest.raises(ValueError, match=r"unknown \[pd\]"):
        fleets.from_dict({"pd": {"bandwidth": 1}, "group": [{"count": 1}]})
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        fleets.from_dict({"group": [{"count": 1, "role": "prefill"},
                                    {"count": 1, "role": "decode", "kv_bytes_per_token": 0}]})


# --- the simulated engine's two legs ------------------------------------------------------


def sched(kv_tokens: int = 4096, **kw: object) -> SimScheduler:
    return SimScheduler(SimEngineConfig(time_scale=0.0, kv_capacity_tokens=kv_tokens,
                                        max_context_length=kv_tokens, prefix_caching=False,
                                        **kw))  # type: ignore[arg-type]


def req(rid: str, prompt: int, out: int, **kw: bool) -> SimRequest:
    import random
    return SimRequest(rid, prompt, out, random.Random(1), 0.0, (), **kw)


def test_decode_leg_takes_its_kv_whole_then_computes_one_token() -> None:
    s = sched()
    s.add(req("a", 3000, 4))
    s.add(req("r", 2000, 4, remote=True))   # does not fit beside a's 3,000 prompt tokens
    step = s.begin_step()
    assert step is not None and [(r.id, n) for r, n in step.scheduled] == [("a", 3000)]
    assert s.take_started() == [] and s.load_at(None).num_waiting == 1
    while s._reqs.get("a") is not None:       # a finishes: its KV is freed
        st = s.begin_step()
        assert st is not None
        s.end_step(st, 0.0)
    assert s.begin_step() is None              # r took its blocks: nothing to compute yet
    assert [r.id for r in s.take_started()] == ["r"]
    assert s.free_kv_blocks == 256 - 125 and s.load_at(None).num_waiting == 1
    assert s.kv_loaded("r") and not s.kv_loaded("r")
    step = s.begin_step()
    assert step is not None and (step.decode_tokens, step.prefill_tokens) == (1, 0)
    firsts, _ = s.end_step(step, 0.0)
    assert [r.id for r in firsts] == ["r"]


def test_prefill_leg_keeps_its_kv_until_released() -> None:
    s = sched()
    s.add(req("p", 1000, 1, keep_kv=True))
    step = s.begin_step()
    assert step is not None
    firsts, done = s.end_step(step, 0.0)
    assert [r.id for r in done] == ["p"] and s.idle
    assert s.free_kv_blocks == 256 - 63 and s.held_kv_tokens == 63 * 16
    assert s.release("p") and not s.release("p")
    assert s.free_kv_blocks == 256 and s.held_kv_tokens == 0


# --- end to end ---------------------------------------------------------------------------


def pd_fleet(prefill: int = 1, decode: int = 1, rule: PdRule = PdRule(0, math.inf),
             delay: float = 0.001, link: KvLink = KvLink(25e9, 0.001)) -> fleets.FleetSpec:
    f = fleets.from_dict({"network_delay_s": delay, "shape": "7b-h200",
                          "engine": {"kv_capacity_tokens": 200_000, "max_num_seqs": 64,
                                     "max_context_length": 16384},
                          "group": [{"count": prefill, "role": "prefill", "prefix": "p"},
                                    {"count": decode, "role": "decode", "prefix": "d"}]})
    return fleets.with_pd(f, link, rule)


def test_one_request_ttft_holds_both_legs_and_the_transfer() -> None:
    """Alone: the prefill leg's steps, three hops (router -> prefill node -> router -> decode
    node), the transfer, the decode node's step for the last prompt token, the hop back."""
    f = pd_fleet()
    prompt, out = 8000, 5
    w = wl.Workload("one", [wl.Arrival(0, 0.0, prompt, out)], [])
    sim = core.Simulation(f, w, "predicted_latency", 1)
    r = sim.run().records[0]
    ref = sim.nodes[f.nodes[0].node_id].sched
    transfer = f.link.transfer_s(prompt, 57344)
    want = 4 * 0.001 + ref.step_time_s(0, prompt) + transfer + ref.step_time_s(1, 0)
    assert r.prefill_node == f.nodes[0].node_id and r.node_id == f.nodes[1].node_id
    assert r.transfer_s == pytest.approx(transfer, rel=1e-9)
    assert r.ttft_s == pytest.approx(want, rel=1e-9)
    assert r.e2e_s - r.ttft_s == pytest.approx((out - 1) * ref.step_time_s(1, 0), rel=1e-9)
    # both nodes hold no KV once it is done
    for n in sim.nodes.values():
        assert n.sched.free_kv_blocks == 200_000 // 16 and n.sched.held_kv_tokens == 0


def test_loaded_disaggregated_run_completes_every_request() -> None:
    f = pd_fleet(prefill=2, decode=2)
    w = wl.build("prompt-2048", 400, 40.0, 3, [x.node_id for x in f.nodes])
    sim = core.Simulation(f, w, "predicted_latency", 3)
    res = sim.run()
    assert len(res.records) == 400
    prefill = {n.node_id for n in f.nodes if n.role == "prefill"}
    for r in res.records:
        assert not r.error and r.end_s >= r.first_s > r.arrival_s
        assert r.prefill_node in prefill and r.node_id not in prefill
        assert r.ttft_s > r.transfer_s >= f.link.transfer_s(r.prompt_tokens, 57344) - 1e-12
    assert {r.prefill_node for r in res.records} == prefill          # both prefill nodes used
    assert metrics.run_metrics(res, metrics.SLOSpec())["disaggregated"] == 1.0
    for n in sim.nodes.values():
        assert n.sched.idle and n.sched.held_kv_tokens == 0
    # the same requests aggregated on the same four GPUs: the decode steps hold no prefill
    # chunk when disaggregated, so the decode time per token is lower
    agg = fleets.from_dict({"network_delay_s": 0.001, "shape": "7b-h200",
                            "engine": {"kv_capacity_tokens": 200_000, "max_num_seqs": 64,
                                       "max_context_length": 16384}, "group": [{"count": 4}]})
    whole = metrics.run_metrics(core.simulate(agg, w, "predicted_latency", 3),
                                metrics.SLOSpec())
    split = metrics.run_metrics(res, metrics.SLOSpec())
    assert split["tpot_p99"] < whole["tpot_p99"]


def test_the_rule_serves_short_prompts_whole_on_decode_nodes() -> None:
    f = pd_fleet(rule=PdRule(min_prompt_tokens=1000, stall_weight=math.inf))
    w = wl.Workload("two", [wl.Arrival(0, 0.0, 200, 4), wl.Arrival(1, 0.5, 4000, 4)], [])
    sim = core.Simulation(f, w, "predicted_latency", 1)
    short, long_ = sim.run().records
    assert short.prefill_node == "" and short.node_id == f.nodes[1].node_id
    assert long_.prefill_node == f.nodes[0].node_id
    assert sim.pd is not None and sim.pd.reasons["short prompt"] == 1


def test_pd_command_writes_the_table(tmp_path: object) -> None:
    out = f"{tmp_path}/pd"
    assert cli.main(["pd", "--workloads", "prompt-1024", "--loads", "0.5", "--splits",
                     "agg,2P2D", "--shape", "0.5b-h200", "--seeds", "2", "--requests", "200",
                     "--link-gbytes", "12.5", "--out", out]) == 0
    recs = [r for r in pdtable.run(["prompt-1024"], [0.5], ["2P2D"], shape="0.5b-h200",
                                   seeds=[1], n=100)]
    assert [r["split"] for r in recs] == ["agg", "2P2D"]
    assert recs[1]["link"]["gbytes_per_s"] == 25.0
    import gzip
    import json
    lines = gzip.decompress(open(f"{out}/pd.jsonl.gz", "rb").read()).decode().splitlines()
    rows = [json.loads(x) for x in lines]
    assert [r["split"] for r in rows] == ["agg", "2P2D"]
    assert rows[1]["link"]["gbytes_per_s"] == 12.5 and len(rows[1]["runs"]) == 2
    # whole requests are routed by the router's own default policy
    assert {r["policy"] for r in rows} == {RoutingSettings().policy}
    assert "| prompt-1024 | 0.5 |" in open(f"{out}/pd.md").read()
    with pytest.raises(ValueError):
        pdtable.parse_split("3P3D", 4)


def test_whole_requests_go_to_the_both_nodes_of_a_mixed_fleet() -> None:
    f = fleets.with_pd(fleets.parse_inline("1xprefill:7b-h200,1xdecode:7b-h200,2xboth:7b-h200"),
                       rule=PdRule(min_prompt_tokens=1000, stall_weight=math.inf))
    w = wl.Workload("mix", [wl.Arrival(i, 0.01 * i, 200 if i % 2 else 3000, 8)
                            for i in range(40)], [])
    sim = core.Simulation(f, w, "predicted_latency", 1)
    recs = sim.run().records
    both = {n.node_id for n in f.nodes if n.role == "both"}
    roles = {n.node_id: n.role for n in f.nodes}
    assert all(r.node_id in both and not r.prefill_node for r in recs if r.prompt_tokens == 200)
    assert all(roles[r.prefill_node] == "prefill" and roles[r.node_id] == "decode"
               for r in recs if r.prompt_tokens == 3000)
    assert {r.node_id for r in recs if r.prompt_tokens == 200} == both
