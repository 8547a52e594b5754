"""The simulator's SMG ``cache_aware`` reference (gpumesh_bench.sim.smg_policy): each step of
the decision table-driven, and the policy running in the simulator beside the product's."""

from __future__ import annotations

import random
import statistics

import pytest

from gpumesh_bench.sim import core, fleets, grid, metrics
from gpumesh_bench.sim import workloads as wl
from gpumesh_bench.sim.smg_policy import SmgCacheAware, SmgConfig, WorkerLoad

IDLE = WorkerLoad(0, 0.1, 0, 0.0)


def _policy(loads: dict[str, WorkerLoad], mode: str = "event", **cfg: object) -> SmgCacheAware:
    return SmgCacheAware(mode, SmgConfig(**cfg), random.Random(1),   # type: ignore[arg-type]
                         lambda w, now: loads[w])


def test_event_mode_sends_a_prefix_to_the_worker_holding_most_of_it() -> None:
    p = _policy({"a": IDLE, "b": IDLE, "c": IDLE})
    p.kv_events("a", [("stored", (1, 2))])
    p.kv_events("b", [("stored", (1, 2, 3))])
    assert p.choose(["a", "b", "c"], 64, (1, 2, 3, 4), 0.0) == "b"
    p.kv_events("b", [("removed", (2, 3))])    # b now holds block 1 only: a leads
    assert p.choose(["a", "b", "c"], 64, (1, 2, 3, 4), 0.0) == "a"
    p.kv_events("a", [("cleared", ())])
    assert p.choose(["a", "b", "c"], 64, (1, 2, 3, 4), 0.0) == "b"
    assert p.branches == {"event_hit": 3}


@pytest.mark.parametrize(("waiting", "usage", "expect"), [
    ((0, 0, 0), (0.1, 0.1, 0.1), "a"),       # a holds the prefix
    ((8, 0, 0), (0.1, 0.1, 0.1), "b"),       # a overloaded (8 waiting): out of routing
    ((0, 0, 0), (0.8, 0.1, 0.1), "b"),       # a overloaded (KV usage 0.8)
    ((9, 9, 9), (0.1, 0.1, 0.1), "a"),       # everyone overloaded: all stay eligible
])
def test_overload_protection(waiting: tuple[int, ...], usage: tuple[float, ...],
                             expect: str) -> None:
    loads = {w: WorkerLoad(n, u, 0, 100.0) for w, n, u in zip("abc", waiting, usage)}
    p = _policy(loads)
    p.kv_events("a", [("stored", (1, 2))])
    p.kv_events("c", [("stored", (1,))])
    got = p.choose(list("abc"), 64, (1, 2, 3, 4), 0.0)
    assert got == expect or (expect == "b" and got == "c")   # c holds 1 block: the next best


def test_miss_goes_to_the_least_expected_wait() -> None:
    # expected wait = queued uncached tokens / gen rate + 0.15 k / (1 - k)
    loads = {"a": WorkerLoad(0, 0.5, 1000, 2000.0),    # 0.5 + 0.15
             "b": WorkerLoad(0, 0.0, 3000, 10000.0),   # 0.3
             "c": WorkerLoad(0, 0.9, 0, 0.0)}          # 0 + 1.35 (no rate: default 2000)
    p = _policy(loads)
    p.kv_events("c", [("stored", (99,))])
    assert p.choose(list("abc"), 64, (1, 2, 3, 4), 0.0) == "b"
    # the dispatch is credited until the next load record (0.1 s): 3000 + 64 * n tokens
    for _ in range(10):
        p.choose(list("ab"), 10_000, (5,), 0.01)
    assert p.inflight["a"] >= 1


def test_spill_gate_needs_both_margins() -> None:
    loads = {w: IDLE for w in "abcd"}
    p = _policy(loads)
    p.kv_events("a", [("stored", (1,))])
    # a at 10, the others 0: mean 2.5; 10 > 1.5 x 2.5 and > 2.5 + max(4, 2 sqrt 2.5)
    p.inflight.update({"a": 10, "b": 0, "c": 0, "d": 0})
    assert p.choose(list("abcd"), 32, (1, 2), 0.0) != "a"
    assert p.branches == {"event_spill": 1}
    # a at 5: over 1.5 x the mean (1.25) but not 4 above it: no spill
    q = _policy(loads)
    q.kv_events("a", [("stored", (1,))])
    q.inflight.update({"a": 5, "b": 0, "c": 0, "d": 0})
    assert q.choose(list("abcd"), 32, (1, 2), 0.0) == "a"


