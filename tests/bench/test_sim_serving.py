"""The serving path as queues (``gpumesh_bench.sim.serving``): the FIFO arithmetic, the node's
coalescing of stream messages, its effect on a simulated request's TTFT and end-to-end time
(a lone request pays each service time once; a burst queues behind itself), the profile keys
that carry the costs, and the least-squares fit ``frontcal`` measures them with."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from gpumesh import profiles
from gpumesh.profile_schema import ProfileError
from gpumesh_bench.sim import fidelity
from gpumesh_bench.sim.core import Simulation
from gpumesh_bench.sim.fidelity_trace import build
from gpumesh_bench.sim.frontcal import fit
from gpumesh_bench.sim.serving import FifoServer, NodeFrontEnd, ServingCosts
from gpumesh_bench.sim.workloads import Arrival, Workload

STEP = {"step_a_ms": 2.0, "step_b_decode_ms": 0.1, "step_b_prefill_ms": 0.01,
        "front_end_ms": 0.0}
COSTS = {"front_end_cpu_request_ms": 3.0, "front_end_cpu_output_ms": 0.5,
         "front_end_cpu_message_ms": 0.25, "front_end_cpu_prompt_token_ms": 0.0,
         "router_cpu_request_ms": 2.0, "router_cpu_message_ms": 0.75,
         "router_cpu_prompt_token_ms": 0.0}


def _fleet(profile: dict[str, float], nodes: tuple[str, ...] = ("e0",)):
    return fidelity.sim_fleet(nodes, profile, max_num_seqs=64, max_num_batched_tokens=2048,
                              kv_capacity_tokens=1 << 20, max_context_length=4096)


def _run(profile: dict[str, float], arrivals: list[Arrival], nodes: tuple[str, ...] = ("e0",)):
    sim = Simulation(_fleet(profile, nodes), Workload("t", arrivals, []), "round_robin", 1)
    return sim, sim.run().records


def test_fifo_server_queues_work_in_arrival_order() -> None:
    s = FifoServer()
    assert s.serve(1.0, 10.0) == pytest.approx(1.010)
    assert s.serve(1.005, 10.0) == pytest.approx(1.020)   # waits for the first
    assert s.serve(1.015, 0.0) == pytest.approx(1.020)    # no work still waits its turn
    assert s.serve(2.0, 5.0) == pytest.approx(2.005)      # idle again: no wait
    assert s.busy_s == pytest.approx(0.025)


def test_costs_are_validated_and_off_by_default() -> None:
    assert not ServingCosts().enabled
    assert ServingCosts(router_request_ms=1.0).enabled
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="node_output_ms"):
            ServingCosts(node_output_ms=bad)


def test_node_coalesces_messages_like_the_node() -> None:
    fe = NodeFrontEnd(ServingCosts(node_output_ms=1.0, node_message_ms=10.0,
                                   flush_interval_s=0.02, messages_per_s=0.0))
    # step 1: the first token of "a" goes alone: 1 output, 1 message
    t, msgs = fe.step(0.0, [], ["a"], [])
    assert msgs == {"a": 1} and t == pytest.approx(0.011)
    # steps within the interval: outputs cost, no message
    t, msgs = fe.step(0.010, ["a"], [], [])
    assert msgs == {} and t == pytest.approx(0.012)
    # past the interval since the last message: a flush
    _, msgs = fe.step(0.025, ["a"], [], [])
    assert msgs == {"a": 1}
    # the end goes at once even inside the interval; a lone one-token request: one message
    _, msgs = fe.step(0.030, ["a"], ["b"], ["a", "b"])
    assert msgs == {"a": 1, "b": 1} and not fe.streams


def test_message_budget_widens_the_interval() -> None:
    fe = NodeFrontEnd(ServingCosts(node_message_ms=1.0, flush_interval_s=0.02,
                                   messages_per_s=100.0))
    fe.step(0.0, [], [f"r{i}" for i in range(5)], [])
    assert fe.interval() == pytest.approx(0.05)   # 5 streams / 100 per s
    _, msgs = fe.step(0.03, [f"r{i}" for i in range(5)], [], [])
    assert msgs == {}                              # 30 ms < 50 ms


def test_lone_request_pays_each_service_once() -> None:
    one = [Arrival(0, 0.0, 64, 1)]
    _, base = _run(STEP, one)
    _, with_costs = _run({**STEP, **COSTS}, one)
    # router request + node request + (1 output + 1 message) + router relay of 1 message
    extra_s = (2.0 + 3.0 + 0.5 + 0.25 + 0.75) / 1000
    assert with_costs[0].ttft_s - base[0].ttft_s == pytest.approx(extra_s, rel=1e-6)
    assert with_costs[0].e2e_s - base[0].e2e_s == pytest.approx(extra_s, rel=1e-6)


def test_a_burst_queues_at_the_router_and_front_end() -> None:
    burst = [Arrival(i, 0.0, 16, 1) for i in range(20)]
    costs = {**STEP, "router_cpu_request_ms": 5.0}
    _, recs = _run(costs, burst)
    ttft = sorted(r.ttft_s for r in recs)
    # one process: even the first request's first token is relayed only after the routing
    # work of the 20 requests that reached the router before it (100 ms)
    assert ttft[0] >= 0.100 - 1e-9 and ttft[-1] < 0.100 + 0.02
    sim, _ = _run({**STEP, "front_end_cpu_request_ms": 5.0}, burst)
    assert sim.path.fronts["e0"].server.busy_s == pytest.approx(0.100)


def test_serving_costs_leave_a_run_unchanged_when_zero() -> None:
    w = build("shared-prefix", 200, 20.0, 1, 4, 256)
    a = Simulation(_fleet(STEP, ("e0", "e1")), w, "least_request", 1).run().records
    b = Simulation(_fleet({**STEP, **{k: 0.0 for k in COSTS}}, ("e0", "e1")), w,
                   "least_request", 1).run().records
    assert [(r.ttft_s, r.e2e_s, r.node_id) for r in a] == [
        (r.ttft_s, r.e2e_s, r.node_id) for r in b]
    c = Simulation(_fleet({**STEP, **COSTS}, ("e0", "e1")), w, "least_request", 1).run()
    assert all(not r.error for r in c.records)
    assert sorted(r.ttft_s for r in c.records)[-2] > sorted(r.ttft_s for r in a)[-2]


def test_prompt_tokens_cost_at_router_and_front_end() -> None:
    long, short = [Arrival(0, 0.0, 1024, 1)], [Arrival(0, 0.0, 16, 1)]
    costs = {**STEP, "router_cpu_prompt_token_ms": 0.01, "front_end_cpu_prompt_token_ms": 0.002}
    d_long = _run(costs, long)[1][0].ttft_s - _run(STEP, long)[1][0].ttft_s
    d_short = _run(costs, short)[1][0].ttft_s - _run(STEP, short)[1][0].ttft_s
    assert d_long == pytest.approx(1024 * 0.012 / 1000, rel=1e-6)
    assert d_short == pytest.approx(16 * 0.012 / 1000, rel=1e-6)


def test_fixed_delay_is_what_the_front_end_work_does_not_explain() -> None:
    f = _fleet({**STEP, "front_end_ms": 6.0, **COSTS})
    lone = 3.0 + 0.5 + 0.25
    assert f.network_delay_s == pytest.approx((6.0 - lone) / 2000)
    assert _fleet({**STEP, "front_end_ms": 2.0, **COSTS}).network_delay_s == 0.0
    assert _fleet({**STEP, "front_end_ms": 6.0}).network_delay_s == pytest.approx(0.003)


def test_profile_carries_the_costs_and_old_profiles_load() -> None:
    base = profiles.builtin_profile("tiny-cpu")
    assert base.router_cpu_request_ms == 0.0 and base.front_end_cpu_output_ms == 0.0
    p = replace(base, front_end_cpu_request_ms=1.5, front_end_cpu_output_ms=0.2,
                front_end_cpu_message_ms=0.3, router_cpu_request_ms=0.9,
                router_cpu_message_ms=0.1)
    text = profiles.dumps_profile(p)
    assert "[router]" in text and "cpu_message_ms = 0.1" in text
    assert profiles.loads_profile(text) == p
    with pytest.raises(ProfileError, match=r"router\.cpu_request_ms"):
        profiles.loads_profile(text.replace("cpu_request_ms = 0.9", "cpu_request_ms = -1.0"))
    with pytest.raises(ProfileError, match=r"router\.cpu_per_request: unknown key"):
        profiles.loads_profile(text.replace("[router]\n", "[router]\ncpu_per_request = 1.0\n"))


def test_fidelity_profile_round_trip(tmp_path) -> None:
    doc = {**STEP, "step_c_decode_ms": 0.0, **COSTS}
    path = tmp_path / "p.toml"
    live = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "kv_capacity_tokens": 1 << 20}
    path.write_text(fidelity.profile_toml(doc, live), encoding="utf-8")
    back = fidelity.load_profile(str(path))
    assert {k: back[k] for k in COSTS} == COSTS
    assert fidelity.serving_costs(back) == ServingCosts(3.0, 0.5, 0.25, 2.0, 0.75)
    assert fidelity.serving_costs({**back, "router_cpu_prompt_token_ms": 0.01}
                                  ).router_prompt_token_ms == 0.01
    assert fidelity.serving_costs(STEP) is None


def test_fit_recovers_costs_and_drops_negative_terms() -> None:
    true = {"requests": 2.0, "outputs": 0.3, "messages": 0.8}
    shapes = [(100, 100, 100), (50, 1600, 1600), (50, 1600, 100), (100, 100, 100),
              (50, 1600, 1600), (50, 1600, 100)]
    rows = [{"requests": n, "outputs": o, "messages": m,
             "y": sum(true[k] * v for k, v in (("requests", n), ("outputs", o),
                                                ("messages", m))) * (1 + 0.01 * (i % 2))}
            for i, (n, o, m) in enumerate(shapes)]
    got = fit(rows, ("requests", "outputs", "messages"), "y")
    for k, v in true.items():
        assert got[k] == pytest.approx(v, rel=0.05)
    neg = [{"requests": n, "messages": m, "y": 2.0 * n - 0.1 * m} for n, _, m in shapes]
    assert set(fit(neg, ("requests", "messages"), "y")) == {"requests"}


@pytest.mark.timeout(300)
def test_frontcal_probes_a_live_router_and_node(tmp_path) -> None:
    """``frontcal.measure`` through a real router to a real node (the simulated engine): the
    client counts the outputs and stream messages each shape must give (one message for a
    one-token request, one per token with ``per_token``, two when coalesced over 1 s), and the
    CPU the node's and the router's processes took is fitted to non-negative costs, some of
    the node's above 0 (CPU time is read in clock ticks: a short probe cannot pin each)."""
    import asyncio

    from gpumesh.launcher import ChildProcess, free_port, stop_all, wait_until_async
    from gpumesh.v1 import control_pb2 as cpb
    from gpumesh.v1 import control_pb2_grpc as cpb_grpc
    from gpumesh_bench.fleet import group_cpu_s
    from gpumesh_bench.sim.frontcal import measure

    rport, nport = free_port(), free_port()
    router = ChildProcess.gpumesh("router", ["router", "--host", "127.0.0.1", "--port",
                                             str(rport), "--policy", "round_robin"],
                                  tmp_path / "router.log", die_with_parent=True,
                                  term_group=True)
    node = ChildProcess.gpumesh("node", ["node", "--engine", "sim", "--host", "127.0.0.1",
                                         "--port", str(nport), "--node-id", "s0",
                                         "--served-name", "tiny", "--router",
                                         f"127.0.0.1:{rport}"],
                                tmp_path / "node.log", die_with_parent=True, term_group=True)

    def cpu() -> dict[str, float]:
        return {"front_end": group_cpu_s(node.pid), "router": group_cpu_s(router.pid)}

    async def run() -> dict:
        import grpc

        async with grpc.aio.insecure_channel(f"127.0.0.1:{rport}") as ch:
            stub = cpb_grpc.RouterStub(ch)

            async def ready() -> bool:
                fl = await stub.GetFleet(cpb.GetFleetRequest(), timeout=2)
                return any(n.node_id == "s0" and n.state == cpb.NodeState.Value(
                    "NODE_STATE_HEALTHY") for n in fl.nodes)

            await wait_until_async(ready, 60, watch=[router, node], what="node s0 healthy")
        return await measure(f"127.0.0.1:{rport}", cpu, "tiny", 30_000, requests=12,
                             out_tokens=8, reps=1, concurrency=4, idle_s=0.5)

    try:
        got = asyncio.run(run())
    finally:
        stop_all([node, router], 10)
    per = {r["shape"]: r for r in got["probes"]}
    assert set(per) == {"one", "long", "per_token", "coalesced"}
    assert per["one"]["outputs"] == per["one"]["messages"] == per["one"]["requests"] == 24
    assert per["long"]["prompt_tokens"] == 24 * 512 and per["long"]["messages"] == 24
    assert per["per_token"]["outputs"] == per["per_token"]["messages"] == 12 * 8
    assert per["coalesced"]["outputs"] == 12 * 8 and per["coalesced"]["messages"] == 12 * 2
    keys = [k for k in got if k.startswith(("front_end_cpu_", "router_cpu_"))]
    assert len(keys) == 7 and all(got[k] >= 0 for k in keys)
    assert any(got[k] > 0 for k in keys if k.startswith("front_end_"))


