"""The front-door phases of the GPU bench (gpumesh_bench.gpu.frontdoors.phases): vLLM serve flags from the
node's engine arguments, the report's round-by-round pairing, and the phases end to end on
simulated engines (bookkeeping, not speed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gpumesh_bench.gpu.frontdoors.phases import SCHEDULER
from gpumesh_bench.gpu.frontdoors.report import door_rows, doors_markdown
from gpumesh_bench.gpu.frontdoors.servers import nginx_binary, serve_args


def test_serve_args_carry_the_node_engine_arguments() -> None:
    kw = {"model": "/m", "tokenizer": "/m/tokenizer", "dtype": "bfloat16", "max_model_len": 2048,
          "gpu_memory_utilization": 0.15, "load_format": "dummy", "num_gpu_blocks_override": None,
          "seed": 0, "stream_interval": 1, "tensor_parallel_size": 1,
          "served_model_name": ["qwen2.5-0.5b"], "enable_prefix_caching": False,
          "enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL"},
          "disable_log_stats": False}
    args = serve_args(kw)
    pairs = dict(zip(args[::1], args[1:], strict=False))
    assert pairs["--model"] == "/m" and pairs["--tokenizer"] == "/m/tokenizer"
    assert pairs["--gpu-memory-utilization"] == "0.15" and pairs["--load-format"] == "dummy"
    assert pairs["--served-model-name"] == "qwen2.5-0.5b"
    assert json.loads(pairs["--compilation-config"]) == {"cudagraph_mode": "FULL"}
    assert "--no-enable-prefix-caching" in args and "--num-gpu-blocks-override" not in args
    assert "--enforce-eager" not in args
    # the scheduler limits every door's engines get (frontdoors.phases.SCHEDULER) reach vllm serve too
    flags = serve_args({**kw, **SCHEDULER})
    for k, flag in (("max_num_batched_tokens", "--max-num-batched-tokens"),
                    ("max_num_seqs", "--max-num-seqs")):
        assert flags[flags.index(flag) + 1] == str(SCHEDULER[k])


def _rec(door: str, rnd: int, qps: float, p50: float, engines: int = 1) -> dict:
    return {"phase": "doors05", "shape": "0.5b", "concurrency": 128, "engines": engines,
            "door": door, "door_key": door, "round": rnd, "done_qps": qps, "lat_p50": p50,
            "out_tokens_p50": 256,
            "lat_p99": p50 * 2, "ttft_p50": 0.01, "ttft_p99": 0.02,
            "front_cpu_us_per_token": 10.0, "cpu": {"door front": 1.0}}


def test_report_pairs_gpumesh_with_each_door_round_by_round() -> None:
    recs = [_rec("gpumesh", 0, 100, 1.0), _rec("nginx", 0, 50, 2.0),
            _rec("gpumesh", 1, 60, 1.5), _rec("nginx", 1, 60, 1.0)]
    rows = {r["door"]: r for r in door_rows(recs)}
    # QPS = C / p50 per round; round 0: 128/1 over 128/2 = 2.0, round 1: (128/1.5) / 128
    assert [round(x, 3) for x in sorted(rows["nginx"]["qps_ratio"])] == [0.667, 2.0]
    assert sorted(rows["nginx"]["p50_ratio"]) == [0.5, 1.5]
    assert math.isclose(rows["gpumesh"]["qps_med"], (128 + 128 / 1.5) / 2)
    assert math.isclose(rows["nginx"]["lat50"], 1.5)
    # the window's completion counts stay beside it
    assert sorted(rows["nginx"]["win_qps"]) == [50, 60]
    md = doors_markdown(recs, {"doors_failed": {"doors05 smg": "RuntimeError: no SMG"}})
    assert "1 engine on one GPU" in md and "1.33 (0.67–2.00)" in md and "no SMG" in md


def test_report_pairs_only_within_one_run() -> None:
    """Round 0 of call 1 and round 0 of call 2 are different rounds: gpumesh's round of one
    run is never divided by a door's round of another; completions and p99 ratios beside."""
    recs = [{**_rec("gpumesh", 0, 100, 1.0), "call": 1}, {**_rec("nginx", 0, 50, 2.0), "call": 1},
            {**_rec("gpumesh", 0, 60, 1.5), "call": 2}]
    rows = {r["door"]: r for r in door_rows(recs)}
    assert rows["nginx"]["qps_ratio"] == [2.0] and rows["nginx"]["win_ratio"] == [2.0]
    assert rows["nginx"]["p99_ratio"] == [0.5]
    assert "2.00 / 2.00" in doors_markdown(recs, {})


@pytest.mark.slow
def test_doors_and_unequal_phases_on_simulated_engines(tmp_path: Path) -> None:
    from gpumesh_bench.gpu import cli as gpu_cli

    out = tmp_path / "out"
    rc = gpu_cli.main(["run", "--engine", "sim", "--phases", "doors05,uneq05", "--rounds", "1",
                       "--doors", "bare,gpumesh", "--door-concurrency", "8", "--workers", "1",
                       "--procs", "2", "--warmup", "2", "--seconds", "4",
                       "--sim-time-scale", "4", "--model-root", str(tmp_path / "models"),
                       "--budget", "400", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    recs = doc["records"]
    doors = {(r["door_key"], r["engines"]) for r in recs if r["phase"] == "doors05"}
    assert doors == {("bare", 1), ("bare", 2), ("gpumesh", 1), ("gpumesh", 2)}
    for r in recs:
        assert r["errors"] == 0 and r["done_qps"] > 0
        assert r["cpu"].get("door front", 0) > 0    # the door's own processes were found
    by = {(r["door_key"], r["engines"]): r for r in recs if r["phase"] == "doors05"}
    assert set(by["gpumesh", 2]["node_share"]) == {"a05b", "b05b"}
    assert set(by["bare", 2]["node_share"]) == {"bare-0", "bare-1"}
    un = [r for r in recs if r["phase"] == "uneq05"]
    try:
        nginx_binary()
        balancers = {"least_request", "predicted_latency", "nginx least_conn"}
    except FileNotFoundError:   # no nginx on this machine: that door is left out, said so
        balancers = {"least_request", "predicted_latency"}
        assert "uneq05 nginx" in doc["meta"]["doors_failed"]
    assert {r["policy"] for r in un} == balancers
    assert "Front doors" in (out / "summary.md").read_text()
