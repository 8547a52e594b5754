"""``gpumesh bench``: run load, synthesize traces, tabulate and plot results.

  gpumesh bench run --target HOST:PORT (--rate R | --concurrency C) [--requests N] [--duration S]
                    [--prompt DIST] [--output DIST] [--trace FILE] [--procs N] [--slo-ttft-ms MS]
                    [--slo-tpot-ms MS] [--label NAME] [--json OUT] [--md OUT]
  gpumesh bench trace --out FILE --requests N [--rate R] [--prompt DIST] [--output DIST]
  gpumesh bench report FILE... [--md OUT]
  gpumesh bench plot FILE... --out PNG [--md OUT]
  gpumesh bench compare-policies [--fleets ...] [--loads ...] [--time-scale T] [--repeats R]
  gpumesh bench compare-report compare.json... [--md OUT]
  gpumesh bench overhead [--parts direct,modes,workers,tracing,decision] [--repeats R]
  gpumesh bench scaling [--sizes 1,2,4,8,16,64] [--vllm]
  gpumesh bench vs-smg [--concurrency 8,32] [--repeats R]
  gpumesh bench prefix [--loads 0.5,0.8,...] [--setups least_request,wll,...] [--unique]
  gpumesh bench prefix-restart [--nodes 8] [--repeats 3]
  gpumesh bench prefix-sim [--loads 0.5,0.8,...] [--seeds 3] [--unique]
  gpumesh bench engine-loop --config NODE.toml --concurrency C [--warmup S] [--seconds S]
                            [--prompt DIST] [--output DIST] [--json OUT]

DIST: fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA[:MAX] | bimodal:SHORT:LONG:P_LONG
(see gpumesh_bench.workload). With --trace, arrivals come from the trace (--rate rescales
them to that mean rate). --procs N runs N processes that split the same request stream by
index (and so the rate, or the concurrency); their results are merged into one file.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from gpumesh_bench.loadgen import LoadConfig, RequestResult, RunResult, run_load
from gpumesh_bench.report import (
    load_result,
    markdown_table,
    plot,
    result_document,
    write_json,
)
from gpumesh_bench.stats import SLO, summarize
from gpumesh_bench.workload import (
    BenchRequest,
    LengthDist,
    WorkloadSpec,
    iter_requests,
    load_trace,
    save_trace,
)


def _dist(s: str) -> LengthDist:
    try:
        return LengthDist.parse(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpumesh bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="drive load against a router or a node")
    r.add_argument("--target", required=True, help="host:port serving gpumesh.v1.Inference")
    r.add_argument("--model", default="", help="model name or alias ('' = the only one)")
    mode = r.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=float, default=0.0, help="open loop: Poisson req/s")
    mode.add_argument("--concurrency", type=int, default=0, help="closed loop: requests in flight")
    r.add_argument("--requests", type=int, default=0, help="stop after N requests")
    r.add_argument("--duration", type=float, default=0.0, help="start no request after S seconds")
    r.add_argument("--prompt", type=_dist, default=LengthDist("fixed", 128), help="prompt tokens")
    r.add_argument("--output", type=_dist, default=LengthDist("fixed", 128), help="max_tokens")
    r.add_argument("--trace", default="", help="replay a JSONL trace instead")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--procs", type=int, default=1, help="load-generator processes")
    r.add_argument("--timeout", type=float, default=300.0, help="per-request deadline (s)")
    r.add_argument("--per-token", action="store_true", help="ask for one message per token")
    r.add_argument("--flush-interval-ms", type=int, default=0,
                   help="ask for this coalescing interval (kept as asked: the node's message "
                        "budget does not widen it); 0 = the node's default")
    r.add_argument("--spread-workers", action="store_true",
                   help="a router with --workers N: each process round-robins its calls over "
                        "the workers' own ports (else one connection, hashed to one worker)")
    r.add_argument("--temperature", type=float, default=None)
    r.add_argument("--slo-ttft-ms", type=float, default=float("inf"))
    r.add_argument("--slo-tpot-ms", type=float, default=float("inf"))
    r.add_argument("--label", default="", help="policy / setup name for tables and plots")
    r.add_argument("--progress", type=float, default=5.0, help="seconds between progress lines")
    r.add_argument("--json", default="", help="write the result here")
    r.add_argument("--md", default="", help="write a markdown table here")
    r.add_argument("--no-requests", action="store_true", help="omit per-request rows from JSON")

    t = sub.add_parser("trace", help="write a synthetic workload as a JSONL trace")
    t.add_argument("--out", required=True)
    t.add_argument("--requests", type=int, required=True)
    t.add_argument("--rate", type=float, default=1.0)
    t.add_argument("--prompt", type=_dist, default=LengthDist("fixed", 128))
    t.add_argument("--output", type=_dist, default=LengthDist("fixed", 128))
    t.add_argument("--model", default="")
    t.add_argument("--seed", type=int, default=0)

    rep = sub.add_parser("report", help="markdown table of result files")
    rep.add_argument("files", nargs="+")
    rep.add_argument("--md", default="")

    pl = sub.add_parser("plot", help="latency / TTFT / goodput vs offered load, one curve per label")
    pl.add_argument("files", nargs="+")
    pl.add_argument("--out", required=True)
    pl.add_argument("--title", default="")
    pl.add_argument("--md", default="")
    from gpumesh_bench import compare, overhead, scaling

    cp = sub.add_parser("compare-policies", help="every policy + nginx on one fleet and one trace")
    compare.add_arguments(cp)
    cr = sub.add_parser("compare-report", help="medians over compare-policies result files")
    cr.add_argument("files", nargs="+")
    cr.add_argument("--md", default="")
    ov = sub.add_parser("overhead", help="router vs direct, streaming modes, workers, tracing, "
                                         "decision time")
    overhead.add_arguments(ov)
    sc = sub.add_parser("scaling", help="data-parallel scaling of sim (and vLLM CPU) nodes")
    scaling.add_arguments(sc)
    from gpumesh_bench import vs_smg

    vs = sub.add_parser("vs-smg", help="gpumesh router vs SMG, each against one vLLM CPU worker")
    vs_smg.add_arguments(vs)
    from gpumesh_bench import nodecpu

    nc = sub.add_parser("node-cpu", help="node-process CPU per output token, nodes interleaved")
    nodecpu.add_arguments(nc)
    from gpumesh_bench import grpc_cost

    gc = sub.add_parser("grpc-cost", help="grpc.aio's own server CPU per request and per "
                                          "stream message, on loopback")
    grpc_cost.add_arguments(gc)
    from gpumesh_bench import engine_loop

    el = sub.add_parser("engine-loop", help="closed loop on a node's own engine, in process, "
                                            "no gRPC (the node's engine vs raw vLLM)")
    engine_loop.add_arguments(el)
    from gpumesh_bench import prefix_bench

    pb = sub.add_parser("prefix", help="cache-aware routing on a live simulated fleet: a "
                                       "multi-tenant shared-prefix workload, per setup")
    prefix_bench.add_arguments(pb)
    from gpumesh_bench import prefix_restart

    pr = sub.add_parser("prefix-restart", help="how fast a restarted router's prefix index is "
                                               "whole again (in process, simulated nodes)")
    prefix_restart.add_arguments(pr)
    from gpumesh_bench import prefix_sim

    ps = sub.add_parser("prefix-sim", help="cache-aware routing in the virtual-time simulator "
                                           "(multi-tenant shared-prefix workload, per setup)")
    prefix_sim.add_arguments(ps)
    from gpumesh_bench import soak

    so = sub.add_parser("soak", help="N minutes at 80 %% of the fleet's slots with node churn "
                                     "and a router restart: lost requests, RSS over time")
    soak.add_arguments(so)
    return p


# --- the request stream (rebuilt identically in every process) ------------------------------

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


def _proc_cfg(cfg: LoadConfig, k: int, n: int) -> LoadConfig:
    conc = cfg.concurrency // n + (k < cfg.concurrency % n) if cfg.concurrency else 0
    return dataclasses.replace(cfg, concurrency=conc, num_requests=_share(cfg.num_requests, k, n),
                               progress_s=cfg.progress_s if k == 0 else 0.0)


def _proc_requests(spec: StreamSpec, total: int, k: int, n: int) -> Iterator[BenchRequest]:
    it = make_stream(spec)
    if total > 0:
        it = itertools.islice(it, total)
    return (r for r in it if r.index % n == k)


def _child(cfg: LoadConfig, spec: StreamSpec, total: int, k: int, n: int,
           start_at: float) -> tuple[list[dict[str, Any]], float]:
    run = asyncio.run(run_load(_proc_cfg(cfg, k, n), _proc_requests(spec, total, k, n),
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
        return asyncio.run(run_load(cfg, _proc_requests(spec, cfg.num_requests, 0, 1),
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


def _cmd_run(a: argparse.Namespace) -> int:
    workload = WorkloadSpec(a.prompt, a.output, a.seed, a.model, a.rate)
    spec = StreamSpec(workload)
    rate, total = a.rate, a.requests
    if a.trace:
        trace = load_trace(a.trace, a.model)
        span = trace[-1].arrival_s if trace else 0.0
        native = (len(trace) - 1) / span if span > 0 else 0.0
        scale = native / a.rate if a.rate and native else 1.0
        spec = StreamSpec(workload, a.trace, scale)
        total = min(total, len(trace)) if total else len(trace)
        if not a.concurrency:
            rate = a.rate or native or 1e9  # all-at-zero traces: arrivals are still honoured
    elif not a.rate and not a.concurrency:
        print("gpumesh bench run: give --rate, --concurrency or --trace", file=sys.stderr)
        return 2
    cfg = LoadConfig(target=a.target, rate=0.0 if a.concurrency else rate,
                     concurrency=a.concurrency, num_requests=total, duration_s=a.duration,
                     timeout_s=a.timeout, seed=a.seed, per_token=a.per_token,
                     flush_interval_ms=a.flush_interval_ms,
                     temperature=a.temperature, progress_s=a.progress, label=a.label,
                     spread_workers=a.spread_workers)
    run = run_multi(cfg, spec, a.procs)
    summary = summarize(run.results, SLO(a.slo_ttft_ms, a.slo_tpot_ms))
    extra = {"procs": a.procs, "trace": a.trace, "prompt": str(a.prompt), "output": str(a.output)}
    doc = result_document(run, summary, extra, include_requests=not a.no_requests)
    table = markdown_table([doc])
    print(table, end="")
    if a.json:
        write_json(a.json, doc)
    if a.md:
        with open(a.md, "w", encoding="utf-8") as f:
            f.write(table)
    return 0 if summary["ok"] else 1


def _cmd_trace(a: argparse.Namespace) -> int:
    reqs = itertools.islice(iter_requests(WorkloadSpec(a.prompt, a.output, a.seed, a.model, a.rate)),
                            a.requests)
    n = save_trace(reqs, a.out)
    print(f"wrote {n} requests to {a.out}", file=sys.stderr)
    return 0


def _cmd_report(a: argparse.Namespace) -> int:
    table = markdown_table([load_result(f) for f in a.files])
    print(table, end="")
    if a.md:
        with open(a.md, "w", encoding="utf-8") as f:
            f.write(table)
    return 0


def _cmd_plot(a: argparse.Namespace) -> int:
    docs = [load_result(f) for f in a.files]
    plot(docs, a.out, a.title)
    if a.md:
        with open(a.md, "w", encoding="utf-8") as f:
            f.write(markdown_table(docs))
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``gpumesh bench`` to the ``gpumesh`` command line (the ``gpumesh.commands`` entry
    point); the arguments after ``bench`` go to :func:`main` unparsed."""
    b = sub.add_parser("bench", help="gRPC load generator and policy comparisons", add_help=False)
    # argparse hands a leading option to no REMAINDER positional: `bench --help` is its own flag
    b.add_argument("-h", "--help", action="store_true", dest="bench_help")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=lambda a: main((["--help"] if a.bench_help else []) + a.rest))


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(list(argv) if argv is not None else None)
    if a.cmd == "compare-policies":
        from gpumesh_bench import compare

        return compare.main(a)
    if a.cmd == "compare-report":
        from gpumesh_bench import compare

        return compare.report_main(a.files, a.md)
    if a.cmd in ("overhead", "scaling", "vs-smg"):
        from gpumesh_bench import overhead, scaling, vs_smg

        return {"overhead": overhead.main, "scaling": scaling.main,
                "vs-smg": vs_smg.main}[a.cmd](a)
    if a.cmd == "prefix":
        from gpumesh_bench import prefix_bench

        return prefix_bench.main(a)
    if a.cmd == "prefix-restart":
        from gpumesh_bench import prefix_restart

        return prefix_restart.main(a)
    if a.cmd == "prefix-sim":
        from gpumesh_bench import prefix_sim

        return prefix_sim.main(a)
    if a.cmd == "soak":
        from gpumesh_bench import soak

        return soak.main(a)
    if a.cmd == "engine-loop":
        from gpumesh_bench import engine_loop

        return engine_loop.main(a)
    if a.cmd == "grpc-cost":
        from gpumesh_bench import grpc_cost

        return grpc_cost.main(a)
    if a.cmd == "node-cpu":
        from gpumesh_bench import nodecpu

        return nodecpu.cmd_node_cpu(a)
    return {"run": _cmd_run, "trace": _cmd_trace, "report": _cmd_report, "plot": _cmd_plot}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
