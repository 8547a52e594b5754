"""``python -m gpumesh_bench.peers.smg_fleet``: gpumesh vs SMG on the same simulated fleet.

One simulated fleet (default ``hetero-eqkv``: 8 nodes, speeds 1,1,1,1,2,2,0.5,0.5, 8,192 KV
tokens each, ``max_num_seqs`` 32, as in docs/benchmarks.md section 1) is fronted at the same
time by

- gpumesh routers (``predicted_latency`` and ``least_request``; every node heartbeats to
  each, nodes declare capacity weight = speed, router time constants scaled by ``time_scale``
  as in section 1), reached over ``gpumesh.v1.Inference`` gRPC, and
- SMG 1.13.0 gateways (one process per policy variant), reached over OpenAI HTTP
  ``/v1/completions`` with SSE; SMG routes to the same nodes' ``VllmEngine`` gRPC service (same
  port). SMG has no capacity weights: every worker counts the same.

Only one gateway carries traffic per run; every run starts when the fleet is idle (the WLL
router's view of every node: nothing running, waiting or in flight).

Same requests on both paths: prompts are built from the tiny model's BPE so that a prompt of N
words is exactly N tokens (every word is one vocabulary token with its leading space). The
gpumesh path sends those token ids (``GenerateRequest.token_ids``); the SMG path sends the text
(SMG 1.13.0 refuses integer-array prompts), which SMG tokenizes back into the same ids (the
SSE ``usage.prompt_tokens`` is checked against N for every request). Output: ``max_tokens`` and
``ignore_eos``, the sim ignores temperature.

Measurement is the load generator's (``gpumesh_bench.loadgen``): open-loop arrivals from one
recorded Poisson trace (rescaled to each load), TTFT = the first message carrying a token (gRPC
chunk with token ids / SSE event with non-empty text), latency = end of stream, TPOT =
(latency - TTFT) / (output tokens - 1) with output tokens from the final usage. Per-node share:
gRPC trailing metadata (``x-gpumesh-node-id``) / SMG's ``x-smg-routed-worker-id`` response
header (the worker URL, mapped back to the node id).

SMG load freshness: ``least_load`` and ``power_of_two`` read ``GetLoads`` polled every
``--load-monitor-interval`` seconds (an integer in SMG 1.13.0, default 10); each SMG variant
says its interval. ``cache_aware`` also subscribes to the nodes' pushed load records
(``SubscribeKvEvents``, checked every 0.1 s wall). SMG's time constants that are seconds or
rates are scaled by ``time_scale`` like gpumesh's (``--least-load-kv-pressure-weight`` 0.15 s x T,
``--least-load-default-throughput`` 2000 / T). Everything else is SMG's default, including worker
overload protection (a worker with >= 8 waiting requests or >= 0.8 KV usage is skipped while
another is under both).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpumesh.launcher import stop_all
from gpumesh_bench import REPO_ROOT
from gpumesh_bench.policies.compare import HETERO_SPEEDS, WORKLOADS, parse_variants
from gpumesh_bench.fleet import Fleet, RouterSpec, hetero_nodes
from gpumesh_bench.harness import closed_loop_throughput
from gpumesh_bench.loadgen import LoadConfig
from gpumesh_bench.report import write_json
from gpumesh_bench.peers.smg_clients import BpePrompts, Target, measured, run_target
from gpumesh_bench.peers.smg_gateway import SmgGateway, parse_smg
from gpumesh_bench.peers.smg_report import markdown
from gpumesh_bench.stats import SLO
from gpumesh_bench.workload import (
    LengthDist,
    WorkloadSpec,
    iter_requests,
    load_trace,
    save_trace,
)

REPO = REPO_ROOT
SMG = REPO / ".smg-venv" / "bin" / "smg"
DEFAULT_MODEL = REPO / "models" / "tiny"


# --- the comparison -----------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", default="hetero-eqkv", choices=("hetero-eqkv", "hetero-kvspeed"))
    p.add_argument("--workloads", default="bimodal,lognormal")
    p.add_argument("--loads", default="0.5,0.8,0.95", help="fractions of measured capacity")
    p.add_argument("--gpumesh", default="predicted_latency,least_request",
                   help="gpumesh router policies")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=POLICY[:FLAGS]",
                   help="an extra gpumesh router (compare-policies' syntax)")
    p.add_argument("--smg-policy", action="append", default=[],
                   metavar="NAME=POLICY[@INTERVAL][:FLAGS]",
                   help="an SMG gateway; INTERVAL = --load-monitor-interval s or 'scaled' "
                        "(10 s x time_scale); default: DEFAULT_SMG")
    p.add_argument("--once", default="smg-least_load-30s",
                   help="targets measured in the first repeat only (handicapped references)")
    p.add_argument("--time-scale", type=float, default=3.0)
    p.add_argument("--duration", type=float, default=4.0, help="seconds of arrivals per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--repeat-loads", default="0.8,0.95",
                   help="loads that get every repeat; the others run once (first repeat)")
    p.add_argument("--kv-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--cap-duration", type=float, default=8.0)
    p.add_argument("--capacity-from", default="", help="reuse capacities from an earlier run")
    p.add_argument("--slo-ttft-ms", type=float, default=100.0, help="SIMULATED ms (x time scale)")
    p.add_argument("--slo-tpot-ms", type=float, default=15.0, help="SIMULATED ms (x time scale)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="tokenizer folder (tiny model)")
    p.add_argument("--smg", default=str(SMG))
    p.add_argument("--out", default="bench-results/smg-fleet")


DEFAULT_SMG = ("smg-least_load=least_load@1", "smg-least_load-30s=least_load@scaled",
               # SMG's KV-pressure weight NOT time-scaled: 0.15 s wall = 0.05 s simulated,
               # the same KV penalty as gpumesh's default (router kv_penalty_s 0.05 s)
               "smg-least_load-kv0.15=least_load@1:--least-load-kv-pressure-weight 0.15",
               "smg-power_of_two=power_of_two@1", "smg-cache_aware=cache_aware@1")


def _git_head() -> str:
    import subprocess

    with contextlib.suppress(Exception):
        return subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %s"], check=False,
                              capture_output=True, text=True, timeout=10).stdout.strip()[:120]
    return ""


async def run(a: argparse.Namespace) -> dict[str, Any]:
    out = Path(a.out)
    ts = a.time_scale
    model = str(Path(a.model).resolve())
    prompts = BpePrompts(model)
    if not prompts.check(256):
        raise RuntimeError(f"{model}: word prompts do not round-trip through the tokenizer")
    mcfg = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    sim = {"max_num_seqs": a.max_num_seqs, "max_context_length": 4096, "model_name": model,
           "vocab_size": int(mcfg["vocab_size"]), "eos_token_id": int(mcfg["eos_token_id"])}
    nodes = hetero_nodes(HETERO_SPEEDS, a.kv_tokens, a.fleet == "hetero-kvspeed", sim)
    gm = [p for p in a.gpumesh.split(",") if p]
    routers = [RouterSpec(p, p) for p in gm] + parse_variants(a.variant)
    measured_routers = [r.name for r in routers]
    if "predicted_latency" not in measured_routers:  # the idle / capacity probe
        routers.append(RouterSpec("predicted_latency", "predicted_latency"))
    smg_specs = parse_smg(a.smg_policy or DEFAULT_SMG, ts)
    slo = SLO(a.slo_ttft_ms * ts, a.slo_tpot_ms * ts)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"args": vars(a), "capacity": {}, "runs": [], "smg": {},
                           "git_head": _git_head()}
    t_start = time.monotonic()
    with Fleet(nodes, routers=routers, time_scale=ts, model=model, log_dir=logs) as fleet:
        workers = [fleet.node_address(n.node_id) for n in nodes]
        url_node = {f"grpc://{fleet.node_address(n.node_id)}": n.node_id for n in nodes}
        gws = [SmgGateway(a.smg, s, workers, model, logs, ts) for s in smg_specs]
        try:
            for g in gws:
                g.wait_ready(90)
            for g in gws:
                doc["smg"][g.spec.name] = {"argv": g.argv, "policy": g.spec.policy,
                                           "load_monitor_interval_s": g.spec.interval_s}
            print(f"[smg-fleet] fleet + {len(routers)} routers + {len(gws)} SMG up in "
                  f"{time.monotonic() - t_start:.0f} s", file=sys.stderr, flush=True)
            targets: dict[str, tuple[Target, int]] = {}
            for name in measured_routers:
                targets[f"gpumesh-{name}"] = (
                    Target(f"gpumesh-{name}", "grpc", fleet.address(name)),
                    fleet.component(name).pid)
            for g in gws:
                targets[g.spec.name] = (Target(g.spec.name, "http", g.base, model, url_node),
                                        g.child.pid)
            hosts = {f"host{i}": c.pid for i, c in enumerate(fleet.hosts)}
            other_gw = {k: pid for k, (_, pid) in targets.items()}
            for wl in [w for w in a.workloads.split(",") if w]:
                await _workload(a, wl, fleet, targets, hosts, other_gw, prompts, slo, out, doc,
                                gws)
            doc["smg_load_source"] = {g.spec.name: sorted(set(g.load_versions().values()))
                                      for g in gws}
            doc["smg_overload_counters"] = {g.spec.name: g.overload_metrics() for g in gws}
        finally:
            stop_all([g.child for g in gws], 10.0)
    doc["wall_s"] = time.monotonic() - t_start
    return doc


async def _workload(a: argparse.Namespace, wl: str, fleet: Fleet,
                    targets: dict[str, tuple[Target, int]], hosts: dict[str, int],
                    gw_pids: dict[str, int], prompts: BpePrompts, slo: SLO, out: Path,
                    doc: dict[str, Any], gws: list[SmgGateway]) -> None:
    ts = a.time_scale
    prompt, output = (LengthDist.parse(x) for x in WORKLOADS[wl])
    key = f"{a.fleet}/{wl}"
    old = (json.loads(Path(a.capacity_from).read_text(encoding="utf-8")).get("capacity", {})
           if a.capacity_from else {})
    if key in old:
        info = old[key]
    else:
        conc = a.max_num_seqs * 8
        cfg = LoadConfig(target=fleet.address("predicted_latency"), concurrency=conc,
                         duration_s=a.cap_duration, timeout_s=300, progress_s=0,
                         label="capacity", seed=a.seed)
        t = Target("capacity", "grpc", fleet.address("predicted_latency"))
        run = await run_target(cfg, iter_requests(WorkloadSpec(prompt, output, a.seed + 1000)),
                               t, prompts)
        cap = closed_loop_throughput(run.results, a.cap_duration / 3, a.cap_duration)
        info = {"req_per_s": cap, "concurrency": conc, "duration_s": a.cap_duration,
                "via": "gpumesh predicted_latency router, token-id prompts"}
    cap = float(info["req_per_s"])
    doc["capacity"][key] = info
    print(f"[smg-fleet] {key}: capacity {cap:.1f} req/s", file=sys.stderr, flush=True)
    await fleet.wait_idle("predicted_latency")
    loads = [float(x) for x in a.loads.split(",") if x]
    n_max = math.ceil(max(loads) * cap * a.duration) + 1
    trace = out / f"trace-{a.fleet}-{wl}.jsonl"
    record_trace(prompt, output, a.seed, n_max, trace)
    names = list(targets)
    rep_loads = {float(x) for x in a.repeat_loads.split(",") if x}
    for rep in range(a.repeats):
        for li, load in enumerate(loads):
            if rep > 0 and rep_loads and load not in rep_loads:
                continue
            rate = load * cap
            n = math.ceil(rate * a.duration)
            reqs = load_trace(trace, "", 1.0 / rate)[:n]
            k = (rep * len(loads) + li) % len(names)
            for name in names[k:] + names[:k]:
                if rep > 0 and name in a.once.split(","):
                    continue
                idle = await fleet.wait_idle("predicted_latency")
                target, pid = targets[name]
                cfg = LoadConfig(target=target.address, rate=rate, num_requests=n,
                                 timeout_s=120, progress_s=0, label=name, seed=a.seed)
                watch = {"gateway": pid, **hosts,
                         **{f"idle:{k2}": p for k2, p in gw_pids.items() if k2 != name}}
                d = await measured(cfg, reqs, target, prompts, slo, watch,
                                   {"fleet": a.fleet, "workload": wl, "load": load,
                                    "repeat": rep, "capacity_req_s": cap, "time_scale": ts,
                                    "gateway": "smg" if target.kind == "http" else "gpumesh",
                                    "started_idle": idle})
                c = d["cpu"]
                d["cpu_summary"] = {
                    "gateway_pct": c["gateway"]["pct"], "loadgen_pct": c["loadgen"]["pct"],
                    "nodes_pct": sum(v["pct"] for k2, v in c.items() if k2.startswith("host")),
                    "idle_gateways_pct": sum(v["pct"] for k2, v in c.items()
                                             if k2.startswith("idle:")),
                    "machine_busy_cores": c["machine"]["busy_cores"]}
                s = d["summary"]
                print(f"[smg-fleet] {wl} load={load:.2f} rep={rep} {name:22s} "
                      f"ok={s['ok']}/{s['requests']} ttft p50={s['ttft_ms']['p50']:.0f} "
                      f"p99={s['ttft_ms']['p99']:.0f} good={100 * s['goodput_fraction']:.0f}% "
                      f"gw={c['gateway']['pct']:.0f}% lg={c['loadgen']['pct']:.0f}% "
                      f"nodes={d['cpu_summary']['nodes_pct']:.0f}% "
                      f"machine={c['machine']['busy_cores']:.2f} cores"
                      + (f" errs={d['sample_errors']}" if d["sample_errors"] else ""),
                      file=sys.stderr, flush=True)
                doc["runs"].append(d)
                write_json(out / "smg-fleet.json", doc)


def record_trace(prompt: LengthDist, output: LengthDist, seed: int, n: int, path: Path) -> int:
    """The run's trace: Poisson arrivals at 1 req/s (rescaled per load by ``load_trace``)."""
    reqs = iter_requests(WorkloadSpec(prompt, output, seed, "", 1.0))
    return save_trace((r for r, _ in zip(reqs, range(n))), path)


