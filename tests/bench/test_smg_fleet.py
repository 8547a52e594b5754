"""gpumesh vs SMG on one simulated fleet (gpumesh_bench.peers.smg_fleet): exact-size BPE prompts,
the report, and a real run where a gpumesh router and a real SMG 1.13.0 gateway front the same
sim nodes (skipped with the installer's reason when SMG cannot be installed)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from pathlib import Path

import pytest

from gpumesh_bench.peers import smg_fleet
from gpumesh_bench.fleet import Fleet, RouterSpec, SimNodeSpec
from gpumesh_bench.loadgen import LoadConfig
from gpumesh.launcher import stop_all
from gpumesh_bench.peers import smg_gateway, smg_report
from gpumesh_bench.peers.smg_clients import BpePrompts, Target, run_target
from gpumesh_bench.peers.smg_gateway import SmgGateway, SmgSpec
from gpumesh_bench.stats import summarize
from gpumesh_bench.workload import BenchRequest
from tests.interop.conftest import smg_exe  # noqa: F401 (the session fixture: installs SMG)

pytest.importorskip("tokenizers")


def test_bpe_prompts_are_exactly_n_tokens(tiny_model_dir: Path) -> None:
    p = BpePrompts(tiny_model_dir)
    for n in (1, 7, 128, 3072):
        text, ids = p.prompt(n, seed=1, index=n)
        assert len(ids) == n
        assert p.tokenizer.encode(text).ids == ids
    assert p.prompt(50, 1, 3) == p.prompt(50, 1, 3)        # deterministic per (seed, index)
    assert p.prompt(50, 1, 3) != p.prompt(50, 1, 4)        # unique per request


def test_trace_is_poisson_and_rescales(tmp_path: Path) -> None:
    from gpumesh_bench.workload import LengthDist, load_trace

    path = tmp_path / "t.jsonl"
    assert smg_fleet.record_trace(LengthDist.parse("fixed:8"), LengthDist.parse("fixed:4"), 1,
                                  2000, path) == 2000
    reqs = load_trace(path, "", 1.0 / 50)                 # replayed at 50 req/s
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(reqs)]
    assert min(gaps) >= 0 and sum(g == 0 for g in gaps) == 0  # not one burst at t = 0
    assert 40 < len(reqs) / reqs[-1].arrival_s < 60


def test_smg_specs_and_scaled_flags() -> None:
    specs = smg_gateway.parse_smg(["a=least_load@scaled", "b=cache_aware@1:--foo 2", "c=power_of_two"],
                                time_scale=3)
    assert [(s.name, s.policy, s.interval_s, s.flags) for s in specs] == [
        ("a", "least_load", 30, ()), ("b", "cache_aware", 1, ("--foo", "2")),
        ("c", "power_of_two", 1, ())]
    assert smg_gateway.smg_scaled_flags(3) == ["--least-load-kv-pressure-weight", "0.45",
                                             "--least-load-default-throughput", "666.667"]
    assert smg_gateway.smg_scaled_flags(1) == []


def _run(label: str, gateway: str, load: float, p99: float, good: float) -> dict:
    return {"config": {"workload": "w", "load": load, "label": label, "gateway": gateway},
            "summary": {"ttft_ms": {"p50": p99 / 2, "p99": p99}, "latency_ms": {"p99": 2 * p99},
                        "goodput_fraction": good, "requests": 10, "ok": 10,
                        "node_share": {"n00-x1": 0.4, "n01-x2": 0.6}},
            "cpu_summary": {"gateway_pct": 10, "loadgen_pct": 5, "nodes_pct": 20,
                            "machine_busy_cores": 0.5}}


def test_report_and_verdict() -> None:
    runs = [_run("gpumesh-predicted_latency", "gpumesh", 0.8, 100, 0.9),
            _run("gpumesh-predicted_latency", "gpumesh", 0.8, 140, 0.8),
            _run("smg-least_load", "smg", 0.8, 120, 0.85),
            _run("smg-cache_aware", "smg", 0.8, 300, 0.95)]
    agg = smg_report.aggregate(runs)
    assert agg[("w", 0.8, "gpumesh-predicted_latency")]["ttft_p99"] == 120
    v = smg_report.verdict(agg, "w", 0.8)
    assert "smg-least_load" in v and "1.00x met" in v and "goodput 85.0% vs 85.0% met" in v
    assert "highest goodput: missed" in v
    md = smg_report.markdown({"args": {"fleet": "f", "time_scale": 3}, "capacity": {},
                             "runs": runs})
    assert "| 80% | gpumesh-predicted_latency | 60 | 120 | 100, 140 |" in md
    assert "x1 40 · x2 60" in md


@pytest.mark.slow
def test_both_gateways_front_the_same_sim_fleet(tmp_path: Path, tiny_model_dir: Path,
                                                smg_exe: Path) -> None:  # noqa: F811
    model = str(tiny_model_dir.resolve())
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    sim = {"model_name": model, "vocab_size": cfg["vocab_size"],
           "eos_token_id": cfg["eos_token_id"], "max_num_seqs": 8, "max_context_length": 1024}
    nodes = [SimNodeSpec("n00-x1", 1.0, 65536, sim=sim), SimNodeSpec("n01-x2", 2.0, 65536, sim=sim)]
    prompts = BpePrompts(model)
    reqs = [BenchRequest(i, 0.02 * i, 16 + 8 * i, 12) for i in range(24)]
    with Fleet(nodes, routers=[RouterSpec("predicted_latency", "predicted_latency")],
               time_scale=1.0, model=model, log_dir=tmp_path) as fleet:
        workers = [fleet.node_address(n.node_id) for n in nodes]
        gw = SmgGateway(smg_exe, SmgSpec("smg-ll", "least_load", 1), workers, model, tmp_path,
                        time_scale=1.0)
        try:
            gw.wait_ready(60)
            url_node = {f"grpc://{fleet.node_address(n.node_id)}": n.node_id for n in nodes}
            targets = [Target("gpumesh", "grpc", fleet.address("predicted_latency")),
                       Target("smg", "http", gw.base, model, url_node)]
            for t in targets:
                lc = LoadConfig(target=t.address, rate=50.0, num_requests=len(reqs),
                                timeout_s=30, progress_s=0, label=t.name, seed=3)
                run = asyncio.run(run_target(lc, reqs, t, prompts))
                s = summarize(run.results)
                assert s["ok"] == len(reqs), (t.name, [r.error for r in run.results], gw.child.tail())
                for r, q in zip(run.results, reqs):
                    assert r.prompt_tokens == q.prompt_tokens, (t.name, r)   # equal prompt sizes
                    assert r.output_tokens == 12 and r.ttft_s is not None and not r.error
                    assert r.node_id in {"n00-x1", "n01-x2"}, (t.name, r.node_id)
                assert math.isclose(sum(s["node_share"].values()), 1.0)
                asyncio.run(fleet.wait_idle("predicted_latency", timeout_s=20))
        finally:
            stop_all([gw.child], 10.0)
