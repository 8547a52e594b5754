"""What a gpumesh target does under a workload: ``gpumesh bench run``, ``trace``, ``report``
and ``plot``.

  gpumesh bench run --target HOST:PORT (--rate R | --concurrency C) [--requests N] [--duration S]
                    [--prompt DIST] [--output DIST] [--trace FILE] [--procs N] [--slo-ttft-ms MS]
                    [--slo-tpot-ms MS] [--label NAME] [--json OUT] [--md OUT]
  gpumesh bench trace --out FILE --requests N [--rate R] [--prompt DIST] [--output DIST]
  gpumesh bench report FILE... [--md OUT]
  gpumesh bench plot FILE... --out PNG [--md OUT]

DIST: fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA[:MAX] | bimodal:SHORT:LONG:P_LONG
(see gpumesh_bench.workload). With --trace, arrivals come from the trace (--rate rescales
them to that mean rate). --procs N runs N processes that split the same request stream by
index (and so the rate, or the concurrency); their results are merged into one file.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from gpumesh_bench.commands import Command
from gpumesh_bench.loadgen import LoadConfig
from gpumesh_bench.multiproc import StreamSpec, run_multi
from gpumesh_bench.report import load_result, markdown_table, plot, result_document, write_json
from gpumesh_bench.stats import SLO, summarize
from gpumesh_bench.workload import (
    LengthDist,
    WorkloadSpec,
    iter_requests,
    length_arg,
    load_trace,
    save_trace,
)


QUESTION = "what a gpumesh target does under a workload (any router or node)"
COMMANDS = (
    Command("run", "drive load against a router or a node", __name__, "run", "run_arguments"),
    Command("trace", "write a synthetic workload as a JSONL trace", __name__, "trace",
            "trace_arguments"),
    Command("report", "markdown table of result files", __name__, "report", "report_arguments"),
    Command("plot", "latency / TTFT / goodput vs offered load, one curve per label", __name__,
            "plot_files", "plot_arguments"),
)


def run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="host:port serving gpumesh.v1.Inference")
    p.add_argument("--model", default="", help="model name or alias ('' = the only one)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=float, default=0.0, help="open loop: Poisson req/s")
    mode.add_argument("--concurrency", type=int, default=0, help="closed loop: requests in flight")
    p.add_argument("--requests", type=int, default=0, help="stop after N requests")
    p.add_argument("--duration", type=float, default=0.0, help="start no request after S seconds")
    p.add_argument("--prompt", type=length_arg, default=LengthDist("fixed", 128), help="prompt tokens")
    p.add_argument("--output", type=length_arg, default=LengthDist("fixed", 128), help="max_tokens")
    p.add_argument("--trace", default="", help="replay a JSONL trace instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--procs", type=int, default=1, help="load-generator processes")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request deadline (s)")
    p.add_argument("--per-token", action="store_true", help="ask for one message per token")
    p.add_argument("--flush-interval-ms", type=int, default=0,
                   help="ask for this coalescing interval (kept as asked: the node's message "
                        "budget does not widen it); 0 = the node's default")
    p.add_argument("--spread-workers", action="store_true",
                   help="a router with --workers N: each process round-robins its calls over "
                        "the workers' own ports (else one connection, hashed to one worker)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--slo-ttft-ms", type=float, default=float("inf"))
    p.add_argument("--slo-tpot-ms", type=float, default=float("inf"))
    p.add_argument("--label", default="", help="policy / setup name for tables and plots")
    p.add_argument("--progress", type=float, default=5.0, help="seconds between progress lines")
    p.add_argument("--json", default="", help="write the result here")
    p.add_argument("--md", default="", help="write a markdown table here")
    p.add_argument("--no-requests", action="store_true", help="omit per-request rows from JSON")


def trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--requests", type=int, required=True)
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--prompt", type=length_arg, default=LengthDist("fixed", 128))
    p.add_argument("--output", type=length_arg, default=LengthDist("fixed", 128))
    p.add_argument("--model", default="")
    p.add_argument("--seed", type=int, default=0)


def report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+")
    p.add_argument("--md", default="")


def plot_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="")
    p.add_argument("--md", default="")


def run(a: argparse.Namespace) -> int:
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
    result = run_multi(cfg, spec, a.procs)
    summary = summarize(result.results, SLO(a.slo_ttft_ms, a.slo_tpot_ms))
    extra = {"procs": a.procs, "trace": a.trace, "prompt": str(a.prompt), "output": str(a.output)}
    doc = result_document(result, summary, extra, include_requests=not a.no_requests)
    table = markdown_table([doc])
    print(table, end="")
    if a.json:
        write_json(a.json, doc)
    if a.md:
        Path(a.md).write_text(table, encoding="utf-8")
    return 0 if summary["ok"] else 1


def trace(a: argparse.Namespace) -> int:
    spec = WorkloadSpec(a.prompt, a.output, a.seed, a.model, a.rate)
    reqs = itertools.islice(iter_requests(spec), a.requests)
    n = save_trace(reqs, a.out)
    print(f"wrote {n} requests to {a.out}", file=sys.stderr)
    return 0


def report(a: argparse.Namespace) -> int:
    table = markdown_table([load_result(f) for f in a.files])
    print(table, end="")
    if a.md:
        Path(a.md).write_text(table, encoding="utf-8")
    return 0


def plot_files(a: argparse.Namespace) -> int:
    docs = [load_result(f) for f in a.files]
    plot(docs, a.out, a.title)
    if a.md:
        Path(a.md).write_text(markdown_table(docs), encoding="utf-8")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0