def test_rescale_fits_one_workload_and_holds_out_the_other() -> None:
    """Costs carried to another host: scaled so that the simulated front-end and router work
    of the fitted workload's runs equals the CPU their processes used there (vLLM's own
    processes and the idle routers' background left out); the other workload is held out."""
    from gpumesh_bench.sim.frontcal import rescale, run_cpu

    procs = {"node-e0/python/1": 0.20, "node-e0/VLLM::EngineCor/2": 0.95,
             "node-e1/python/3": 0.30, "router-round_robin/python/4": 0.25,
             "router-least_request/python/5": 0.05}
    doc = {"live": {"node_engines": {"e0": "vllm", "e1": "vllm"}, "max_num_seqs": 64,
                    "max_num_batched_tokens": 2048, "kv_capacity_tokens": 1 << 20,
                    "max_model_len": 4096},
           "trace": {"seed": 1, "tenants": 2, "system_tokens": 256},
           "workloads": {w: {"rate": 20.0, "requests": 100} for w in ("shared-prefix", "unique")},
           "live_runs": {w: {"round_robin": {"wall_s": 10.0, "cpu_cores_by_process": procs}}
                         for w in ("shared-prefix", "unique")}}
    profile = {**STEP, **COSTS, "front_end_cpu_prompt_token_ms": 0.001}
    before = {r["workload"]: r for r in run_cpu(doc, profile)}
    assert before["shared-prefix"]["live_front_end_s"] == pytest.approx(5.0)   # (0.2+0.3) x 10
    assert before["shared-prefix"]["live_router_s"] == pytest.approx(2.0)      # (0.25-0.05) x 10
    scaled, check = rescale(doc, profile, "shared-prefix")
    k_fe = 5.0 / before["shared-prefix"]["sim_front_end_s"]
    k_rt = 2.0 / before["shared-prefix"]["sim_router_s"]
    assert scaled["front_end_scale"] == pytest.approx(k_fe)
    assert scaled["front_end_cpu_output_ms"] == pytest.approx(0.5 * k_fe)
    assert scaled["router_cpu_message_ms"] == pytest.approx(0.75 * k_rt)
    rows = {r["workload"]: r for r in check}
    fitted = rows["shared-prefix"]
    assert not fitted["held_out"] and rows["unique"]["held_out"]
    assert fitted["sim_front_end_s"] == pytest.approx(5.0, rel=0.02)
    assert fitted["sim_router_s"] == pytest.approx(2.0, rel=0.02)
    with pytest.raises(ValueError, match="no live run of 'other'"):
        rescale(doc, profile, "other")


