"""The GPU benchmark end to end on simulated nodes (``--engine sim``): real node and router
processes, real load processes. Checks the bench's own bookkeeping, not any speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpumesh.bench import gpu
from node.config import load_node_config

pytestmark = [pytest.mark.slow]


def test_fleet_polls_share_the_loads_clock(tmp_path: Path) -> None:
    # Warm-up 4 s (past the node's 3 s rate window), 6 s measured. The fleet table of a bench
    # must describe the load's own window: the load processes start 2 + 0.2 x procs s after
    # the bench is called, and the fleet sampler used to count from the call, so its "window"
    # began 3.6 s early here (before the first request) and its node rates and in-flight
    # means took in the ramp.
    out = tmp_path / "out"
    rc = gpu.main(["run", "--engine", "sim", "--phases", "dp05", "--rounds", "1",
                   "--workers", "1", "--procs", "8", "--warmup", "4", "--seconds", "6",
                   "--sim-time-scale", "4", "--output", "uniform:64:192",
                   "--model-root", str(tmp_path / "models"), "--budget", "300",
                   "--node-option", "stream_messages_per_s=1500", "--out", str(out)])
    assert rc == 0
    recs = json.loads((out / "results.json").read_text())["records"]
    # --node-option: a top-level key of every node's TOML, recorded with each bench
    assert all(r["node_options"] == {"stream_messages_per_s": 1500} for r in recs)
    for node in ("a05b", "b05b"):
        cfg = load_node_config(out / "logs" / f"{node}.toml", environ={})
        assert cfg.stream_messages_per_s == 1500
    assert {r["setup"] for r in recs} == {"2 GPUs data parallel, router #0",
                                          "2 GPUs data parallel, direct (client splits) #0"}
    for r in recs:
        c, warm, win = r["concurrency"], r["warmup_s"], r["window_s"]
        polls = r["fleet_polls"]   # [t, node, running, waiting, in flight, tok/s, step ms]
        assert {p[1] for p in polls} == {"a05b", "b05b"}, r["setup"]
        by_t: dict[float, int] = {}
        for p in polls:
            by_t[p[0]] = by_t.get(p[0], 0) + p[4]
        # Polls count from the load's first request: nothing in flight before it, most of the
        # closed loop's streams within a poll and a heartbeat after it.
        assert min(by_t) < -0.5 and all(f == 0 for t, f in by_t.items() if t < -0.5), by_t
        first = min(t for t, f in by_t.items() if f >= 0.5 * c)
        assert 0 <= first <= 2.5, by_t
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
    assert gpu.main(argv) == 0
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
    assert gpu.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["meta"]["calls"]) == 2
    assert [r["call"] for r in doc["records"]] == [1] * 4 + [2] * 4
    md = (out / "summary.md").read_text()
    for call in (1, 2):
        row = next(ln for ln in md.splitlines() if ln.startswith(
            f"| msg05 | 1 GPU, direct to node, message budget #0 (call {call}) |"))
        assert row.split(" | ")[5] != "-", row   # x fixed: paired with its own call's bench
