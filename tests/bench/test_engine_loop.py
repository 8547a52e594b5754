"""The engine loop (gpumesh_bench.overhead.engine_loop): a closed loop on a node's own engine,
no gRPC.

The simulator runs in process (fast); the real vLLM CPU engine runs once, briefly, through the
CLI in a subprocess (as the GPU bench runs it). The GPU bench's phase is checked on the
simulator, and its rows in the report.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumesh_bench.gpu import env as gpu_env
from gpumesh_bench.gpu import records, reference, report
from gpumesh_bench.overhead.engine_loop import LoopConfig, record, run_engine_loop, run_loop
from gpumesh_bench.workload import LengthDist, WorkloadSpec, iter_requests
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig

REPO_ROOT = Path(__file__).resolve().parents[2]

# The 0.5B shape's step model: 2.29 ms + 0.0242 ms per decoding request, in real time.
SIM_TOML = """[engine]
kind = "sim"
model = "sim-05b"
max_model_len = 2048
[engine.sim]
time_scale = 1.0
"""


async def test_sim_node_config_gives_sane_window_metrics(tmp_path: Path) -> None:
    cfg_file = tmp_path / "node.toml"
    cfg_file.write_text(SIM_TOML)
    cfg = LoopConfig(8, warmup_s=0.5, window_s=2.0, prompt=LengthDist.parse("fixed:16"),
                     output=LengthDist.parse("fixed:32"))
    rec = await run_engine_loop(cfg_file, cfg)
    assert rec["engine"] == "sim" and rec["model"] == "sim-05b"
    assert rec["errors"] == 0 and rec["error_kinds"] == []
    assert rec["completed"] > 20, rec
    # started-and-finished-in-window <= finished-in-window; both about C / latency (Little)
    assert rec["qps"] <= rec["done_qps"]
    assert rec["qps"] == pytest.approx(rec["completed"] / 2.0, abs=0.01)
    little = cfg.concurrency / rec["lat_p50"]
    assert 0.6 * little <= rec["done_qps"] <= 1.3 * little, (rec["done_qps"], little)
    assert rec["out_tokens_p50"] == 32
    assert rec["out_tok_s"] == pytest.approx(32 * rec["done_qps"], rel=0.01)
    # the simulated step at batch ~8 is ~2.5 ms; event-loop overhead (a busy machine's too)
    # only adds to it: the bound above is seconds-vs-milliseconds sanity, not speed
    assert 0.0023 <= rec["tpot_p50"] < 0.25, rec["tpot_p50"]
    assert 0 < rec["ttft_p50"] <= rec["lat_p50"] <= rec["lat_p99"]
    assert rec["engine_load"]["running_max"] <= 8
    assert rec["engine_load"]["running_mean"] > 4
    assert 2.29 <= rec["engine_load"]["decode_step_ms_mean"] < 250
    assert rec["cpu_cores"]["front end"] > 0
    assert rec["kv_tokens"] > 0
    json.dumps(rec, allow_nan=False)  # the RESULT line is strict JSON


async def test_outputs_have_the_asked_lengths_and_the_cut_off_requests_are_aborted() -> None:
    eng = SimEngine(SimEngineConfig(time_scale=1.0))
    await eng.start()
    try:
        cfg = LoopConfig(6, warmup_s=0.2, window_s=1.0, prompt=LengthDist.parse("uniform:4:40"),
                         output=LengthDist.parse("uniform:8:40"), seed=3)
        loop = await run_loop(eng, cfg)
        # the streams still running when the window closed were cancelled: nothing is left
        await asyncio.sleep(0.05)
        assert eng.load().num_running == 0 and eng.load().num_waiting == 0
    finally:
        await eng.shutdown()
    ok = [r for r in loop.results if r.status == "OK"]
    assert len(ok) == len(loop.results) > 10
    asked = {r.index: r.max_tokens for r in itertools.islice(
        iter_requests(WorkloadSpec(cfg.prompt, cfg.output, cfg.seed)), 10_000)}
    assert all(r.output_tokens == asked[r.index] for r in ok)
    assert len({r.output_tokens for r in ok}) > 3  # the draws vary: lengths really are asked
    rec = record(cfg, loop)
    assert rec["requests"] == len(ok) and rec["errors"] == 0
    assert rec["tokenize_s"] > 0


async def test_engine_errors_are_counted_not_raised() -> None:
    # A 2-token context window: every 30-token prompt is refused by the engine.
    eng = SimEngine(SimEngineConfig(time_scale=1.0, max_context_length=2))
    await eng.start()
    try:
        cfg = LoopConfig(2, warmup_s=0.0, window_s=0.3, prompt=LengthDist.parse("fixed:30"),
                         output=LengthDist.parse("fixed:4"))
        rec = record(cfg, await run_loop(eng, cfg))
    finally:
        await eng.shutdown()
    assert rec["completed"] == 0 and rec["errors"] == rec["requests"] > 0
    assert rec["error_kinds"] and rec["error_kinds"][0].startswith("PromptTooLong: ")
    assert rec["lat_p50"] is None  # NaN becomes null in the record


def test_module_entry_point_prints_result_and_writes_json(tmp_path: Path) -> None:
    cfg_file = tmp_path / "node.toml"
    cfg_file.write_text(SIM_TOML)
    out = tmp_path / "rec.json"
    p = subprocess.run(
        [sys.executable, "-m", "gpumesh_bench.overhead.engine_loop", "--config", str(cfg_file),
         "--concurrency", "4", "--warmup", "0.3", "--seconds", "1", "--prompt", "fixed:8",
         "--output", "fixed:16", "--json", str(out), "--log-level", "warning"],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, check=False)
    assert p.returncode == 0, p.stderr
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert len(lines) == 1
    rec = json.loads(lines[0][len("RESULT "):])
    assert rec == json.loads(out.read_text())
    assert rec["completed"] > 0 and rec["out_tokens_p50"] == 16 and rec["concurrency"] == 4


@pytest.mark.vllm
def test_vllm_tiny_model_through_the_cli(tmp_path: Path, tiny_model_dir: Path) -> None:
    pytest.importorskip("vllm")
    cfg_file = tmp_path / "node.toml"
    cfg_file.write_text(f'[engine]\nkind = "vllm"\nmodel = "{tiny_model_dir}"\nserved_name = "tiny"\n'
                        'max_model_len = 512\nnum_gpu_blocks_override = 16\n'
                        'enforce_eager = true\n')
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
           "GPUMESH_LOG_LEVEL": "warning"}
    p = subprocess.run(
        [sys.executable, "-m", "gpumesh.cli", "bench", "engine-loop", "--config", str(cfg_file),
         "--concurrency", "4", "--warmup", "1", "--seconds", "3", "--prompt", "fixed:8",
         "--output", "fixed:16"],
        capture_output=True, text=True, timeout=240, cwd=REPO_ROOT, env=env, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert len(lines) == 1, p.stdout[-2000:]
    rec = json.loads(lines[0][len("RESULT "):])
    assert rec["engine"] == "vllm" and rec["model"] == "tiny"
    assert rec["completed"] > 0 and rec["errors"] == 0
    assert rec["out_tokens_p50"] == 16  # ignore_eos: the asked length
    assert rec["qps"] <= rec["done_qps"] and rec["tpot_p50"] > 0
    assert rec["kv_tokens"] == 16 * 128  # 16 blocks of the CPU backend's 128 tokens
    assert rec["engine_args"]["stream_interval"] == 1
    assert "engine" in rec["cpu_cores"]  # vLLM's engine core is a child process
    assert rec["engine_load"]["running_max"] <= 4
    assert 0 < rec["engine_load"]["decode_step_ms_mean"] < 1000 * rec["lat_p50"]


def _env(tmp_path: Path) -> gpu_env.Env:
    return gpu_env.Env(out=tmp_path, engine="sim", models={}, workers=1, procs=1, warmup_s=0.3,
                   window_s=1.0, max_model_len=2048, sim_time_scale=1.0, small_kv_blocks=0,
                   engine_args={"stream_interval": 4}, output="fixed:32")


def test_gpu_phase_on_the_simulator_records_one_gpu_and_a_data_parallel_row(
        tmp_path: Path) -> None:
    env = _env(tmp_path)
    reference.phase_eng(env, "0.5b", gpus=2)
    one, dp = env.records
    assert (one["phase"], dp["phase"]) == ("eng", "eng")
    assert one["setup"] == reference.ENG_SETUPS[0] and dp["setup"] == reference.ENG_SETUPS[1]
    assert one["concurrency"] == dp["concurrency"] == records.RAW_CONCURRENCY["0.5b"]
    assert [p["concurrency"] for p in dp["parts"]] == [64, 64]
    assert dp["qps"] == pytest.approx(sum(p["qps"] for p in dp["parts"]), abs=0.02)
    assert dp["lat_p50"] == max(p["lat_p50"] for p in dp["parts"])
    assert one["completed"] > 0 and dp["completed"] > 0 and dp["errors"] == 0
    assert one["output"] == dp["output"] == "fixed:32"
    assert all(p["out_tokens_p50"] == 32 for p in (*one["parts"], *dp["parts"]))
    assert set(dp["engine_load"]) == {"gpu0", "gpu1"}
    # the node TOML the other phases write, for the same shape
    toml = (tmp_path / "logs" / "eng05b-1gpu-0.toml").read_text()
    assert toml == gpu_env.node_toml(env, gpu_env.GpuNodeSpec("a05b", "0.5b", "0", 0.85))
    assert json.loads((tmp_path / "results.json").read_text())["records"] == env.records


def test_gpu_phase_fails_fast_when_a_loop_dies_without_a_record(tmp_path: Path) -> None:
    env = dataclasses.replace(_env(tmp_path), sim_max_num_seqs=-1)  # the engine refuses it
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="1 of 1 loops gave no result"):
        reference.phase_eng(env, "0.5b", gpus=2)
    # not run_eng's 300 s deadline: the dead loop ends the wait (a slow machine's start aside)
    assert time.monotonic() - t0 < 240
    assert env.records == []


def test_report_puts_engine_loop_rows_in_the_main_table_against_raw() -> None:
    base = {"shape": "0.5b", "prompt": "fixed:32", "output": "fixed:256", "lat_p50": 0.9,
            "lat_p99": 1.0, "ttft_p50": 0.02, "tpot_p50": 0.003, "errors": 0}
    raw1 = {**base, "phase": "raw", "setup": "raw vLLM (in session)", "concurrency": 128,
            "qps": 120.0}
    rawdp = {**base, "phase": "raw", "setup": "raw vLLM data parallel (in session)",
             "concurrency": 128, "qps": 160.0}
    eng1 = {**base, "phase": "eng", "setup": reference.ENG_SETUPS[0], "concurrency": 128,
            "qps": 90.0, "done_qps": 95.0}
    engdp = {**base, "phase": "eng", "setup": reference.ENG_SETUPS[1], "concurrency": 128,
             "qps": 120.0, "done_qps": 125.0}
    assert [records._setup_key(r) for r in (raw1, rawdp, eng1, engdp)] == ["1gpu", "dp2", "1gpu", "dp2"]
    md = report.report_markdown([raw1, rawdp, eng1, engdp], {})
    # x raw (session): 90 / 120 on one GPU, 120 / 160 data parallel; x raw ref: / 128, / 161
    assert (f"| 0.5b | {reference.ENG_SETUPS[0]} | 128 | reference | 90.0 | 95.0 | 0.90 | 1.00 | 0.020 "
            "| 3.00 | 128 / 0.92 | 0.70 | 0.75 |") in md
    assert (f"| 0.5b | {reference.ENG_SETUPS[1]} | 128 | reference | 120.0 | 125.0 | 0.90 | 1.00 | "
            "0.020 | 3.00 | 161 / 0.72 | 0.75 | 0.75 |") in md
