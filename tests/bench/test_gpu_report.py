"""The GPU benchmark's bookkeeping, on CPU: process grouping and the report's derived lines."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumesh_bench.gpu.samplers import CpuSampler
from gpumesh_bench.gpu.report import report_markdown


def _procs() -> dict[int, tuple[int, list[str], float]]:
    py = "/usr/bin/python3"
    return {
        100: (1, [py, "-m", "gpumesh_bench.gpu", "run"], 1.0),          # the bench driver
        101: (100, [py, "-c", "from multiprocessing.spawn import spawn_main"], 2.0),
        200: (1, [py, "-m", "gpumesh.cli", "node", "--config", "a.toml", "--node-id", "a05b"], 3.0),
        201: (200, ["VLLM::EngineCore"], 4.0),
        300: (1, [py, "-m", "gpumesh.cli", "router", "--port", "1", "--router-id", "r2"], 5.0),
        301: (300, [py, "-c", "from multiprocessing.spawn import spawn_main"], 6.0),
        400: (100, [py, "-m", "gpumesh.cli", "status", "--router", "x"], 7.0),
        500: (1, ["/usr/sbin/sshd"], 8.0),
    }


def test_cpu_sampler_groups_processes_by_their_gpumesh_ancestor() -> None:
    procs = _procs()
    lab = {pid: CpuSampler.label(pid, procs, 100) for pid in procs}
    assert lab == {100: "bench driver", 101: "load generator", 200: "node a05b front end",
                   201: "node a05b engine", 300: "router r2", 301: "router r2", 400: None,
                   500: None}


def test_cpu_sampler_measures_a_busy_child() -> None:
    # The busy loop runs in a child (a "load generator" to the sampler): in this process it
    # would hold the GIL and starve the sampler thread's snapshots.
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        t0 = time.time()
        with CpuSampler(t0 + 0.1, t0 + 1.6) as s:
            pass
    finally:
        busy.kill()
        busy.wait()
    # attributed to the load generator (any clear share: the machine may be busy besides)
    assert s.cores.get("load generator", 0.0) > 0.1, s.cores
    assert s.cores["machine (all processes)"] > 0.3, s.cores


def _rec(setup: str, c: int, qps: float, p50: float, phase: str = "p05") -> dict[str, object]:
    return {"phase": phase, "setup": setup, "shape": "0.5b", "concurrency": c, "qps": qps,
            "done_qps": qps, "lat_p50": p50, "lat_p99": p50, "ttft_p50": 0.1, "tpot_p50": 0.005,
            "prompt": "fixed:32", "output": "fixed:256",
            "cpu_cores": {"node a05b front end": 1.0, "machine (all processes)": 3.0}}


def test_report_states_the_dp_ratio_and_the_routers_share_of_the_client_split() -> None:
    recs = [_rec("1 GPU, through router", 128, 60.0, 1.5),
            _rec("2 GPUs data parallel, router", 256, 90.0, 2.0),
            _rec("2 GPUs data parallel, direct (client splits)", 256, 120.0, 1.5)]
    md = report_markdown(recs, {})
    assert "**1.50x** (target >= 1.9x at equal p50)" in md
    assert "120.0 QPS at p50 1.50 s (2.00x one GPU); the router gives 0.75x of that" in md
    assert "| 0.5b | 1 GPU, through router | 128 | node a05b front end 1.00 | 3.00 |" in md


def test_report_compares_with_the_raw_reference_only_on_its_workload() -> None:
    ref = _rec("1 GPU, through router", 128, 64.0, 1.5)
    other = {**_rec("1 GPU, direct to node", 128, 64.0, 1.5), "output": "uniform:128:384"}
    md = report_markdown([ref, other], {})
    # 64 / the reference's 128 QPS on the reference's workload; nothing against it otherwise
    assert ("| 0.5b | 1 GPU, through router | 128 | reference | 64.0 | 64.0 | 1.50 | 1.50 | "
            "0.100 | 5.00 | 128 / 0.92 | 0.50 |") in md
    assert ("| 0.5b | 1 GPU, direct to node | 128 | fixed:32 -> uniform:128:384 | 64.0 | 64.0 | "
            "1.50 | 1.50 | 0.100 | 5.00 | - | - | - | - | 0 |") in md


def test_report_keeps_each_workloads_dp_ratio_to_its_own_one_gpu_rows() -> None:
    uni = {"output": "uniform:128:384"}
    recs = [_rec("1 GPU, through router", 128, 60.0, 1.5),
            _rec("2 GPUs data parallel, router", 256, 90.0, 2.0),
            {**_rec("1 GPU, through router", 128, 50.0, 1.5), **uni},
            {**_rec("1 GPU, direct to node", 128, 40.0, 1.4), **uni},
            {**_rec("2 GPUs data parallel, router", 256, 100.0, 1.6), **uni}]
    md = report_markdown(recs, {})
    assert "- 0.5b: data parallel" in md and "-> **1.50x**" in md
    assert "- 0.5b (workload fixed:32 -> uniform:128:384): data parallel" in md
    assert "-> **2.00x**" in md
    assert "Against one GPU direct to the node (40.0 QPS at p50 1.40 s): 2.50x." in md


def test_report_tables_interleaved_rounds_against_the_same_rounds_split() -> None:
    def dp(setup: str, k: int, done: float) -> dict[str, object]:
        r = _rec(f"2 GPUs data parallel, {setup} #{k}", 256, done, 1.5, phase="dp05")
        return {**r, "round": k, "imbalance": {"in_flight_diff_p50": 4.0, "in_flight_diff_max": 9},
                "fleet": {"a": {"running_mean": 120.0}, "b": {"running_mean": 118.0}}}
    recs = [dp("router", 0, 90.0), dp("direct (client splits)", 0, 100.0),
            dp("router", 1, 110.0), dp("direct (client splits)", 1, 100.0)]
    # newer records also hold each node's in-flight mean (the node servicer's requests)
    recs[2]["fleet"] = {"a": {"running_mean": 100.0, "in_flight_mean": 126.0},
                        "b": {"running_mean": 101.0, "in_flight_mean": 128.4}}
    md = report_markdown(recs, {})
    assert ("| dp05 | reference | 2 GPUs data parallel, router #0 | 256 | 90.0 | 90.0 | 0.90 | "
            "1.50 | 1.50 | 0.100 | 5.00 | 4 / 9 | a 120 / b 118 |") in md
    assert ("| dp05 | reference | 2 GPUs data parallel, router #1 | 256 | 110.0 | 110.0 | 1.10 | "
            "1.50 | 1.50 | 0.100 | 5.00 | 4 / 9 | a 100 (126) / b 101 (128) |") in md


def test_fleet_sampler_summary_keeps_in_flight_and_the_decode_step() -> None:
    from gpumesh_bench.gpu.samplers import FleetSampler

    fs = FleetSampler("127.0.0.1:1", None)   # never started: samples set by hand
    base = {"node": "a", "waiting": 0, "kv": 0.1, "tok_s": 1000, "gpus": [], "gpu_model": ""}
    fs.samples = [{**base, "t": 1.0, "running": 100, "in_flight": 120, "step_s": 0.010},
                  {**base, "t": 2.0, "running": 110, "in_flight": 126, "step_s": 0.012},
                  {**base, "t": 9.0, "running": 0, "in_flight": 0, "step_s": 0.0}]  # outside
    (a,) = fs.summary(0.5, 2.5).values()
    assert a["running_mean"] == 105 and a["in_flight_mean"] == 123
    assert a["step_ms_mean"] == pytest.approx(11.0)


def test_report_tables_the_message_budget_against_the_same_rounds_fixed_interval() -> None:
    # archived records have neither leg nor base_setup: paired from their setup labels
    def msg(label: str, k: int, done: float, fixed: int = 0) -> dict[str, object]:
        r = _rec(f"1 GPU, direct to node, {label} #{k}", 128, done, 1.2, phase="msg05")
        return {**r, "round": k, **({"flush_interval_ms": fixed} if fixed else {})}
    recs = [msg("message budget", 0, 110.0), msg("fixed 20 ms", 0, 100.0, 20),
            msg("message budget", 1, 90.0), msg("fixed 20 ms", 1, 100.0, 20)]
    md = report_markdown(recs, {})
    assert "| msg05 | 1 GPU, direct to node, message budget #0 | 128 | 110.0 | 110.0 | 1.10 |" in md
    assert "| msg05 | 1 GPU, direct to node, message budget #1 | 128 | 90.0 | 90.0 | 0.90 |" in md
    assert "| msg05 | 1 GPU, direct to node, fixed 20 ms #1 | 128 | 100.0 | 100.0 | - |" in md


def test_report_pairs_message_budget_benches_by_their_recorded_leg_not_the_label() -> None:
    # gpumesh_bench.gpu records base_setup, round and leg with each msg05/msg7 bench: the pairing holds
    # whatever the setup labels say
    def msg(label: str, leg: str, k: int, done: float) -> dict[str, object]:
        r = _rec(f"one GPU ({label}) round {k}", 128, done, 1.2, phase="msg05")
        return {**r, "call": 1, "round": k, "leg": leg, "base_setup": "one GPU",
                **({"flush_interval_ms": 20} if leg == "fixed" else {})}
    recs = [msg("budget", "budget", 0, 110.0), msg("20 ms", "fixed", 0, 100.0),
            msg("budget", "budget", 1, 90.0), msg("20 ms", "fixed", 1, 120.0)]
    md = report_markdown(recs, {})
    assert "| msg05 | one GPU (budget) round 0 | 128 | 110.0 | 110.0 | 1.10 |" in md
    assert "| msg05 | one GPU (budget) round 1 | 128 | 90.0 | 90.0 | 0.75 |" in md
    assert "| msg05 | one GPU (20 ms) round 1 | 128 | 120.0 | 120.0 | - |" in md


def test_report_keeps_every_calls_records_and_labels_them_by_call() -> None:
    # one results.json that two runs appended the same phase to: same setup strings
    def msg(call: int, label: str, done: float, fixed: int = 0) -> dict[str, object]:
        r = _rec(f"1 GPU, direct to node, {label} #0", 128, done, 1.2, phase="msg05")
        return {**r, "call": call, "round": 0, **({"flush_interval_ms": fixed} if fixed else {})}
    recs = [msg(1, "message budget", 110.0), msg(1, "fixed 20 ms", 100.0, 20),
            msg(2, "message budget", 90.0), msg(2, "fixed 20 ms", 120.0, 20)]
    md = report_markdown(recs, {})
    assert ("| msg05 | 1 GPU, direct to node, message budget #0 (call 1) | 128 | 110.0 | 110.0 "
            "| 1.10 |") in md
    assert ("| msg05 | 1 GPU, direct to node, message budget #0 (call 2) | 128 | 90.0 | 90.0 "
            "| 0.75 |") in md
    assert "| msg05 | 1 GPU, direct to node, fixed 20 ms #0 (call 1) | 128 | 100.0 |" in md
    # a rerun within one call still replaces; one call alone needs no label
    md = report_markdown([msg(1, "message budget", 80.0), *recs[:2]], {})
    assert md.count("message budget #0") == 2   # the table's row and the cores table's
    assert "| msg05 | 1 GPU, direct to node, message budget #0 | 128 | 110.0 |" in md


def test_report_compares_each_row_with_the_raw_run_of_its_own_call() -> None:
    def raw(call: int, qps: float) -> dict[str, object]:
        return {**_rec("raw vLLM (in session)", 128, qps, 0.9, phase="raw"), "call": call}
    recs = [raw(1, 100.0), {**_rec("1 GPU, through router", 128, 50.0, 1.5), "call": 1},
            raw(2, 200.0), {**_rec("1 GPU, through router", 128, 60.0, 1.5), "call": 3}]
    md = report_markdown(recs, {})
    # call 1's row against call 1's raw (100); call 3 ran none: the last raw run (200)
    assert ("| 0.5b | 1 GPU, through router (call 1) | 128 | reference | 50.0 | 50.0 | 1.50 | "
            "1.50 | 0.100 | 5.00 | 128 / 0.92 | 0.39 | 0.50 |") in md
    assert ("| 0.5b | 1 GPU, through router (call 3) | 128 | reference | 60.0 | 60.0 | 1.50 | "
            "1.50 | 0.100 | 5.00 | 128 / 0.92 | 0.47 | 0.30 |") in md
    assert "| 0.5b | raw vLLM (in session) (call 1) | 128 |" in md
    assert "| 0.5b | raw vLLM (in session) (call 2) | 128 |" in md


S7 = Path(__file__).parents[2] / "bench/gpu/results/results-h200x2-2026-11-30-s7-budget.json.gz"
# The seventh GPU session's msg05 rows (calls 1 and 4; records without leg/base_setup, so
# paired from their setup labels): (call, base setup, round, done QPS, x fixed).
S7_MSG05 = [(1, "1 GPU, direct to node", 0, "128.0", "1.25"),
            (1, "1 GPU, direct to node", 1, "102.4", "1.09"),
            (1, "2 GPUs data parallel, router", 0, "184.8", "0.93"),
            (1, "2 GPUs data parallel, router", 1, "179.1", "1.05"),
            (4, "1 GPU, direct to node", 0, "110.9", "1.15"),
            (4, "1 GPU, direct to node", 1, "114.9", "1.27"),
            (4, "2 GPUs data parallel, router", 0, "210.5", "1.14"),
            (4, "2 GPUs data parallel, router", 1, "204.7", "1.05")]


def test_report_of_the_seventh_session_shows_both_calls_msg05_benches() -> None:
    doc = json.loads(gzip.decompress(S7.read_bytes()))
    md = report_markdown(doc["records"], doc["meta"])
    rows = [ln for ln in md.splitlines() if ln.startswith("| msg05 |")]
    assert len(rows) == 16
    for call, base, k, done, xf in S7_MSG05:
        assert any(ln.startswith(f"| msg05 | {base}, message budget #{k} (call {call}) | ")
                   and f"| {done} | {xf} |" in ln for ln in rows), (call, base, k)
        assert any(ln.startswith(f"| msg05 | {base}, fixed 20 ms #{k} (call {call}) | ")
                   and ln.split(" | ")[5] == "-" for ln in rows), (call, base, k)
    # both raw runs; call 3's benches against call 3's raw (136.5 QPS), not call 2's (110.9)
    assert "| 0.5b | raw vLLM (in session) (call 2) | 128 | reference | 110.9 |" in md
    assert ("| 0.5b | 1 GPU, through router (call 3) | 128 | reference | 93.9 | 102.4 | 1.12 | "
            "1.51 | 0.114 | 4.10 | 128 / 0.92 | 0.73 | 0.69 |") in md


def test_report_cli_reads_gzip_and_numbers_the_calls_of_several_files(tmp_path: Path) -> None:
    from gpumesh_bench.gpu import cli as gpu_cli

    out = tmp_path / "s7.md"
    assert gpu_cli.main(["report", str(S7), str(S7), "--md", str(out)]) == 0
    md = out.read_text()
    # the second file's calls 1-4 are the merged meta's calls 5-8
    for call in (1, 4, 5, 8):
        assert f"| msg05 | 1 GPU, direct to node, message budget #0 (call {call}) |" in md
    assert sum(ln.startswith("| msg05 |") for ln in md.splitlines()) == 32


def test_report_gives_the_mesh_over_the_same_rounds_raw_run_and_the_median() -> None:
    # vsraw05: per round a raw reference run (its own record shape: no done_qps, no TPOT) and
    # the node direct and through the router on the same GPU
    def node(leg: str, k: int, qps: float) -> dict[str, object]:
        name = "through router" if leg == "router" else "direct to node"
        return {**_rec(f"1 GPU, {name} #{k}", 128, qps, 0.9, phase="vsraw05"), "call": 1,
                "round": k, "leg": leg, "base_setup": "1 GPU"}

    def raw(k: int, qps: float) -> dict[str, object]:
        return {"phase": "vsraw05", "setup": f"raw vLLM, same GPU #{k}", "shape": "0.5b",
                "concurrency": 128, "qps": qps, "lat_p50": 0.8, "lat_p99": 0.9,
                "ttft_p50": 0.05, "call": 1, "round": k, "leg": "raw", "base_setup": "1 GPU",
                "engine": "vllm-raw"}
    recs = [raw(0, 150.0), node("router", 0, 120.0), node("direct", 0, 135.0),
            node("direct", 1, 100.0), node("router", 1, 95.0), raw(1, 100.0),
            raw(2, 160.0), node("router", 2, 160.0), node("direct", 2, 150.0)]
    md = report_markdown(recs, {})
    assert "| vsraw05 | 1 GPU, through router #0 | 128 | 120.0 | 120.0 | 0.80 |" in md
    assert "| vsraw05 | 1 GPU, direct to node #1 | 128 | 100.0 | 100.0 | 1.00 |" in md
    assert "| vsraw05 | raw vLLM, same GPU #1 | 128 | 100.0 | - | - |" in md
    # router 0.80, 0.95, 1.00; direct 0.90, 1.00, 0.94
    assert "- vsraw05 (call 1), router: median x raw **0.95** over 3 round(s)" in md
    assert "- vsraw05 (call 1), direct: median x raw **0.94** over 3 round(s)" in md
    # raw p50 0.8 s against the legs' 0.9 s in every round
    assert ("- vsraw05 (call 1), router: median x raw **0.95** over 3 round(s) (0.80, 0.95, "
            "1.00); raw p50 / p50 **0.89** over 3 round(s) (0.89, 0.89, 0.89)") in md
