"""Shared pieces of the comparison benchmarks: one measured run, capacity, CPU accounting.

``measured_run`` drives one open- or closed-loop run against a target and returns the result
document (``report.result_document``) with extra fields: the CPU seconds each watched
process group spent during the run (``cpu``: name -> {"s", "pct", "ms_per_req"}), the load
generator's own CPU, and the run's labels. Rates and times are wall-clock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpumesh_bench.fleet import group_cpu_s
from gpumesh_bench.loadgen import LoadConfig, RequestResult, run_load
from gpumesh_bench.report import result_document
from gpumesh_bench.stats import SLO, percentile, summarize
from gpumesh_bench.workload import BenchRequest


async def measured_run(cfg: LoadConfig, requests: Iterable[BenchRequest], slo: SLO,
                       watch: Mapping[str, int] | None = None,
                       extra: Mapping[str, Any] | None = None,
                       keep_requests: bool = False) -> dict[str, Any]:
    """One run; ``watch`` maps a name to a process-group id whose CPU is measured."""
    watch = dict(watch or {})
    c0 = {k: group_cpu_s(p) for k, p in watch.items()}
    p0, w0 = time.process_time(), time.perf_counter()
    run = await run_load(cfg, requests)
    wall = time.perf_counter() - w0
    lg = time.process_time() - p0
    c1 = {k: group_cpu_s(p) for k, p in watch.items()}
    summary = summarize(run.results, slo)
    ok = max(1, summary["ok"])
    cpu = cpu_use(c0, c1, lg, wall, ok)
    summary["chunks_per_req"] = (sum(r.chunks for r in run.results if r.status == "OK") / ok)
    doc = result_document(run, summary, dict(extra or {}), include_requests=keep_requests)
    doc["cpu"] = cpu
    doc["run_wall_s"] = wall
    return doc


def cpu_use(c0: Mapping[str, float], c1: Mapping[str, float], loadgen_s: float, wall_s: float,
            ok: int) -> dict[str, dict[str, float]]:
    """CPU of each watched group between two readings (``c0``, ``c1``: seconds) and of the
    load generator (``loadgen_s``): seconds, percent of one core over ``wall_s``, and
    milliseconds per successful request (``ok``)."""
    cpu = {k: {"s": c1[k] - c0[k], "pct": 100 * (c1[k] - c0[k]) / wall_s,
               "ms_per_req": 1000 * (c1[k] - c0[k]) / ok} for k in c0}
    cpu["loadgen"] = {"s": loadgen_s, "pct": 100 * loadgen_s / wall_s,
                      "ms_per_req": 1000 * loadgen_s / ok}
    return cpu


def share_medians(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per node, the median over ``runs`` of its share of the requests (0 where absent)."""
    nodes = sorted({k for r in runs for k in r["summary"]["node_share"]})
    return {k: median([r["summary"]["node_share"].get(k, 0.0) for r in runs]) for k in nodes}


def closed_loop_throughput(results: Sequence[RequestResult], warmup_s: float,
                           end_s: float) -> float:
    """Completions per second inside [warmup_s, end_s] (offsets from the run's start)."""
    done = sum(1 for r in results if r.status == "OK" and warmup_s <= r.start_s + r.latency_s <= end_s)
    return done / max(end_s - warmup_s, 1e-9)


async def measure_capacity(target: str, requests: Iterable[BenchRequest], concurrency: int,
                           duration_s: float, warmup_s: float) -> tuple[float, dict[str, Any]]:
    """Closed-loop saturation: ``concurrency`` requests always in flight for ``duration_s``;
    capacity = completions/s between ``warmup_s`` and ``duration_s``. Returns (req/s, info)."""
    cfg = LoadConfig(target=target, concurrency=concurrency, duration_s=duration_s,
                     timeout_s=300, progress_s=0, label="capacity")
    run = await run_load(cfg, requests)
    cap = closed_loop_throughput(run.results, warmup_s, duration_s)
    s = summarize(run.results)
    return cap, {"concurrency": concurrency, "duration_s": duration_s, "warmup_s": warmup_s,
                 "req_per_s": cap, "completed": s["ok"], "errors": s["errors"],
                 "ttft_p50_ms": s["ttft_ms"]["p50"], "node_share": s["node_share"]}


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return percentile(xs, 50) if xs else math.nan
