"""The fleet simulator (gpumesh_bench.sim): determinism, the shared engine model, the real
router code, workloads, fleets, metrics and the command line. Small runs only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpumesh.node.engines.sim import SimEngineConfig
from gpumesh.node.engines.sim.scheduler import SimScheduler
from gpumesh.router.fleet import Registry
from gpumesh_bench.sim import cli, core, fleets, grid, metrics, report
from gpumesh_bench.sim import workloads as wl


def small(name: str = "hetero-speed", n: int = 600, rate: float = 150.0, seed: int = 1,
          workload: str = "lognormal") -> tuple[fleets.FleetSpec, wl.Workload]:
    f = fleets.builtin(name)
    return f, wl.build(workload, n, rate, seed, [x.node_id for x in f.nodes], f.fastest)


def key(r: core.RunResult) -> list[tuple[object, ...]]:
    return [(x.index, x.node_id, x.first_s, x.end_s, x.error) for x in r.records]


def test_deterministic_per_seed() -> None:
    f, w = small()
    a = core.simulate(f, w, "predicted_latency", 3)
    b = core.simulate(f, w, "predicted_latency", 3)
    assert key(a) == key(b)
    f2, w2 = small(seed=4)
    assert key(core.simulate(f2, w2, "predicted_latency", 4)) != key(a)
    assert all(x.end_s >= x.first_s >= x.arrival_s and not x.error for x in a.records)


def one_node(**engine: object) -> fleets.FleetSpec:
    return fleets.from_dict({"name": "one", "network_delay_s": 0.001,
                             "group": [{"count": 1, **engine}]})


@pytest.mark.parametrize("prompt, out, speed", [(100, 10, 1.0), (3000, 5, 2.0), (40, 1, 0.5)])
def test_engine_model_is_the_sim_nodes(prompt: int, out: int, speed: float) -> None:
    """One request alone: its TTFT and end are the sim engine's own step times (the same
    SimScheduler the simulated node runs) plus the network delay each way."""
    f = one_node(speed=speed)
    w = wl.Workload("one", [wl.Arrival(0, 0.0, prompt, out)], [])
    sim = core.Simulation(f, w, "predicted_latency", 1)
    node = next(iter(sim.nodes.values()))
    assert type(node.sched) is SimScheduler
    r = sim.run().records[0]
    ref = SimScheduler(SimEngineConfig.for_shape("0.5b-h200", speed=speed, time_scale=1.0,
                                                 max_num_seqs=32, kv_capacity_tokens=8192,
                                                 max_context_length=4096))
    budget = ref.config.max_num_batched_tokens
    chunks, rest = divmod(prompt, budget)
    prefill = chunks * ref.step_time_s(0, budget) + (ref.step_time_s(0, rest) if rest else 0)
    assert r.ttft_s == pytest.approx(0.002 + prefill, rel=1e-9)
    assert r.e2e_s - r.ttft_s == pytest.approx((out - 1) * ref.step_time_s(1, 0), rel=1e-9)


def test_real_router_code_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request is charged through the router's Registry, heartbeats reach it, and the
    policy decides (least_request and the default place requests differently)."""
    charged: list[str] = []
    beats: list[str] = []
    orig_charge, orig_hb = Registry.charge, Registry.heartbeat

    def charge(self: Registry, node_id: str, tokens: int, **kw: object):  # type: ignore[no-untyped-def]
        charged.append(node_id)
        return orig_charge(self, node_id, tokens, **kw)  # type: ignore[arg-type]

    def heartbeat(self: Registry, node_id: str, *a: object):  # type: ignore[no-untyped-def]
        beats.append(node_id)
        return orig_hb(self, node_id, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(Registry, "charge", charge)
    monkeypatch.setattr(Registry, "heartbeat", heartbeat)
    f, w = small(n=400)
    r = core.simulate(f, w, "predicted_latency", 1)
    assert charged == [x.node_id for x in r.records]
    assert set(beats) == {x.node_id for x in f.nodes}
    lr = core.simulate(f, w, "least_request", 1)
    assert [x.node_id for x in lr.records] != [x.node_id for x in r.records]


def test_several_routers_share_the_fleet() -> None:
    f, w = small(n=400)
    f = fleets.FleetSpec(f.name, f.nodes, routers=3)
    sim = core.Simulation(f, w, "predicted_latency", 1)
    r = sim.run()
    assert {x.router for x in r.records} == {0, 1, 2}
    # each node's ledger counted every router's admissions
    node = next(iter(sim.nodes.values()))
    assert {a.router_id for a in node.ledger.accounts()} == {"r0", "r1", "r2"}


@pytest.mark.parametrize("name", wl.WORKLOADS)
def test_workloads(name: str) -> None:
    f = fleets.builtin("hetero-speed")
    w = wl.build(name, 2000, 100.0, 1, [x.node_id for x in f.nodes], f.fastest)
    assert len(w.arrivals) == 2000
    assert [a.arrival_s for a in w.arrivals] == sorted(a.arrival_s for a in w.arrivals)
    assert wl.mean_rate(w) == pytest.approx(100.0, rel=0.15)
    assert all(a.prompt_tokens >= 1 and a.output_tokens >= 1 for a in w.arrivals)
    if name == "conversations":
        # later turns of a conversation extend an earlier prompt's blocks
        firsts = {a.blocks[:8] for a in w.arrivals if len(a.blocks) >= 8}
        assert len(firsts) < len(w.arrivals) / 4
        assert all(len(a.blocks) == a.prompt_tokens // wl.BLOCK for a in w.arrivals)
    kinds = {e.kind for e in w.events}
    assert kinds == {"join-leave": {"join", "leave"}, "slowdown": {"speed"}}.get(name, set())


def test_fleet_events_run() -> None:
    f, w = small(n=800, workload="join-leave")
    r = core.simulate(f, w, "predicted_latency", 1)
    left = [e.node_id for e in w.events if e.kind == "leave"]
    t_leave = min(e.at_s for e in w.events if e.kind == "leave")
    t_join = min(e.at_s for e in w.events if e.kind == "join")
    between = [x for x in r.records if t_leave + 0.05 < x.arrival_s < t_join - 0.05]
    assert between and not any(x.node_id in left for x in between)
    assert not any(x.error for x in r.records)


def test_trace_replay_and_fleet_toml(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"arrival_s": i * 0.01, "prompt_tokens": 64,
                                           "max_tokens": 16, "blocks": [1, 2, 3, 4]})
                               for i in range(50)) + "\n")
    w = wl.load_trace(trace, rate=200.0)
    assert wl.mean_rate(w) == pytest.approx(200.0) and w.arrivals[0].blocks == (1, 2, 3, 4)
    toml = tmp_path / "f.toml"
    toml.write_text('name = "two"\nrouters = 2\n[engine]\nmax_num_seqs = 8\n'
                    '[[group]]\ncount = 2\nspeed = 2.0\nkv_capacity_tokens = 16384\n')
    f = fleets.load(toml)
    assert [n.engine.speed for n in f.nodes] == [2.0, 2.0] and f.routers == 2
    assert f.nodes[0].weight == 2.0 and f.nodes[0].engine.max_num_seqs == 8
    r = core.simulate(f, w, "predicted_latency", 1)
    assert len(r.records) == 50 and not any(x.error for x in r.records)
    bad = tmp_path / "bad.toml"
    bad.write_text("[[group]]\nspeeed = 2\n")
    with pytest.raises(ValueError, match="speeed"):
        fleets.load(bad)