def main(a: argparse.Namespace) -> int:
    if not Path(a.smg).exists():
        print(f"[smg-fleet] SMG not found at {a.smg} (pip install smg==1.13.0 into .smg-venv)",
              file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {}
    try:
        doc = asyncio.run(run(a))
    finally:
        path = out / "smg-fleet.json"
        if not doc and path.exists():
            doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("runs"):
            write_json(path, doc)
            md = markdown(doc)
            (out / "smg-fleet.md").write_text(md, encoding="utf-8")
            print(md)
    print(f"[smg-fleet] done in {doc.get('wall_s', 0):.0f} s -> {out}", file=sys.stderr)
    return 0


def report_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpumesh_bench.peers.smg_fleet report")
    p.add_argument("files", nargs="+")
    a = p.parse_args(argv)
    docs, runs = [], []
    for item in a.files:  # FILE or FILE:WORKLOAD[,WORKLOAD] (only those workloads' runs)
        f, _, only = item.partition(":")
        d = json.loads(Path(f).read_text(encoding="utf-8"))
        keep = set(only.split(",")) if only else None
        runs += [r for r in d.get("runs", []) if keep is None or r["config"]["workload"] in keep]
        docs.append(d)
    caps = {k: v for d in reversed(docs) for k, v in d.get("capacity", {}).items()}
    merged = {**docs[0], "capacity": caps, "runs": runs}
    print(markdown(merged))
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["report"]:
        return report_main(args[1:])
    p = argparse.ArgumentParser(prog="python -m gpumesh_bench.peers.smg_fleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return main(p.parse_args(args))


if __name__ == "__main__":
    sys.exit(cli())
