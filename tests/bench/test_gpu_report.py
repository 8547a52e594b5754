"""The GPU benchmark's bookkeeping, on CPU: process grouping and the report's derived lines."""

from __future__ import annotations

import subprocess
import sys
import time

from gpumesh.bench.gpu import CpuSampler, report_markdown


def _procs() -> dict[int, tuple[int, list[str], float]]:
    py = "/usr/bin/python3"
    return {
        100: (1, [py, "-m", "gpumesh.bench.gpu", "run"], 1.0),          # the bench driver
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
    assert s.cores.get("load generator", 0.0) > 0.3, s.cores
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
