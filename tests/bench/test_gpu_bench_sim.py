"""The GPU benchmark end to end on simulated nodes (``--engine sim``): real node and router
processes, real load processes. Checks the bench's own bookkeeping, not any speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpumesh_bench.gpu import cli as gpu_cli
from gpumesh_bench.gpu import env as gpu_env
from gpumesh_bench.gpu import reference, vsraw
from gpumesh.node.config import load_node_config

pytestmark = [pytest.mark.slow]


def test_fleet_polls_share_the_loads_clock(tmp_path: Path, monkeypatch) -> None:
    # Warm-up 4 s (past the node's 3 s rate window), 6 s measured. The fleet table of a bench
    # must describe the load's own window: the load processes start 2 + 0.2 x procs s after
    # the bench is called, so a fleet sampler counting from the call would put its "window"
    # 3.6 s early here (before the first request), its node rates and in-flight means taking
    # in the ramp. What is checked is that the clocks are one (the sampler's origin is the
    # load's start instant), not how soon the load ramps up: a busy machine may delay it.
    from gpumesh_bench import multiproc
    from gpumesh_bench.gpu import measure

    origins: list[float] = []
    starts: list[float] = []

    class Sampler(measure.FleetSampler):
        def __init__(self, router: str, status_at_s: float | None,
                     origin: float | None = None) -> None:
            origins.append(origin)
            super().__init__(router, status_at_s, origin)

    run_multi = multiproc.run_multi

    def recording_run_multi(*args, start_at, **kwargs):
        starts.append(start_at)
        return run_multi(*args, start_at=start_at, **kwargs)

    monkeypatch.setattr(measure, "FleetSampler", Sampler)
    monkeypatch.setattr(multiproc, "run_multi", recording_run_multi)
    out = tmp_path / "out"
    rc = gpu_cli.main(["run", "--engine", "sim", "--phases", "dp05", "--rounds", "1",
                   "--workers", "1", "--procs", "8", "--warmup", "4", "--seconds", "6",
                   "--sim-time-scale", "4", "--output", "uniform:64:192",
                   "--model-root", str(tmp_path / "models"), "--budget", "300",
                   "--node-option", "stream_messages_per_s=1500", "--out", str(out)])
    assert rc == 0
    recs = json.loads((out / "results.json").read_text())["records"]
    # --node-option: a key of every node's TOML (by its name), recorded with each bench
    assert all(r["node_options"] == {"stream_messages_per_s": 1500} for r in recs)
    for node in ("a05b", "b05b"):
        cfg = load_node_config(out / "logs" / f"{node}.toml", environ={})
        assert cfg.streaming.stream_messages_per_s == 1500
    assert {r["setup"] for r in recs} == {"2 GPUs data parallel, router #0",
                                          "2 GPUs data parallel, direct (client splits) #0"}
    # one sampler per bench, counting from the instant every load process of it starts at
    assert len(origins) == len(recs) and None not in origins
    assert sorted(set(starts)) == sorted(origins), (starts, origins)
    for r in recs:
        c, warm, win = r["concurrency"], r["warmup_s"], r["window_s"]
        polls = r["fleet_polls"]   # [t, node, running, waiting, in flight, tok/s, step ms]
        assert {p[1] for p in polls} == {"a05b", "b05b"}, r["setup"]
        by_t: dict[float, int] = {}
        for p in polls:
            by_t[p[0]] = by_t.get(p[0], 0) + p[4]
        # Polls count from the load's start: polls from before it, nothing in flight then;
        # most of the closed loop's streams in flight at some poll after it.
        assert min(by_t) < -0.5 and all(f == 0 for t, f in by_t.items() if t < -0.5), by_t
        first = min(t for t, f in by_t.items() if f >= 0.5 * c)
        assert first >= 0, by_t
        assert any(warm <= t <= warm + win for t in by_t), by_t
        fleet = r["fleet"]
        if "split" in r["setup"]:
            # without the router's hop (CPU-bound on 2 cores) every stream sits in a node
            assert sum(v["in_flight_mean"] for v in fleet.values()) >= 0.8 * c, fleet
        # the nodes' own generation rates add up to what the clients received
        node_tok = sum(v["tok_s_mean"] for v in fleet.values())
        assert 0.7 * r["out_tok_s"] <= node_tok <= 1.3 * r["out_tok_s"], (node_tok, r["out_tok_s"])


def test_message_budget_phase_pairs_budget_and_fixed_benches(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["run", "--engine", "sim", "--phases", "msg05", "--rounds", "1",
            "--workers", "1", "--procs", "2", "--warmup", "1", "--seconds", "2",
            "--sim-time-scale", "4", "--sim-scale-intervals", "--output", "fixed:32",
            "--model-root", str(tmp_path / "models"), "--budget", "600", "--out", str(out)]
    assert gpu_cli.main(argv) == 0
    recs = json.loads((out / "results.json").read_text())["records"]
    # one GPU direct, then data parallel through the router: budget, then the node's base
    # interval asked for by every request (20 ms x the time scale of a slowed simulation)
    assert [(r["setup"], r.get("flush_interval_ms")) for r in recs] == [
        ("1 GPU, direct to node, message budget #0", None),
        ("1 GPU, direct to node, fixed 80 ms #0", 80),
        ("2 GPUs data parallel, router, message budget #0", None),
        ("2 GPUs data parallel, router, fixed 80 ms #0", 80)]
    # each record names its pair, and the call that measured it
    assert [(r["call"], r["base_setup"], r["round"], r["leg"]) for r in recs] == [
        (1, "1 GPU, direct to node", 0, "budget"), (1, "1 GPU, direct to node", 0, "fixed"),
        (1, "2 GPUs data parallel, router", 0, "budget"),
        (1, "2 GPUs data parallel, router", 0, "fixed")]
    assert all(r["errors"] == 0 and r["done_qps"] > 0 for r in recs)
    assert "--flush-interval-ms 80" in recs[1]["command"]
    assert "| msg05 | 1 GPU, direct to node, message budget #0 |" in (out / "summary.md").read_text()
    # a second call on the same results: its records are call 2's, and the summary keeps both
    assert gpu_cli.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["meta"]["calls"]) == 2
    assert [r["call"] for r in doc["records"]] == [1] * 4 + [2] * 4
    md = (out / "summary.md").read_text()
    for call in (1, 2):
        row = next(ln for ln in md.splitlines() if ln.startswith(
            f"| msg05 | 1 GPU, direct to node, message budget #0 (call {call}) |"))
        assert row.split(" | ")[5] != "-", row   # x fixed: paired with its own call's bench


def _small_run(tmp_path: Path, out: Path, phases: str, *more: str) -> list[str]:
    """``gpu run`` argv of a short simulated call: 1 s + 2 s benches, a small load."""
    return ["run", "--engine", "sim", "--phases", phases, *more,
            "--workers", "1", "--procs", "2", "--warmup", "1", "--seconds", "2",
            "--sim-time-scale", "4", "--output", "fixed:32",
            "--model-root", str(tmp_path / "models"), "--budget", "600", "--out", str(out)]


def test_frontends_phase_restarts_nodes_per_leg_and_pairs_them(tmp_path: Path) -> None:
    # Simulated nodes have one process, so both legs run one front end here (--frontends 1):
    # this checks the phase's restarts, records and pairing; several front ends per node are
    # tested on the vLLM CPU engine (tests/node/test_frontends.py).
    out = tmp_path / "out"
    argv = _small_run(tmp_path, out, "fe05", "--frontends", "1")
    assert gpu_cli.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    recs = doc["records"]
    assert [(r["base_setup"], r["leg"], r["frontends"]) for r in recs] == [
        ("1 GPU, direct to node", "fe1", 1), ("1 GPU, through router", "fe1", 1),
        ("2 GPUs data parallel, router", "fe1", 1)] * 2
    assert all(r["errors"] == 0 and r["done_qps"] > 0 for r in recs)
    assert all(r["node_options"] == {"frontends": 1} for r in recs)
    assert "fe05 frontends=1" in doc["meta"]["commands"]
    assert "| fe05 | 1 GPU, through router, 1 front ends #0 |" in (out / "summary.md").read_text()
    # several front ends need vLLM nodes: the phase fails with that reason, the call goes on
    out2 = tmp_path / "out2"
    argv2 = [a if a != str(out) else str(out2) for a in argv]
    argv2[argv2.index("--frontends") + 1] = "2"
    assert gpu_cli.main(argv2) == 1
    failed = json.loads((out2 / "results.json").read_text())["meta"]["failed"]
    assert failed and "need vLLM nodes" in failed[0]


def test_vs_raw_phase_keeps_the_nodes_up_and_alternates_the_legs(tmp_path: Path,
                                                                 monkeypatch) -> None:
    # The raw legs need the raw reference tool on vLLM CUDA (skipped on the simulator, and
    # said so); this checks the node legs' order, records and the budget's round cut.
    out = tmp_path / "out"
    argv = _small_run(tmp_path, out, "vsraw05", "--rounds", "2", "--vs-eng")
    assert gpu_cli.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    recs = doc["records"]
    # round 0: (raw,) engine loop, router, direct; round 1 reversed: direct, router, engine
    # loop (, raw)
    assert [(r["setup"], r["round"], r["leg"], r["base_setup"]) for r in recs] == [
        ("engine loop, same GPU #0", 0, "eng", "1 GPU"),
        ("1 GPU, through router #0", 0, "router", "1 GPU"),
        ("1 GPU, direct to node #0", 0, "direct", "1 GPU"),
        ("1 GPU, direct to node #1", 1, "direct", "1 GPU"),
        ("1 GPU, through router #1", 1, "router", "1 GPU"),
        ("engine loop, same GPU #1", 1, "eng", "1 GPU")]
    assert all(r["errors"] == 0 and r["done_qps"] > 0 and r["gpu_mem"] == 0.42 for r in recs)
    assert all(r["phase"] == "vsraw05" for r in recs)
    # the engine loop runs the node's TOML (its engine, built by the node's code)
    node = (out / "logs" / "v05b.toml").read_text()
    assert (out / "logs" / "eng05b-vsraw05-0-0.toml").read_text() == node
    assert [len(r["parts"]) for r in recs if r["leg"] == "eng"] == [1, 1]
    # one node for the whole phase: its one start command
    assert len([c for c in doc["meta"]["commands"]["vsraw05"] if " node " in c]) == 1
    assert "| vsraw05 | 1 GPU, through router #1 |" in (out / "summary.md").read_text()
    # data parallel, with a budget that holds the nodes' start and one round only: the
    # second round is not started, and the call says so; an engine loop that fails costs
    # only its own leg
    monkeypatch.setitem(vsraw.VSRAW_START_S, "vsrawdp05", 0)
    monkeypatch.setitem(vsraw.VSRAW_RAW_S, "0.5b", 0)
    monkeypatch.setitem(vsraw.VSRAW_BENCH_S, "0.5b", 15)
    monkeypatch.setitem(vsraw.VSRAW_ENG_S, "0.5b", 0)

    def failing_loop(*_a: object, **_k: object) -> None:
        raise RuntimeError("eng 0.5b: 1 of 2 loops gave no result")
    monkeypatch.setattr(vsraw, "run_eng", failing_loop)
    out2 = tmp_path / "out2"
    argv2 = [a if a != str(out) else str(out2) for a in argv]
    argv2[argv2.index("--phases") + 1] = "vsrawdp05"
    argv2[argv2.index("--budget") + 1] = "32"
    assert gpu_cli.main(argv2) == 0
    doc2 = json.loads((out2 / "results.json").read_text())
    recs2 = doc2["records"]
    assert [(r["setup"], r["leg"], r["concurrency"]) for r in recs2] == [
        ("2 GPUs data parallel, router #0", "router", 128),
        ("2 GPUs data parallel, direct (client splits) #0", "direct", 128)]
    assert all(r["errors"] == 0 for r in recs2)
    assert len(recs2[1]["node_share"]) == 2 and len(recs2[0]["node_share"]) == 2
    assert doc2["meta"]["cut"] == ["vsrawdp05: 1 of 2 rounds"]
    assert doc2["meta"]["failed"] == ["vsrawdp05 eng #0: eng 0.5b: 1 of 2 loops gave no result"]


def test_vs_raw_variant_nodes_are_benched_in_the_same_rounds(tmp_path: Path) -> None:
    # --vs-variant: a second set of nodes behind their own router, up through the phase next
    # to the first, benched in the same rounds; --vs-legs keeps two legs. (The simulator has
    # no engine arguments: the variant's TOML is checked for vLLM nodes below.)
    out = tmp_path / "out"
    argv = _small_run(tmp_path, out, "vsrawdp05", "--rounds", "2", "--vs-legs", "router,router-x",
                      "--vs-variant", 'compilation_config={"cudagraph_mode": "FULL"}')
    assert gpu_cli.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    recs = doc["records"]
    assert [(r["setup"], r["leg"]) for r in recs] == [
        ("2 GPUs data parallel, router #0", "router"),
        ("2 GPUs data parallel, router, variant #0", "router-x"),
        ("2 GPUs data parallel, router, variant #1", "router-x"),
        ("2 GPUs data parallel, router #1", "router")]
    assert all(r["errors"] == 0 and r["done_qps"] > 0 and r["gpu_mem"] == 0.28 for r in recs)
    variant = {"compilation_config": {"cudagraph_mode": "FULL"}}
    assert [r.get("variant") for r in recs] == [None, variant, variant, None]
    # each router's streams went to its own two nodes only
    assert [sorted(r["fleet"]) for r in recs] == [["v05b", "w05b"], ["x05b", "y05b"],
                                                   ["x05b", "y05b"], ["v05b", "w05b"]]
    cmds = doc["meta"]["commands"]["vsrawdp05"]
    assert len([c for c in cmds if " node " in c]) == 4
    assert len([c for c in cmds if " router " in c]) == 2
    assert doc["meta"]["calls"][0]["vs_variant"] == variant
    # an unknown leg is refused before anything starts
    with pytest.raises(SystemExit, match="unknown leg"):
        gpu_cli.main(_small_run(tmp_path, tmp_path / "out2", "vsraw05", "--vs-legs", "router,nope"))


def test_node_toml_puts_a_nodes_engine_args_over_the_calls(tmp_path: Path) -> None:
    env = gpu_env.Env(out=tmp_path, engine="vllm", models={"0.5b": tmp_path / "m"}, workers=1,
                  procs=1, warmup_s=1, window_s=1, max_model_len=2048, sim_time_scale=1,
                  small_kv_blocks=0, engine_args={"stream_interval": 4, "max_num_seqs": 256})
    spec = gpu_env.GpuNodeSpec("x05b", engine_args={"compilation_config": {"cudagraph_mode": "FULL"},
                                              "max_num_seqs": 512})
    (tmp_path / "x.toml").write_text(gpu_env.node_toml(env, spec))
    cfg = load_node_config(tmp_path / "x.toml", environ={})
    assert dict(cfg.engine.engine_args) == {"enable_prefix_caching": False, "seed": 0,
                                     "stream_interval": 4, "max_num_seqs": 512,
                                     "compilation_config": {"cudagraph_mode": "FULL"}}


# A stand-in for the raw reference tool (``--raw-tool``, which needs vLLM CUDA): it takes the
# tool's flags, logs its argv and CUDA_VISIBLE_DEVICES, and writes a record of the tool's shape
# to --json. GPU 9 makes it fail without a record. It checks how run_raw drives and reads the
# tool; the real tool runs on a GPU host only.
RAW_STANDIN = '''
import argparse, json, os, sys
ap = argparse.ArgumentParser()
for f in ("--shape", "--base", "--json", "--tag"):
    ap.add_argument(f, default="")
for f in ("--tp", "--concurrency", "--seed"):
    ap.add_argument(f, type=int, default=0)
for f in ("--seconds", "--warmup", "--gpu-mem"):
    ap.add_argument(f, type=float, default=0.85)
a = ap.parse_args()
gpu = os.environ["CUDA_VISIBLE_DEVICES"]
with open(os.path.join(os.path.dirname(a.json), "argv.log"), "a") as f:
    f.write(json.dumps({"gpu": gpu, "argv": sys.argv[1:]}) + "\\n")
if gpu == "9":
    sys.exit(1)
rec = dict(shape=a.shape, tp=a.tp, gpus=gpu, concurrency=a.concurrency, seconds=a.seconds,
           completed=10, qps=10.0 + int(gpu), out_tok_s=2560.0, lat_p50=0.8 + int(gpu) / 10,
           lat_p99=1.0, ttft_p50=0.05, gpu_mem=a.gpu_mem, seed=a.seed)
with open(a.json, "a") as f:
    f.write(json.dumps(rec) + "\\n")
'''


def test_run_raw_drives_the_reference_tool_per_gpu_and_sums_its_records(tmp_path: Path) -> None:
    tool = tmp_path / "raw_standin.py"
    tool.write_text(RAW_STANDIN)
    env = gpu_env.Env(out=tmp_path / "out", engine="vllm", models={"0.5b": tmp_path / "m"},
                  workers=1, procs=1, warmup_s=4.0, window_s=15.0, max_model_len=2048,
                  sim_time_scale=1.0, small_kv_blocks=0, raw_tool=str(tool), call=1)
    x = {"round": 1, "leg": "raw", "base_setup": "2 GPUs data parallel", "gpu_mem": 0.42}
    rec = reference.run_raw(env, "0.5b", "raw vLLM, same GPUs #1", [("0", 64, 2), ("1", 64, 3)],
                      "vsrawdp05-1", phase="vsrawdp05", gpu_mem=0.42, extra=x)
    assert rec is not None and env.records == [rec]
    assert (rec["phase"], rec["setup"], rec["call"], rec["engine"]) == (
        "vsrawdp05", "raw vLLM, same GPUs #1", 1, "vllm-raw")
    assert rec["concurrency"] == 128 and rec["qps"] == 21.0 and rec["lat_p50"] == 0.9
    assert {k: rec[k] for k in x} == x
    # one process per GPU, each with its share of memory, its seed and its concurrency
    logged = [json.loads(ln) for ln in (env.logs / "argv.log").read_text().splitlines()]
    assert sorted(p["gpu"] for p in logged) == ["0", "1"]
    by_gpu = {p["gpus"]: p for p in rec["parts"]}
    assert [(by_gpu[g]["concurrency"], by_gpu[g]["seed"], by_gpu[g]["gpu_mem"])
            for g in ("0", "1")] == [(64, 2, 0.42), (64, 3, 0.42)]
    assert "CUDA_VISIBLE_DEVICES=1 python3 seed_table.py --shape 0.5b" in rec["command"]
    assert "--gpu-mem 0.42" in rec["command"]
    # without --gpu-mem the tool keeps its own default; a part without a record: no row
    assert reference.run_raw(env, "0.5b", "raw vLLM (in session)", [("9", 128, 0)], "x") is None
    assert "--gpu-mem" not in json.loads(
        (env.logs / "argv.log").read_text().splitlines()[-1])["argv"]
    assert env.records == [rec]
