"""``gpumesh sim validate``: a tiny trace through two real vLLM CPU engines behind a real
router and through the simulator; the report's structure, and that the live side ran real
engines (the router lists both nodes as vLLM, each served requests, token for token)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gpumesh_bench.sim import fidelity, fidelity_trace
from gpumesh_bench.sim.cli import build_parser
from gpumesh_bench.sim.fidelity import merge
from gpumesh_bench.sim.validate import validate

PROFILE = """format = "gpumesh.engine-profile/1"
[engine]
name = "test"
[step]
a_ms = 8.0
b_decode_ms = 0.4
c_decode_ms = 0.0
b_prefill_ms = 0.06
[front_end]
tokens_per_s = 0.0
request_overhead_ms = 4.0
"""


def test_traces_share_prefixes_only_where_they_should() -> None:
    shared = fidelity_trace.build("shared-prefix", 40, 5.0, seed=3, tenants=2)
    unique = fidelity_trace.build("unique", 40, 5.0, seed=3, tenants=2)
    salted = fidelity_trace.build("shared-prefix", 40, 5.0, seed=3, tenants=2, salt=1)
    assert [(a.arrival_s, a.prompt_tokens, a.output_tokens) for a in shared.arrivals] == [
        (a.arrival_s, a.prompt_tokens, a.output_tokens) for a in unique.arrivals]
    assert [a.arrival_s for a in salted.arrivals] == [a.arrival_s for a in shared.arrivals]
    heads = {a.blocks[:32] for a in shared.arrivals}
    assert len(heads) == 2   # one system prompt per tenant
    assert len({b for a in unique.arrivals for b in a.blocks}) == sum(
        len(a.blocks) for a in unique.arrivals)   # no block shared
    assert not {b for a in salted.arrivals for b in a.blocks} & {
        b for a in shared.arrivals for b in a.blocks}
    a0, a1 = shared.arrivals[0], next(a for a in shared.arrivals[1:]
                                      if a.blocks[:32] == shared.arrivals[0].blocks[:32])
    ids0, ids1 = (fidelity_trace.token_ids(a, 1000) for a in (a0, a1))
    assert len(ids0) == a0.prompt_tokens and ids0[:512] == ids1[:512] and ids0 != ids1


def test_compare_reports_errors_band_and_ranking() -> None:
    live = {"w": {"a": {"ttft_p50": 10.0, "ttft_p90": 20.0, "ttft_p99": 40.0, "e2e_p50": 100.0,
                        "e2e_p99": 200.0, "prefix_hit": 0.5, "share": {"e0": 0.5, "e1": 0.5}},
                  "b": {"ttft_p50": 20.0, "ttft_p90": 30.0, "ttft_p99": 50.0, "e2e_p50": 150.0,
                        "e2e_p99": 300.0, "prefix_hit": 0.4, "share": {"e0": 0.7, "e1": 0.3}}}}
    sim = {"w": {"a": {**live["w"]["a"], "ttft_p50": 12.0},
                 "b": {**live["w"]["b"], "ttft_p99": 100.0, "ttft_p50": 5.0}}}
    c = fidelity.compare(live, sim)
    rows = {r["policy"]: r for r in c["rows"]}
    assert math.isclose(rows["a"]["ttft_p50"]["err"], 0.2) and rows["a"]["within_band"]
    assert not rows["b"]["within_band"] and rows["b"]["worst"] == "ttft_p99"
    same = {k["metric"]: k["same"] for k in c["rankings"]}
    assert same["ttft_p50"] is False and same["e2e_p50"] is True
    sim["w"]["b"]["ttft_p90"] = 19.0   # live: a < b by 50 %; sim: b < a
    assert not {k["metric"]: k["same"] for k in fidelity.compare(live, sim)["rankings"]}[
        "ttft_p90"]
    sim["w"]["b"]["e2e_p99"] = 201.0   # live pair apart, sim in order by a hair: same
    assert {k["metric"]: k["same"] for k in fidelity.compare(live, sim)["rankings"]}["e2e_p99"]
    assert c["cells_within_band"] == 1 and c["ranking_cells"] == 5


@pytest.mark.timeout(600)
def test_validate_runs_real_engines_and_the_simulator(tmp_path: Path,
                                                      tiny_model_dir: Path) -> None:
    prof = tmp_path / "profile.toml"
    prof.write_text(PROFILE, encoding="utf-8")
    argv = ["validate", "--model", str(tiny_model_dir), "--policies", "round_robin",
            "--requests", "16", "--rate", "4", "--sim-seeds", "1", "--profile", str(prof),
            "--tenants", "2", "--out", str(tmp_path / "out")]
    a = build_parser().parse_args(argv)
    a.argv = argv[1:]
    assert validate(a) == 0
    doc = json.loads((tmp_path / "out" / "validate.json").read_text())
    assert doc["live"]["node_engines"] == {"e0": "vllm", "e1": "vllm"}
    assert doc["live"]["max_num_seqs"] == 64 and doc["live"]["kv_capacity_tokens"] > 0
    assert doc["profile"]["step_a_ms"] == 8.0
    for kind in ("shared-prefix", "unique"):
        live = doc["live_runs"][kind]["round_robin"]
        assert live["errors"] == 0 and live["requests"] == 16
        # the router's prediction check per node (round_robin predicts nothing: no sample)
        assert live["prediction"] == {n: {"scale": 0.0, "ttft_error_p50": 0.0}
                                      for n in ("e0", "e1")}
        reqs = live["requests_raw"]
        assert {r[4] for r in reqs} == {"e0", "e1"}    # round_robin alternates: both engines served
        trace = fidelity_trace.build(kind, 16, 4.0, 1, 2, 512)
        assert [r[5] for r in reqs] == [x.output_tokens for x in trace.arrivals]
        sim = doc["sim_runs"][kind]["round_robin"]
        assert sim["requests"] == 16 and sim["errors"] == 0
    c = doc["comparison"]
    assert c["cells"] == 2 and c["ranking_cells"] == 10
    for r in c["rows"]:
        for m in fidelity.METRICS:
            assert r[m]["live"] > 0 and r[m]["sim"] > 0
            assert math.isclose(r[m]["err"], r[m]["sim"] / r[m]["live"] - 1)
    merged = merge([str(tmp_path / "out" / "validate.json")] * 2)   # re-simulated
    assert merged["profile"]["step_a_ms"] == 8.0
    assert merged["live_runs"] == doc["live_runs"] and merged["comparison"]["cells"] == 2
    assert merged["sim_runs"]["unique"]["round_robin"]["ttft_p50"] == pytest.approx(
        doc["sim_runs"]["unique"]["round_robin"]["ttft_p50"])
    md = (tmp_path / "out" / "validate.md").read_text()
    assert "| shared-prefix | round_robin |" in md and "gpumesh sim validate" in md


@pytest.mark.timeout(300)
def test_livecal_recovers_a_known_step_model(tmp_path: Path) -> None:
    """The calibration probes, pointed at a node whose engine follows a known step model (the
    simulated engine, sleeping its step times), give that model back: within 30 % for the
    step's fixed and per-sequence terms, 50 % for the prefill slope (fitted from a few
    first-token times, each carrying the router's and the node's scheduling noise on a busy
    machine; a units or fitting error would be off by far more)."""
    import asyncio

    from gpumesh.launcher import ChildProcess, free_port, stop_all, wait_serving
    from gpumesh_bench.sim.livecal import calibrate

    port = free_port()
    want = {"step_a_ms": 8.0, "step_b_decode_ms": 0.4, "step_b_prefill_ms": 0.06}  # CPU-like
    conf = tmp_path / "node.toml"
    # slowed 3x (wall = 3 x simulated): scheduling noise of a busy machine matters less
    conf.write_text("[engine.sim]\ntime_scale = 3.0\n"
                    + "".join(f"{k} = {v}\n" for k, v in want.items()))
    node = ChildProcess.gpumesh("simnode", ["node", "--engine", "sim", "--port", str(port),
                                            "--node-id", "s0", "--served-name", "tiny",
                                            "--config", str(conf)],
                                tmp_path / "node.log", die_with_parent=True)
    try:
        wait_serving(f"127.0.0.1:{port}", 60, watch=[node])
        fit = asyncio.run(calibrate(f"127.0.0.1:{port}", "tiny", 30_000, context=200, reps=4))
    finally:
        stop_all([node], 10)
    tolerance = {"step_a_ms": 0.3, "step_b_decode_ms": 0.3, "step_b_prefill_ms": 0.5}
    for k, v in want.items():
        assert abs(fit[k] / (3 * v) - 1) < tolerance[k], (k, fit)
    assert 0 < fit["front_end_ms"] < 40
