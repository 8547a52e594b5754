"""CPU per output token of node processes, interleaved (ABAB) under the same closed loop.

The node's own process (vLLM's front end and gpumesh's servicer, not vLLM's engine-core
child) is what limits a GPU node (docs/benchmarks-gpu.md, "Where the cores go"). This measures
its CPU seconds per output token: for each round and each node in turn (order alternating),
a closed loop of ``--concurrency`` streams for ``--duration`` s, the node process's CPU time
before and after (psutil, found by its listening port; summed over the node's front-end
processes when it has several), divided by the tokens the loop
received. CPU time, not throughput: on a shared machine it moves far less with contention.

  gpumesh bench node-cpu --target old=127.0.0.1:50061 --target new=127.0.0.1:50063 --rounds 4

Both nodes should serve the same model with the same engine settings (only the code under
test differs, e.g. one started from a git worktree of the previous commit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", action="append", required=True,
                   help="NAME=HOST:PORT of a node (repeat; the first is the baseline)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=12.0)
    p.add_argument("--prompt", default="fixed:32")
    p.add_argument("--output", default="fixed:128")
    p.add_argument("--json", default="")


def node_pids(port: int) -> tuple[int, ...]:
    """The pids listening on ``port``: the node process, and its other front-end processes
    when it has several (``frontends``, sharing the port)."""
    import psutil

    pids = sorted({int(c.pid) for c in psutil.net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   and c.pid})
    if not pids:
        raise RuntimeError(f"no process listens on port {port}")
    return tuple(pids)


def _cpu_s(pids: tuple[int, ...]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += float(t.user + t.system)
    return total


def measure(target: str, pids: tuple[int, ...], a: argparse.Namespace) -> dict[str, Any]:
    from gpumesh_bench.multiproc import StreamSpec, proc_requests
    from gpumesh_bench.loadgen import LoadConfig, run_load
    from gpumesh_bench.workload import LengthDist, WorkloadSpec

    cfg = LoadConfig(target=target, concurrency=a.concurrency, duration_s=a.duration,
                     timeout_s=120.0, seed=0, progress_s=0.0, spread_workers=True)
    spec = StreamSpec(WorkloadSpec(LengthDist.parse(a.prompt), LengthDist.parse(a.output), 0, "",
                                   0.0))
    c0 = _cpu_s(pids)
    run = asyncio.run(run_load(cfg, proc_requests(spec, 0, 0, 1)))
    c1 = _cpu_s(pids)
    ok = [r for r in run.results if r.status == "OK"]
    tokens = sum(r.output_tokens for r in ok)
    return {"cpu_s": round(c1 - c0, 3), "tokens": tokens, "requests": len(run.results),
            "errors": len(run.results) - len(ok), "tok_s": round(tokens / max(run.wall_s, 1e-9), 1),
            "us_per_token": round(1e6 * (c1 - c0) / max(tokens, 1), 2)}


def main(a: argparse.Namespace) -> int:
    targets = []
    for t in a.target:
        name, _, addr = t.partition("=")
        if not addr:
            raise SystemExit(f"--target wants NAME=HOST:PORT, got {t!r}")
        targets.append((name, addr, node_pids(int(addr.rsplit(":", 1)[1]))))
    rows: list[dict[str, Any]] = []
    for k in range(a.rounds):
        order = targets if k % 2 == 0 else list(reversed(targets))
        for name, addr, pids in order:
            r = {"round": k, "node": name, **measure(addr, pids, a)}
            rows.append(r)
            print(json.dumps(r), flush=True)
    med = {n: statistics.median(r["us_per_token"] for r in rows if r["node"] == n)
           for n, _, _ in targets}
    base = targets[0][0]
    print(f"\n| node | us of node-process CPU per output token (median of {a.rounds}) | x {base} |")
    print("|---|---|---|")
    for n, _, _ in targets:
        print(f"| {n} | {med[n]:.1f} | {med[n] / med[base]:.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows,
                                            "median_us_per_token": med}, indent=1, default=str))
    return 0