def test_frontcal_writes_the_costs_into_an_engine_profile(tmp_path) -> None:
    """``--median RUN.json... --into PROFILE``: the profile as it was (step model, samples)
    with each serving cost the median over the runs."""
    import json

    from gpumesh_bench.sim.fidelity import SERVING_KEYS
    from gpumesh_bench.sim.frontcal import main

    base = profiles.builtin_profile("tiny-cpu")
    profiles.dump_profile(base, tmp_path / "base.toml")
    runs = []
    for i, scale in enumerate((1.0, 3.0, 2.0)):
        f = tmp_path / f"run{i}.json"
        f.write_text(json.dumps({k: scale * (j + 1) for j, k in enumerate(SERVING_KEYS)}))
        runs.append(str(f))
    out = tmp_path / "out.toml"
    assert main(["--median", *runs, "--into", str(tmp_path / "base.toml"),
                 "--out", str(out)]) == 0
    got = profiles.load_profile(out)
    for j, k in enumerate(SERVING_KEYS):
        assert getattr(got, k) == pytest.approx(2.0 * (j + 1))
    assert replace(got, **{k: getattr(base, k) for k in SERVING_KEYS}) == base


def test_validate_merge_with_serving_costs(tmp_path) -> None:
    """``gpumesh sim validate --merge FILE --serving PROFILE --policies P``: the simulator
    re-run with the profile's serving costs on the named policies' live runs only, its TTFT
    above the same merge without them, both commands in validate.md."""
    import gzip
    import json

    from gpumesh_bench.sim.cli import build_parser
    from gpumesh_bench.sim.validate import validate

    live = {m: 50.0 for m in fidelity.METRICS} | {"share": {"e0": 0.5, "e1": 0.5},
                                                   "prefix_hit": 0.0}
    doc = {"command": "gpumesh sim validate (live)", "profile": STEP,
           "live": {"node_engines": {"e0": "vllm", "e1": "vllm"}, "max_num_seqs": 64,
                    "max_num_batched_tokens": 2048, "kv_capacity_tokens": 1 << 20,
                    "max_model_len": 4096},
           "trace": {"seed": 1, "tenants": 2, "system_tokens": 256},
           "workloads": {"unique": {"rate": 20.0, "requests": 80}},
           "live_runs": {"unique": {"round_robin": live, "least_request": live}}}
    src = tmp_path / "validate.json.gz"
    src.write_bytes(gzip.compress(json.dumps(doc).encode()))
    prof = tmp_path / "serving.toml"
    prof.write_text(fidelity.profile_toml({**STEP, **COSTS}, {
        "max_num_seqs": 64, "max_num_batched_tokens": 2048, "kv_capacity_tokens": 1 << 20}))
    out = {}
    for name, extra in (("plain", []), ("serving", ["--serving", str(prof)])):
        argv = ["validate", "--merge", str(src), "--policies", "round_robin", "--sim-seeds",
                "1", "--out", str(tmp_path / name), *extra]
        a = build_parser().parse_args(argv)
        a.argv = argv[1:]
        assert validate(a) == 0
        out[name] = json.loads((tmp_path / name / "validate.json").read_text())
    s, p = out["serving"], out["plain"]
    assert list(s["sim_runs"]["unique"]) == ["round_robin"]
    assert s["profile"]["router_cpu_message_ms"] == 0.75
    assert "router_cpu_message_ms" not in p["profile"] or p["profile"][
        "router_cpu_message_ms"] == 0.0
    sr, pr = s["sim_runs"]["unique"]["round_robin"], p["sim_runs"]["unique"]["round_robin"]
    assert sr["ttft_p50"] > pr["ttft_p50"] and sr["router_busy"] > 0 == pr["router_busy"]
    md = (tmp_path / "serving" / "validate.md").read_text()
    assert md.startswith("Live runs: `gpumesh sim validate (live)`")
    assert "--serving" in md.splitlines()[2]