def test_metrics_and_report() -> None:
    f, w = small(n=400)
    slo = metrics.SLOSpec(100, 15)
    cell = grid.run_cell(f, "lognormal", 150.0, ["predicted_latency", "least_request"],
                         [1, 2], 400, slo)
    a = cell["agg"]["predicted_latency"]
    assert a["seeds"] == 2 and a["ttft_p50"][0] <= a["ttft_p99"][0]
    assert sum(a["share"].values()) == pytest.approx(1.0)
    rec = {"fleet": f.name, "workload": "lognormal", "load": 0.5, "rate": 150.0,
           "requests": 400, "seeds": [1, 2], "nodes": [x.node_id for x in f.nodes],
           "speeds": [x.engine.speed for x in f.nodes], **cell}
    md = report.markdown([rec])
    assert "TTFT p99 ÷ LR" in md and "predicted (default)" in md
    assert metrics.mean_ci([1.0, 2.0, 3.0]) == pytest.approx((2.0, 4.303 / 3 ** 0.5))


def test_cli_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    assert cli.main(["trace", "--workload", "mixed", "--requests", "300", "--rate", "100",
                     "--out", str(trace)]) == 0
    assert cli.main(["run", "--fleet", "homo", "--trace", str(trace), "--rate", "100",
                     "--requests", "300", "--seeds", "1", "--policies",
                     "predicted_latency,least_request"]) == 0
    assert "| predicted (default) |" in capsys.readouterr().out
    out = tmp_path / "plan"
    assert cli.main(["--fleet", "homo", "--fleet", "hetero-speed", "--trace", str(trace),
                     "--slo", "200:20", "--rates", "50,100", "--seeds", "1",
                     "--requests", "300", "--out", str(out)]) == 0
    assert (out / "plan.png").stat().st_size > 0
    plan = json.loads((out / "plan.json").read_text())
    assert set(plan) == {"homo", "hetero-speed"}


