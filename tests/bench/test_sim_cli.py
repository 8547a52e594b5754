"""``gpumesh sim run`` / ``plan`` with traces and seeds, and the run metrics' definitions: a
trace runs what it holds unless ``--requests`` cuts it and the record says what ran; ``--load``
rescales a trace to the fleet's capacity; the record says whether seeds drew workloads or
replayed one trace; goodput counts requests in SLO per second of offered time; outputs cut at
the context length are counted, logged and recorded. Small runs only."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from gpumesh_bench.sim import cli, core, metrics
from gpumesh_bench.sim import workloads as wl


def _trace(path: Path, n: int, gap_s: float = 0.01, prompt: int = 64, out: int = 16) -> Path:
    path.write_text("\n".join(json.dumps({"arrival_s": i * gap_s, "prompt_tokens": prompt,
                                          "max_tokens": out}) for i in range(n)) + "\n")
    return path


def _run(tmp_path: Path, *args: str) -> dict[str, object]:
    out = tmp_path / "rec.json"
    assert cli.main(["run", "--fleet", "homo", "--policies", "least_request", "--seeds", "1",
                     *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_a_trace_runs_all_it_holds_unless_requests_cuts_it(tmp_path: Path) -> None:
    t = _trace(tmp_path / "t.jsonl", 120)
    rec = _run(tmp_path, "--trace", str(t))
    assert rec["requests"] == 120 and rec["requests_in_trace"] == 120
    # run_metrics leaves the first 5 % out: 6 of 120
    assert rec["runs"]["least_request"][0]["requests"] == 114
    cut = _run(tmp_path, "--trace", str(t), "--requests", "50")
    assert cut["requests"] == 50 and cut["requests_in_trace"] == 120
    assert cut["runs"]["least_request"][0]["requests"] == 48
    with pytest.raises(SystemExit):
        cli.main(["run", "--trace", str(t), "--requests", "0"])


def test_a_trace_keeps_its_own_times_unless_told(tmp_path: Path) -> None:
    t = _trace(tmp_path / "t.jsonl", 101, gap_s=0.02)   # 50 req/s
    rec = _run(tmp_path, "--trace", str(t))
    assert rec["rate"] == pytest.approx(50.0) and rec["load"] == 0.0
    fast = _run(tmp_path, "--trace", str(t), "--rate", "200")
    assert fast["rate"] == 200.0
    # offered time of the measured requests (96 of 101, 95 gaps) at 200 req/s
    assert fast["runs"]["least_request"][0]["offered_s"] == pytest.approx(95 / 200)


def test_load_works_with_a_trace(tmp_path: Path) -> None:
    t = _trace(tmp_path / "t.jsonl", 400, prompt=256, out=32)
    rec = _run(tmp_path, "--trace", str(t), "--load", "0.5")
    assert rec["capacity"] > 0 and rec["load"] == 0.5
    assert rec["rate"] == pytest.approx(0.5 * rec["capacity"])
    run = rec["runs"]["least_request"][0]
    assert run["offered_s"] == pytest.approx((run["requests"] - 1) / rec["rate"], rel=1e-6)


def test_seeds_draw_workloads_and_the_record_says_when_a_trace_is_replayed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t = _trace(tmp_path / "t.jsonl", 80)
    rec = _run(tmp_path, "--trace", str(t), "--seeds", "1,2")
    assert rec["trace_replayed"] is True and "simulator" in str(rec["seeds_vary"])
    assert "one fixed trace" in capsys.readouterr().out
    gen = _run(tmp_path, "--workload", "lognormal", "--rate", "100", "--requests", "80",
               "--seeds", "1,2")
    assert gen["trace_replayed"] is False and "workload" in str(gen["seeds_vary"])
    assert "fresh draw of the workload" in capsys.readouterr().out
    a, b = gen["runs"]["least_request"]
    assert a["offered_s"] != b["offered_s"]   # two seeds, two different workloads


def _record(i: int, arrival: float, end: float, out: int = 8) -> core.RequestRecord:
    r = core.RequestRecord(i, arrival, 64, out, node_id="n0")
    r.first_s = arrival + 0.01
    r.end_s = end
    return r


def test_goodput_is_set_by_offered_time_not_by_a_straggler() -> None:
    recs = [_record(i, i * 0.1, i * 0.1 + 0.05) for i in range(100)]   # 9.9 s offered
    calm = core.RunResult(recs, ("n0",), 10.0, 0, 0)
    slo = metrics.SLOSpec(100, 15)
    base = metrics.run_metrics(calm, slo, warmup=0.0)
    assert base["goodput"] == pytest.approx(100 / 9.9) and base["slo_frac"] == 1.0
    # one request of the same run takes 1,000 s (out of SLO): goodput barely moves
    recs[50] = _record(50, 5.0, 1000.0, out=2)
    late = metrics.run_metrics(core.RunResult(recs, ("n0",), 1000.0, 0, 0), slo, warmup=0.0)
    assert late["goodput"] == pytest.approx(99 / 9.9)
    assert late["slo_frac"] == pytest.approx(0.99)
    assert late["throughput"] < 0.2   # completions over the span to the last end
    one = metrics.run_metrics(core.RunResult(recs[:1], ("n0",), 1.0, 0, 0), slo, warmup=0.0)
    assert one["goodput"] != one["goodput"]   # NaN: no offered time


def test_outputs_cut_at_the_context_are_counted_logged_and_recorded(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    # homo's context is 4,096 tokens: 4,000 + 500 does not fit, 64 + 16 does
    t = tmp_path / "t.jsonl"
    t.write_text("\n".join(json.dumps({"arrival_s": i * 0.01, "prompt_tokens": 4000 if i % 4
                                       else 64, "max_tokens": 500 if i % 4 else 16})
                           for i in range(40)) + "\n")
    with caplog.at_level(logging.WARNING, logger="gpumesh_bench.sim.grid"):
        rec = _run(tmp_path, "--trace", str(t))
    assert rec["runs"]["least_request"][0]["cut_outputs"] == 30
    assert rec["warnings"] and "30" in rec["warnings"][0]
    assert any("context length" in r.getMessage() for r in caplog.records)
    assert "WARNING: outputs cut" in capsys.readouterr().out
    fine = _run(tmp_path, "--trace", str(_trace(tmp_path / "ok.jsonl", 40)))
    assert "warnings" not in fine and fine["runs"]["least_request"][0]["cut_outputs"] == 0


def test_plan_replays_the_whole_trace_by_default(tmp_path: Path) -> None:
    t = wl.load_trace(_trace(tmp_path / "t.jsonl", 90))
    from gpumesh_bench.sim import capacity, fleets

    w = capacity._workload(t, "lognormal", fleets.builtin("homo"), 0, 30.0, 1)
    assert len(w.arrivals) == 90 and wl.mean_rate(w) == pytest.approx(30.0)
    assert len(capacity._workload(t, "lognormal", fleets.builtin("homo"), 40, 30.0, 1
                                  ).arrivals) == 40


def test_policies_are_checked_and_the_smg_reference_runs_from_the_cli(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--policies", "least_request,nosuch"])
    assert "unknown policy nosuch" in capsys.readouterr().err
    rec = _run(tmp_path, "--workload", "conversations", "--rate", "100", "--requests", "200",
               "--policies", "least_request,smg_cache_aware")
    assert set(rec["agg"]) == {"least_request", "smg_cache_aware"}