def test_approximate_mode_pins_above_the_cache_threshold() -> None:
    loads = {w: IDLE for w in "ab"}
    p = _policy(loads, mode="approximate")
    first = p.choose(["a", "b"], 64, (1, 2, 3, 4), 0.0)   # empty tree: a miss
    assert p.branches == {"tree_miss": 1}
    p.inflight[first] = 0
    # 3 of 4 blocks (48 of 64 tokens) match: a hit on the same worker
    assert p.choose(["a", "b"], 64, (1, 2, 3, 9), 0.0) == first
    # 1 block of 4 (16 of 64 tokens = 0.25 <= 0.3): no pinning
    p.inflight[first] = 5
    assert p.choose(["a", "b"], 64, (1, 7, 8, 9), 0.0) != first
    assert p.branches == {"tree_miss": 2, "tree_hit": 1}


def test_approximate_tree_evicts_least_recently_used_leaves_first() -> None:
    p = _policy({"a": IDLE, "b": IDLE}, mode="approximate", max_tree_size=64,
                eviction_interval_s=1.0)
    p.tree.insert((1, 2, 3), "a", 0.0)
    p.tree.insert((1, 2, 4), "a", 0.5)
    assert p.tree.tokens == 64
    p.tree.insert((7,), "b", 0.7)   # 80 tokens: the next eviction (at 1 s) drops a's oldest
    p.choose(["a", "b"], 16, (8,), 2.0)   # leaf, block 3, and 16 more tokens come in
    assert 3 not in p.tree.holders and 2 in p.tree.holders and p.tree.tokens == 80


def test_smg_reference_runs_in_the_simulator_beside_the_product_policies() -> None:
    f = fleets.builtin("homo")
    w = wl.build("conversations", 1500, 120.0, 1, [x.node_id for x in f.nodes])
    sim = core.Simulation(f, w, "smg_cache_aware", 1)
    res = sim.run()
    assert not any(r.error for r in res.records)
    branches = sim.routers[0].smg.branches   # type: ignore[union-attr]
    assert branches.get("event_hit", 0) > 0.7 * len(w.arrivals)
    again = core.simulate(f, w, "smg_cache_aware", 1)
    assert [r.node_id for r in again.records] == [r.node_id for r in res.records]
    cell = grid.run_cell(f, "conversations", 120.0, ["least_request", "smg_cache_aware",
                                                      "smg_cache_aware_approx"], [1], 800,
                         metrics.SLOSpec())
    agg = cell["agg"]
    assert agg["smg_cache_aware"]["ttft_p90"][0] < agg["least_request"]["ttft_p90"][0]
    assert agg["smg_cache_aware_approx"]["ttft_p90"][0] < agg["least_request"]["ttft_p90"][0]


def test_smg_check_replays_a_live_run_on_its_trace(tiny_model_dir: object) -> None:
    """smg_check rebuilds a prefix-bench run's trace, replays each door under the matching
    simulator policy, and measures the gateway's own time as live minus simulated TTFT,
    request by request (here a stand-in live record: the simulated TTFTs plus 5 ms)."""
    from gpumesh_bench.sim import smg_check

    doc = {"args": {"model": str(tiny_model_dir), "tenants": 4, "loads": "0.5", "seed": 0,
                    "duration": 1.0, "unique": False, "nodes": 2, "kv_tokens": 40_000,
                    "time_scale": 8.0, "setups": "least_request", "smg": "smg=cache_aware",
                    "warmup": 0.2},
           "nominal_capacity_req_per_s": 20.0,
           "runs": [{"setup": "least_request", "load": 0.5, "ok": 0, "ttft_all_s": []},
                    {"setup": "smg", "load": 0.5, "ok": 0, "ttft_all_s": []}]}
    rows = smg_check.replay(doc, [1])
    assert [r["policy"] for r in rows] == ["least_request", "smg_cache_aware"]
    sim = rows[1]["_sim_order"][0]
    assert sim and rows[0]["sim_requests"] == len(sim)
    rows[1]["live_ttft_s"] = [x + 0.005 for x in sim]
    assert smg_check.front_end(rows) == pytest.approx(0.005)
    slower = smg_check.replay(doc, [1], front_end_s=0.005)[1]["_sim_order"][0]
    assert statistics.median(slower) == pytest.approx(statistics.median(sim) + 0.005, abs=2e-3)