def test_gpumesh_sim_entry_point(tmp_path: Path) -> None:
    """`gpumesh sim --fleet ... --trace ... --slo ...` (the plan) and a subcommand, through the
    product's command line and the gpumesh.commands entry point."""
    from gpumesh.cli import main as gpumesh_main

    trace = tmp_path / "t.jsonl"
    assert gpumesh_main(["sim", "trace", "--requests", "200", "--rate", "80",
                         "--out", str(trace)]) == 0
    out = tmp_path / "plan"
    assert gpumesh_main(["sim", "--fleet", "homo", "--trace", str(trace), "--slo", "300:30",
                         "--rates", "80", "--seeds", "1", "--requests", "200",
                         "--out", str(out)]) == 0
    assert json.loads((out / "plan.json").read_text())["homo"]["points"]


def test_grid_shards_merge_and_replace(tmp_path: Path) -> None:
    """N shards run disjoint (cell, policy) units that together are the whole grid; merging
    gives one record per cell with every policy; --replace re-runs one policy in place."""
    caps = tmp_path / "cap.json"
    caps.write_text(json.dumps({"homo/lognormal": 300.0, "hetero-kv/lognormal": 300.0}))
    common = ["grid", "--fleets", "homo,hetero-kv", "--workloads", "lognormal", "--loads",
              "0.8", "--seeds", "1", "--requests", "150", "--capacities", str(caps),
              "--no-report"]
    all_units = grid.units(["homo", "hetero-kv"], ["lognormal"], [0.8], list(grid.POLICIES),
                           150, [1])
    shards = [grid.units(["homo", "hetero-kv"], ["lognormal"], [0.8], list(grid.POLICIES),
                         150, [1], shard=(k, 3)) for k in range(3)]
    assert sorted(u for s in shards for u in s) == sorted(all_units) and len(all_units) == 8
    for k in range(3):
        assert cli.main([*common, "--shard", f"{k}/3", "--out", str(tmp_path / f"s{k}")]) == 0
    merged = tmp_path / "merged.jsonl"
    assert cli.main(["merge", *(str(tmp_path / f"s{k}" / "grid.jsonl") for k in range(3)),
                     "--out", str(merged)]) == 0
    recs = grid.read_records(merged)
    assert [(r["fleet"], list(r["runs"])) for r in recs] == [
        ("homo", list(grid.POLICIES)), ("hetero-kv", list(grid.POLICIES))]
    # nothing left to do once the merged file is had
    assert grid.units(["homo", "hetero-kv"], ["lognormal"], [0.8], list(grid.POLICIES), 150,
                      [1], have=recs) == []
    before = {r["fleet"]: r["runs"]["least_request"] for r in recs}
    wll = {r["fleet"]: r["runs"]["predicted_latency"] for r in recs}
    out = tmp_path / "out"
    out.mkdir()
    (out / "grid.jsonl").write_text(merged.read_text())
    assert cli.main([*common, "--policies", "predicted_latency", "--replace",
                     "--router", "routing=objective=min_ttft", "--out", str(out)]) == 0
    again = grid.read_records(out / "grid.jsonl")
    assert len(again) == 2 and all(list(r["runs"]) == list(grid.POLICIES) for r in again)
    assert {r["fleet"]: r["runs"]["least_request"] for r in again} == before
    assert {r["fleet"]: r["runs"]["predicted_latency"] for r in again} != wll
    assert grid.units(["homo"], ["lognormal"], [0.8], list(grid.POLICIES), 150, [1],
                      have=again, replace=["least_request"]) == [
        ("homo", "lognormal", 0.8, "least_request")]
    assert grid.units(["homo", "hetero-kv"], ["lognormal"], [0.8], ["least_request"], 150,
                      [1], skip=["homo/lognormal"]) == [
        ("hetero-kv", "lognormal", 0.8, "least_request")]
    with pytest.raises(SystemExit):
        cli.main([*common, "--shard", "3/3", "--out", str(tmp_path / "bad")])
