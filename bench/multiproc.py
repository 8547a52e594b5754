"""The load generator in several processes: one request stream, split by index.

A :class:`StreamSpec` names the stream (a synthetic workload, or a trace rescaled in time);
every process rebuilds the same stream and keeps the requests whose ``index % n == k``, so the
union of the processes' requests is exactly the one-process run, and the rate (or the
concurrency) is split between them. :func:`run_multi` spawns the processes, starts them at one
instant and merges their results (``gpumesh bench run --procs N``, the GPU harness).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import time
from collections.abc import Iterator
from typing import Any

from gpumesh_bench.loadgen import LoadConfig, RequestResult, RunResult, run_load
from gpumesh_bench.workload import BenchRequest, WorkloadSpec, iter_requests, load_trace


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    workload: WorkloadSpec
    trace: str = ""
    trace_time_scale: float = 1.0


def make_stream(spec: StreamSpec) -> Iterator[BenchRequest]:
    if spec.trace:
        return iter(load_trace(spec.trace, spec.workload.model, spec.trace_time_scale))
    return iter_requests(spec.workload)


def _share(total: int, k: int, n: int) -> int:
    return (total - k + n - 1) // n if total > 0 else 0


def proc_config(cfg: LoadConfig, k: int, n: int) -> LoadConfig:
    """Process ``k`` of ``n``'s share of ``cfg``: its part of the concurrency and of the
    request count; only process 0 prints progress."""
    conc = cfg.concurrency // n + (k < cfg.concurrency % n) if cfg.concurrency else 0
    return dataclasses.replace(cfg, concurrency=conc, num_requests=_share(cfg.num_requests, k, n),
                               progress_s=cfg.progress_s if k == 0 else 0.0)


def proc_requests(spec: StreamSpec, total: int, k: int, n: int) -> Iterator[BenchRequest]:
    """Process ``k`` of ``n``'s requests: the first ``total`` of the stream (all when 0) whose
    index is ``k`` modulo ``n``."""
    it = make_stream(spec)
    if total > 0:
        it = itertools.islice(it, total)
    return (r for r in it if r.index % n == k)


def _child(cfg: LoadConfig, spec: StreamSpec, total: int, k: int, n: int,
           start_at: float) -> tuple[list[dict[str, Any]], float]:
    run = asyncio.run(run_load(proc_config(cfg, k, n), proc_requests(spec, total, k, n),
                               start_at=start_at, progress_prefix=f"[bench p{k}] "))
    return [dataclasses.asdict(r) for r in run.results], run.wall_s


def start_instant(procs: int) -> float:
    """When ``procs`` load processes, spawned now, have all connected (a ``time.time()``)."""
    return time.time() + 2.0 + 0.2 * procs


def run_multi(cfg: LoadConfig, spec: StreamSpec, procs: int,
              start_at: float | None = None) -> RunResult:
    """Run ``procs`` load-generator processes and merge their results (one start instant:
    ``start_at``, a ``time.time()``; by default ``start_instant(procs)``, or at once for one
    process). Results' ``start_s`` count from it."""
    if procs <= 1:
        return asyncio.run(run_load(cfg, proc_requests(spec, cfg.num_requests, 0, 1),
                                    start_at=start_at, progress_prefix="[bench] "))
    if cfg.concurrency and cfg.concurrency < procs:
        raise ValueError("--concurrency must be >= --procs")
    if start_at is None:
        start_at = start_instant(procs)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=ctx) as ex:
        futs = [ex.submit(_child, cfg, spec, cfg.num_requests, k, procs, start_at)
                for k in range(procs)]
        parts = [f.result() for f in futs]
    results = sorted((RequestResult(**d) for rows, _ in parts for d in rows), key=lambda r: r.index)
    return RunResult(config=dataclasses.asdict(cfg), results=results,
                     wall_s=max(w for _, w in parts))
