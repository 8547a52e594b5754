"""``gpumesh bench scaling``: data-parallel scaling of simulated nodes behind one router.

For N in ``--sizes`` (default 1,2,4,8,16,64) identical sim nodes (speed 1, ``max_num_seqs``
16) behind a ``predicted_latency`` router:

- the time scale grows with N (``time_scale = --t0 x N``), so the fleet's wall-clock request
  rate -- and so the CPU the router, the nodes and the load generator need on these 2 cores --
  stays about the same for every N. Throughputs are therefore compared in SIMULATED req/s
  (wall req/s x time_scale); latencies in simulated ms (wall / time_scale).
- saturation: a closed loop with ``--cap-factor x max_num_seqs x N`` requests in flight (every
  node full and queueing whatever the balance); capacity = completions per (simulated) second
  after a warm-up. Efficiency_sat(N) = cap(N) / (N cap(1)).
- at a fixed p99 bound: open-loop Poisson at f x N x cap(1) for f = 0.95, 0.90, ... until the
  p99 latency is within ``--p99-bound`` x the unloaded latency; Efficiency_p99(N) =
  f(N) / f(1) (granularity 0.05).

``--vllm`` adds 1 -> 2 real vLLM CPU nodes on the tiny model (each
``VLLM_CPU_OMP_THREADS_BIND`` to its own core): closed-loop throughput through the router.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from pathlib import Path
from typing import Any

from gpumesh.launcher import ChildProcess, free_port, stop_all, wait_until
from gpumesh_bench.fleet import Fleet, RouterSpec, SimNodeSpec, bench_child
from gpumesh_bench.harness import closed_loop_throughput
from gpumesh_bench.loadgen import LoadConfig, run_load
from gpumesh_bench.report import write_json
from gpumesh_bench.stats import summarize
from gpumesh_bench.workload import LengthDist, WorkloadSpec, iter_requests


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1,2,4,8,16,64")
    p.add_argument("--t0", type=float, default=1.0, help="time_scale per node")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--prompt", default="lognormal:128:0.5:512")
    p.add_argument("--output", default="fixed:32")
    p.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per run")
    p.add_argument("--p99-bound", type=float, default=3.0, help="x unloaded latency")
    p.add_argument("--fractions", default="0.95,0.9,0.85,0.8,0.75,0.7,0.6,0.5")
    p.add_argument("--cap-factor", type=float, default=2.0,
                   help="saturation run: requests in flight = factor x max_num_seqs x N")
    p.add_argument("--vllm", action="store_true", help="also 1 -> 2 real vLLM CPU nodes")
    p.add_argument("--vllm-model", default=os.environ.get("GPUMESH_TINY_MODEL", "models/tiny"))
    p.add_argument("--out", default="bench-results/scaling")


async def _closed(target: str, spec: WorkloadSpec, conc: int, dur: float) -> float:
    cfg = LoadConfig(target=target, concurrency=conc, duration_s=dur, progress_s=0, timeout_s=300)
    run = await run_load(cfg, iter_requests(spec))
    return closed_loop_throughput(run.results, dur / 3, dur)


async def _open(target: str, spec: WorkloadSpec, rate: float, dur: float) -> dict[str, Any]:
    n = max(50, math.ceil(rate * dur))
    cfg = LoadConfig(target=target, rate=rate, num_requests=n, progress_s=0, timeout_s=300)
    ws = WorkloadSpec(spec.prompt, spec.output, spec.seed, "", rate)
    run = await run_load(cfg, iter_requests(ws))
    return summarize(run.results)


async def _unloaded(target: str, spec: WorkloadSpec) -> float:
    cfg = LoadConfig(target=target, concurrency=1, num_requests=20, progress_s=0)
    run = await run_load(cfg, iter_requests(spec))
    return summarize(run.results)["latency_ms"]["p50"]


def sim_scaling(a: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    spec = WorkloadSpec(LengthDist.parse(a.prompt), LengthDist.parse(a.output), 7)
    fracs = [float(x) for x in a.fractions.split(",")]
    rows: list[dict[str, Any]] = []
    cap1 = f1 = 0.0
    for n in [int(x) for x in a.sizes.split(",")]:
        ts = a.t0 * n
        nodes = [SimNodeSpec(f"s{i:02d}", 1.0, sim={"max_num_seqs": a.max_num_seqs})
                 for i in range(n)]
        per_proc = max(1, math.ceil(n / 8))
        with Fleet(nodes, routers=[RouterSpec("r", "predicted_latency")], time_scale=ts,
                   nodes_per_proc=per_proc, log_dir=out / "logs" / f"n{n}") as fleet:
            tgt = fleet.address("r")
            unl = asyncio.run(_unloaded(tgt, spec)) / ts
            asyncio.run(fleet.wait_idle("r"))
            conc = max(1, round(a.cap_factor * a.max_num_seqs * n))
            cap = asyncio.run(_closed(tgt, spec, conc, a.duration)) * ts
            if n == 1 or cap1 == 0:
                cap1 = cap / n
            row: dict[str, Any] = {"nodes": n, "time_scale": ts, "unloaded_ms": unl,
                                   "cap_sim_rps": cap, "eff_sat": cap / (n * cap1),
                                   "bound_ms": a.p99_bound * unl, "trials": []}
            print(f"[scaling] N={n} T={ts:g} unloaded={unl:.0f} ms cap={cap:.0f} req/s(sim) "
                  f"eff_sat={row['eff_sat']:.3f}", file=sys.stderr, flush=True)
            for f in fracs:
                asyncio.run(fleet.wait_idle("r"))
                rate = f * n * cap1 / ts
                s = asyncio.run(_open(tgt, spec, rate, a.duration))
                p99 = s["latency_ms"]["p99"] / ts
                ok = s["ok"] == s["requests"] and p99 <= row["bound_ms"]
                row["trials"].append({"f": f, "rate_wall": rate, "p99_sim_ms": p99, "ok": ok,
                                      "req_per_s_sim": s["req_per_s"] * ts,
                                      "share_max": max(s["node_share"].values(), default=0)})
                print(f"[scaling] N={n} f={f:.2f} p99={p99:.0f} ms (bound {row['bound_ms']:.0f})"
                      f" {'ok' if ok else 'over'}", file=sys.stderr, flush=True)
                if ok:
                    row["f_at_bound"] = f
                    break
            if n == 1:
                f1 = row.get("f_at_bound", fracs[-1])
            row["eff_p99"] = row.get("f_at_bound", 0.0) / f1 if f1 else float("nan")
        rows.append(row)
        write_json(out / "scaling.json", {"sim": rows})
    return rows


def vllm_scaling(a: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """1 -> 2 real vLLM CPU nodes (tiny model), each bound to its own core, via the router."""
    from gpumesh.tiny_model import build_tiny_model

    model = str(build_tiny_model(a.vllm_model)) if not Path(a.vllm_model, "config.json").exists() \
        else a.vllm_model
    rows = []
    logs = out / "logs" / "vllm"
    logs.mkdir(parents=True, exist_ok=True)
    for n in (1, 2):
        rport = free_port()
        kids = [bench_child("router", [sys.executable, "-m", "gpumesh.cli", "--log-level", "warning",
                                 "router", "--host", "127.0.0.1", "--port", str(rport)], logs)]
        try:
            for i in range(n):
                env = {"VLLM_CPU_OMP_THREADS_BIND": str(i), "VLLM_CPU_KVCACHE_SPACE": "1"}
                kids.append(bench_child(f"vllm{i}", [
                    sys.executable, "-m", "gpumesh.cli", "--log-level", "warning", "node",
                    "--engine", "vllm", "--model", model, "--port", str(free_port()),
                    "--node-id", f"vllm{i}", "--router", f"127.0.0.1:{rport}",
                    "--max-model-len", "512"], logs, env, cpus=str(i)))
            _wait_fleet(f"127.0.0.1:{rport}", n, kids, 240)
            spec = WorkloadSpec(LengthDist("fixed", 64), LengthDist("fixed", 32), 3)
            thr = asyncio.run(_closed(f"127.0.0.1:{rport}", spec, 8 * n, 20.0))
            rows.append({"nodes": n, "req_per_s": thr})
            print(f"[scaling] vLLM CPU N={n}: {thr:.2f} req/s", file=sys.stderr, flush=True)
        finally:
            stop_all(kids, 20.0)
    return rows


def _wait_fleet(router: str, n: int, kids: list[ChildProcess], timeout_s: float) -> None:
    import grpc

    from gpumesh.v1 import control_pb2 as cpb
    from gpumesh.v1 import control_pb2_grpc as cpb_grpc

    with grpc.insecure_channel(router) as ch:
        stub = cpb_grpc.RouterStub(ch)

        def healthy() -> bool:
            fl = stub.GetFleet(cpb.GetFleetRequest(), timeout=2)
            return sum(x.state == cpb.NodeState.Value("NODE_STATE_HEALTHY")
                       for x in fl.nodes) >= n

        wait_until(healthy, timeout_s, watch=kids, what="vLLM nodes healthy", poll_s=1.0)


def markdown(res: dict[str, Any]) -> str:
    head = ("| nodes | time_scale | capacity (sim req/s) | per node vs 1 node (saturation) | "
            "load at p99 bound (x N x cap1) | per node vs 1 node (p99 bound) |")
    lines = [head, "|" + "---|" * 6]
    for r in res.get("sim", []):
        lines.append(f"| {r['nodes']} | {r['time_scale']:g} | {r['cap_sim_rps']:.0f} | "
                     f"{r['eff_sat']:.3f} | {r.get('f_at_bound', float('nan')):.2f} | "
                     f"{r['eff_p99']:.2f} |")
    if res.get("vllm"):
        lines += ["", "| vLLM CPU nodes | req/s | vs 1 node |", "|---|---|---|"]
        base = res["vllm"][0]["req_per_s"]
        for r in res["vllm"]:
            lines.append(f"| {r['nodes']} | {r['req_per_s']:.2f} | {r['req_per_s'] / base:.2f} |")
    return "\n".join(lines) + "\n"


def main(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"args": vars(a)}
    try:
        if a.sizes:
            res["sim"] = sim_scaling(a, out)
        if a.vllm:
            res["vllm"] = vllm_scaling(a, out)
    finally:
        write_json(out / "scaling.json", res)
        md = markdown(res)
        (out / "scaling.md").write_text(md, encoding="utf-8")
        print(md)
    return 0
