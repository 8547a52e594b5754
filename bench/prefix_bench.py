"""``gpumesh bench prefix``: cache-aware routing on a live simulated fleet.

One ``Fleet`` of simulated nodes (``--nodes``, the 7B shape, per-node KV ``--kv-tokens``:
about a quarter of all tenants' system prompts) with one router per setup, every node
heartbeating and streaming its KV block events to each:

- ``least_request``: fewest in flight;
- ``wll``: weighted_least_load without locality (``--prefix-locality off``);
- ``approximate``: weighted_least_load, the router's own record of where it sent prefixes;
- ``precise``: weighted_least_load, the nodes' KV events;
- ``affinity``: weighted_least_load without locality, session affinity on the conversation id
  (the others run with ``--session-affinity-weight 0``).

Workload (``gpumesh_bench.tenants``): ``--tenants`` tenants with ~4,000-token system prompts,
multi-turn conversations; ``--unique`` the control with no shared prefix. Load is relative to
the fleet's nominal capacity without prefix reuse (each node's full-budget prefill rate over
the mean prompt length: what no cache at all allows). For each load the same Poisson trace is
replayed through every setup (order rotated per load); requests that start in the first
``--warmup`` seconds only warm the caches (the nodes' caches are shared across setups, so each
run first replaces the previous setup's placement with its own) and are not counted.

Times are reported in SIMULATED seconds (wall / ``--time-scale``). Results: OUT/prefix.json
(every run's summary), OUT/prefix.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import grpc

from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc
from gpumesh_bench.fleet import Fleet, RouterSpec, SimNodeSpec
from gpumesh_bench.loadgen import BenchRequest, LoadConfig, drive, send_message
from gpumesh_bench.stats import SLO, percentile
from gpumesh_bench.tenants import TenantRequest, TenantSpec, trace

SETUPS: dict[str, tuple[str, ...]] = {
    "least_request": ("--policy", "least_request", "--prefix-locality", "off"),
    "wll": ("--prefix-locality", "off", "--affinity-weight", "0"),
    "approximate": ("--prefix-locality", "approximate", "--affinity-weight", "0"),
    "precise": ("--prefix-locality", "precise", "--affinity-weight", "0"),
    "affinity": ("--prefix-locality", "off", "--affinity-weight", "1"),
}
SHAPE_7B = {"step_a_ms": 4.74, "step_b_decode_ms": 0.0109, "step_b_prefill_ms": 0.0241}


def nominal_capacity(nodes: int, mean_prompt_tokens: float, budget: int = 16384) -> float:
    """Requests per simulated second the fleet prefills with no prefix reuse at all."""
    step_ms = SHAPE_7B["step_a_ms"] + SHAPE_7B["step_b_prefill_ms"] * budget
    return nodes * budget / (step_ms / 1000) / mean_prompt_tokens


async def run_one(target: str, reqs: list[TenantRequest], time_scale: float, warmup_s: float,
                  label: str) -> dict[str, Any]:
    """Replays ``reqs`` (arrivals in simulated seconds) against ``target``."""
    keys = {r.index: r.conversation for r in reqs}
    bench = [BenchRequest(r.index, r.arrival_s * time_scale, len(r.prompt) // 4, r.max_tokens,
                          r.prompt, "sim") for r in reqs]
    msgs = {}
    for r in reqs:
        m = pb.GenerateRequest(model="sim", text=r.prompt, routing_key=keys[r.index],
                               request_id=f"{label}-{r.index}")
        m.sampling.max_tokens = r.max_tokens
        m.sampling.ignore_eos = True
        msgs[r.index] = m
    cfg = LoadConfig(target=target, rate=1.0, num_requests=len(bench), timeout_s=600,
                     progress_s=0, label=label)
    async with grpc.aio.insecure_channel(
            target, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.InferenceStub(ch)
        await asyncio.wait_for(ch.channel_ready(), timeout=30)
        run = await drive(cfg, bench, lambda b, t0: send_message(stub, msgs[b.index], b, cfg, t0))
    kept = [x for x in run.results if x.start_s >= warmup_s * time_scale]
    ok = [x for x in kept if x.status == "OK" and x.ttft_s is not None]
    ttft = [x.ttft_s / time_scale for x in ok]
    lat = [x.latency_s / time_scale for x in ok]
    if kept:
        t0 = min(x.start_s for x in kept)
        t1 = max(x.start_s + x.latency_s for x in kept)
        window = max(t1 - t0, 1e-9) / time_scale
    else:
        window = math.nan
    return {"label": label, "requests": len(kept), "ok": len(ok),
            "errors": len(kept) - len(ok), "window_s": window,
            "req_per_s": len(ok) / window if kept else 0.0,
            "ttft_s": {"p50": percentile(ttft, 50), "p90": percentile(ttft, 90),
                       "p99": percentile(ttft, 99), "mean": sum(ttft) / max(len(ttft), 1)},
            "latency_s": {"p50": percentile(lat, 50), "p90": percentile(lat, 90)},
            "nodes": sorted({x.node_id for x in ok})}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench/results/prefix")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--tenants", type=int, default=64)
    p.add_argument("--kv-tokens", type=int, default=72_000,
                   help="per node (64 tenants x 4,000 tokens / 4 = 64,000 of prefixes)")
    p.add_argument("--time-scale", type=float, default=8.0)
    p.add_argument("--loads", default="0.5,0.8,1.2,1.8,2.7",
                   help="x the nominal capacity without prefix reuse")
    p.add_argument("--duration", type=float, default=6.0, help="simulated seconds of arrivals")
    p.add_argument("--warmup", type=float, default=2.0, help="simulated seconds not counted")
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--unique", action="store_true", help="the control: no shared prefixes")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="simulated seconds, p90")
    p.add_argument("--seed", type=int, default=0)


def main(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    setups = [s for s in a.setups.split(",") if s]
    loads = [float(x) for x in a.loads.split(",") if x]
    probe = trace(TenantSpec(tenants=a.tenants, rate=10.0, seed=a.seed, unique=a.unique), 20.0)
    mean_tokens = sum(len(r.prompt) for r in probe) / len(probe) / 4.6   # ~chars per sim token
    cap = nominal_capacity(a.nodes, mean_tokens)
    nodes = [SimNodeSpec(f"n{i:02d}", 1.0, a.kv_tokens, sim=dict(SHAPE_7B))
             for i in range(a.nodes)]
    routers = [RouterSpec(s, flags=SETUPS[s]) for s in setups]
    doc: dict[str, Any] = {"args": vars(a), "nominal_capacity_req_per_s": cap, "runs": []}
    os.environ.setdefault("GPUMESH_TICKET_SECRET", "bench-secret-not-for-production")
    with Fleet(nodes, routers=routers, time_scale=a.time_scale,
               log_dir=out / "logs") as fleet:
        for k, load in enumerate(loads):
            spec = TenantSpec(tenants=a.tenants, rate=load * cap, seed=a.seed + k,
                              unique=a.unique)
            reqs = trace(spec, a.duration)
            order = setups[k % len(setups):] + setups[:k % len(setups)]
            for s in order:
                asyncio.run(fleet.wait_idle(s, 120))
                t = time.perf_counter()
                r = asyncio.run(run_one(fleet.address(s), reqs, a.time_scale, a.warmup,
                                        f"{s}-{load:g}"))
                r.update({"setup": s, "load": load, "rate_req_per_s": load * cap,
                          "wall_s": time.perf_counter() - t})
                doc["runs"].append(r)
                print(f"load {load:g} {s:14s} p50 {r['ttft_s']['p50']:.3f}s "
                      f"p90 {r['ttft_s']['p90']:.3f}s ok {r['ok']}/{r['requests']} "
                      f"{r['req_per_s']:.1f} req/s", flush=True)
                (out / "prefix.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    (out / "prefix.md").write_text(markdown(doc, a.slo_ttft), encoding="utf-8")
    print(markdown(doc, a.slo_ttft))
    return 0


def markdown(doc: dict[str, Any], slo_s: float) -> str:
    runs = doc["runs"]
    setups = list(dict.fromkeys(r["setup"] for r in runs))
    loads = sorted({r["load"] for r in runs})
    at = {(r["setup"], r["load"]): r for r in runs}
    lines = ["| load | " + " | ".join(f"{s} p90 TTFT s" for s in setups) + " |",
             "|" + "---|" * (len(setups) + 1)]
    for ld in loads:
        cells = []
        for s in setups:
            r = at.get((s, ld))
            cells.append("-" if r is None else f"{r['ttft_s']['p90']:.3f}")
        lines.append(f"| {ld:g} | " + " | ".join(cells) + " |")
    lines += ["", f"Throughput at SLO (p90 TTFT <= {slo_s:g} s, no errors): highest "
              "completed req/s over the loads that meet it.", "",
              "| setup | req/s at SLO |", "|---|---|"]
    for s in setups:
        good = [at[(s, ld)]["req_per_s"] for ld in loads if (s, ld) in at
                and at[(s, ld)]["ttft_s"]["p90"] <= slo_s and at[(s, ld)]["errors"] == 0]
        lines.append(f"| {s} | {max(good) if good else 0:.1f} |")
    return "\n".join(lines) + "\n"
