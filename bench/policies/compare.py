"""``gpumesh bench compare-policies``: every policy on the same fleet and the same trace.

For each fleet (``hetero-eqkv``: speeds 1,1,1,1,2,2,0.5,0.5 with equal KV capacity;
``hetero-kvspeed``: the same speeds, KV capacity proportional to speed; ``homo``: 8 x speed 1)
one Fleet runs a router per gpumesh policy (every node heartbeats to each) and nginx
``least_conn`` in front of the same nodes. For each workload:

1. capacity: a closed-loop saturation run through the ``predicted_latency`` router
   (concurrency = ``max_num_seqs`` x nodes, so every node has a full batch and a queue),
   completions/s after a warm-up;
2. one Poisson trace is recorded (``trace-<fleet>-<workload>.jsonl``) at unit rate and
   replayed, rescaled, for every (load, policy): the same requests, lengths and relative
   arrival times for everyone;
3. runs: for each repeat and load, the policies in an order rotated per repeat (interleaved),
   each an open-loop run of ``duration`` seconds of arrivals at load x capacity, after the
   fleet is idle. Router / nginx / node CPU is measured per run from /proc.

Results: ``OUT/compare.json`` (every run), ``OUT/compare.md`` (tables of medians over repeats
with ratios to least_request and nginx), ``OUT/<fleet>-<workload>.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from gpumesh_bench.fleet import Fleet, RouterSpec, SimNodeSpec, hetero_nodes
from gpumesh_bench.harness import measure_capacity, measured_run, median, share_medians
from gpumesh_bench.loadgen import LoadConfig
from gpumesh_bench.report import write_json
from gpumesh_bench.stats import SLO
from gpumesh_bench.workload import (
    LengthDist,
    WorkloadSpec,
    iter_requests,
    load_trace,
    save_trace,
)

POLICIES = ("round_robin", "least_request", "power_of_two", "predicted_latency", "nginx")
HETERO_SPEEDS = (1, 1, 1, 1, 2, 2, 0.5, 0.5)
WORKLOADS = {
    # chat-like lognormal: median 256 prompt tokens (tail to 3072), median 48 output (to 384)
    "lognormal": ("lognormal:256:1.0:3072", "lognormal:48:0.8:384"),
    # 85 % chat turns (~128 in / ~48 out), 15 % long documents (~3072 in / ~128 out)
    "bimodal": ("bimodal:128:3072:0.15", "bimodal:48:128:0.15"),
}


def fleet_nodes(name: str, kv_tokens: int, sim: dict[str, Any]) -> list[SimNodeSpec]:
    if name == "hetero-eqkv":
        return hetero_nodes(HETERO_SPEEDS, kv_tokens, False, sim)
    if name == "hetero-kvspeed":
        return hetero_nodes(HETERO_SPEEDS, kv_tokens, True, sim)
    if name == "homo":
        return hetero_nodes([1] * 8, kv_tokens, False, sim)
    raise ValueError(f"unknown fleet {name!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleets", default="hetero-eqkv,hetero-kvspeed,homo")
    p.add_argument("--workloads", default="lognormal,bimodal")
    p.add_argument("--loads", default="0.5,0.8,0.95", help="fractions of measured capacity")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--time-scale", type=float, default=5.0,
                   help="sim slow-down (wall s per simulated s)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds of arrivals per run")
    p.add_argument("--repeats", type=int, default=1, help="interleaved repeats (medians)")
    p.add_argument("--kv-tokens", type=int, default=8192, help="KV capacity of a speed-1 node")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--cap-duration", type=float, default=8.0)
    p.add_argument("--slo-ttft-ms", type=float, default=100.0, help="SIMULATED ms (x time scale)")
    p.add_argument("--slo-tpot-ms", type=float, default=15.0, help="SIMULATED ms (x time scale)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=POLICY[:FLAGS]",
                   help="an extra router, e.g. 'ttft=predicted_latency:--routing objective=min_ttft'"
                        " (FLAGS are `gpumesh router` flags, in wall-clock units)")
    p.add_argument("--capacity-from", default="",
                   help="reuse the capacities measured by an earlier compare.json (same fleets)")
    p.add_argument("--out", default="bench-results/compare")


def parse_variants(items: list[str]) -> list[RouterSpec]:
    out = []
    for it in items:
        name, _, rest = it.partition("=")
        policy, _, flags = rest.partition(":")
        out.append(RouterSpec(name, policy, flags=tuple(flags.split())))
    return out


async def _run_fleet(a: argparse.Namespace, fleet_name: str, out: Path,
                     runs: list[dict[str, Any]], caps: dict[str, Any]) -> None:
    ts = a.time_scale
    policies = [p for p in a.policies.split(",") if p]
    sim = {"max_num_seqs": a.max_num_seqs, "max_context_length": 4096}
    nodes = fleet_nodes(fleet_name, a.kv_tokens, sim)
    variants = parse_variants(a.variant)
    routers = [RouterSpec(p, p) for p in policies if p != "nginx"] + variants
    policies = policies + [v.name for v in variants]
    if "predicted_latency" not in policies:
        routers.append(RouterSpec("predicted_latency", "predicted_latency"))
    slo = SLO(a.slo_ttft_ms * ts, a.slo_tpot_ms * ts)
    with Fleet(nodes, routers=routers, nginx="nginx" in policies, time_scale=ts,
               log_dir=out / "logs" / fleet_name) as fleet:
        watch_nodes = {f"host{i}": c.pid for i, c in enumerate(fleet.hosts)}
        for wl in [w for w in a.workloads.split(",") if w]:
            prompt, output = (LengthDist.parse(x) for x in WORKLOADS[wl])
            spec = WorkloadSpec(prompt, output, a.seed, "", 1.0)
            conc = a.max_num_seqs * len(nodes)
            old = load_runs(a.capacity_from)[1] if a.capacity_from else {}
            if f"{fleet_name}/{wl}" in old:
                info = old[f"{fleet_name}/{wl}"]
                cap = float(info["req_per_s"])
            else:
                cap, info = await measure_capacity(
                    fleet.address("predicted_latency"),
                    iter_requests(WorkloadSpec(prompt, output, a.seed + 1000)),
                    conc, a.cap_duration, a.cap_duration / 3)
            caps[f"{fleet_name}/{wl}"] = info
            print(f"[compare] {fleet_name}/{wl}: capacity {cap:.1f} req/s "
                  f"(closed loop c={conc})", file=sys.stderr, flush=True)
            await fleet.wait_idle("predicted_latency")
            loads = [float(x) for x in a.loads.split(",") if x]
            n_max = math.ceil(max(loads) * cap * a.duration) + 1
            trace = out / f"trace-{fleet_name}-{wl}.jsonl"
            save_trace((r for r, _ in zip(iter_requests(spec), range(n_max))), trace)
            for rep in range(a.repeats):
                for li, load in enumerate(loads):
                    rate = load * cap
                    n = math.ceil(rate * a.duration)
                    reqs = load_trace(trace, "", 1.0 / rate)[:n]
                    k = (rep + li) % len(policies)
                    for pol in policies[k:] + policies[:k]:
                        await fleet.wait_idle("predicted_latency")
                        comp = fleet.component(pol)
                        cfg = LoadConfig(target=fleet.address(pol), rate=rate, num_requests=n,
                                         timeout_s=120, progress_s=0, label=pol, seed=a.seed)
                        doc = await measured_run(
                            cfg, reqs, slo, {"proxy": comp.pid, **watch_nodes},
                            {"fleet": fleet_name, "workload": wl, "load": load, "repeat": rep,
                             "capacity_req_s": cap, "time_scale": ts,
                             "prompt": str(prompt), "output": str(output)})
                        s = doc["summary"]
                        print(f"[compare] {fleet_name}/{wl} load={load:.2f} rep={rep} {pol:20s} "
                              f"ok={s['ok']}/{s['requests']} ttft p50={s['ttft_ms']['p50']:.0f} "
                              f"p99={s['ttft_ms']['p99']:.0f} lat p99={s['latency_ms']['p99']:.0f}"
                              f" good={100 * s['goodput_fraction']:.0f}% "
                              f"proxy cpu={doc['cpu']['proxy']['pct']:.0f}%",
                              file=sys.stderr, flush=True)
                        runs.append(doc)
                        write_json(out / "compare.json", {"capacity": caps, "runs": runs})


def _get(d: dict[str, Any], path: str) -> float:
    for k in path.split("."):
        d = d.get(k) if isinstance(d, dict) else None  # type: ignore[assignment]
    return float("nan") if d is None else float(d)  # type: ignore[arg-type]


METRICS = (("ttft_p50", "summary.ttft_ms.p50"), ("ttft_p99", "summary.ttft_ms.p99"),
           ("lat_p99", "summary.latency_ms.p99"), ("goodput", "summary.goodput_fraction"),
           ("good_rps", "summary.goodput_req_per_s"), ("proxy_cpu", "cpu.proxy.pct"),
           ("errors", "summary.requests"))


def aggregate(runs: list[dict[str, Any]]) -> dict[tuple[str, str, float, str], dict[str, Any]]:
    """Medians over repeats per (fleet, workload, load, policy), plus the median node share."""
    groups: dict[tuple[str, str, float, str], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        c = r["config"]
        groups[(c["fleet"], c["workload"], float(c["load"]), c["label"])].append(r)
    out = {}
    for key, rs in groups.items():
        row = {m: median([_get(r, p) for r in rs]) for m, p in METRICS}
        row["errors"] = sum(r["summary"]["requests"] - r["summary"]["ok"] for r in rs)
        row["n"] = len(rs)
        row["share"] = share_medians(rs)
        row["rate"] = rs[0]["config"]["rate"]
        out[key] = row
    return out


def _ratio(a: float, b: float) -> str:
    return "-" if not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}"


def markdown(runs: list[dict[str, Any]], caps: dict[str, Any], ts: float) -> str:
    agg = aggregate(runs)
    lines: list[str] = []
    for fw in sorted({(k[0], k[1]) for k in agg}):
        cap = caps.get(f"{fw[0]}/{fw[1]}", {})
        lines.append(f"\n#### {fw[0]} / {fw[1]} (capacity {cap.get('req_per_s', 0):.1f} req/s "
                     f"wall at time_scale {ts:g})\n")
        lines.append("| load | policy | TTFT p50 ms | TTFT p99 ms | lat p99 ms | goodput % | "
                     "p99 TTFT / least_request | p99 TTFT / nginx | p50 TTFT / least_request | "
                     "proxy CPU % | errors | node share |")
        lines.append("|" + "---|" * 12)
        for load in sorted({k[2] for k in agg if k[:2] == fw}):
            rows = {k[3]: v for k, v in agg.items() if k[:3] == (*fw, load)}
            lr, ng = rows.get("least_request", {}), rows.get("nginx", {})
            for pol in [p for p in POLICIES if p in rows] + sorted(set(rows) - set(POLICIES)):
                r = rows[pol]
                share = " ".join(f"{k}:{v:.0%}" for k, v in r["share"].items())
                lines.append(
                    f"| {load:.0%} | {pol} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | "
                    f"{r['lat_p99']:.0f} | {100 * r['goodput']:.0f} | "
                    f"{_ratio(r['ttft_p99'], lr.get('ttft_p99', math.nan))} | "
                    f"{_ratio(r['ttft_p99'], ng.get('ttft_p99', math.nan))} | "
                    f"{_ratio(r['ttft_p50'], lr.get('ttft_p50', math.nan))} | "
                    f"{r['proxy_cpu']:.0f} | {r['errors']} | {share} |")
    return "\n".join(lines) + "\n"


def plots(runs: list[dict[str, Any]], out: Path) -> list[Path]:
    from gpumesh_bench.report import plot

    made = []
    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        by[(r["config"]["fleet"], r["config"]["workload"])].append(r)
    for (f, w), rs in by.items():
        made.append(plot(rs, out / f"{f}-{w}.png", f"{f} / {w}"))
    return made


def main(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    caps: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        for f in [x for x in a.fleets.split(",") if x]:
            asyncio.run(_run_fleet(a, f, out, runs, caps))
    finally:
        if runs:
            write_json(out / "compare.json", {"capacity": caps, "runs": runs,
                                              "args": vars(a), "wall_s": time.monotonic() - t0})
            md = markdown(runs, caps, a.time_scale)
            (out / "compare.md").write_text(md, encoding="utf-8")
            print(md)
            try:
                plots(runs, out)
            except Exception as exc:  # noqa: BLE001 (plotting is a convenience)
                print(f"[compare] plots failed: {exc}", file=sys.stderr)
    print(f"[compare] done in {time.monotonic() - t0:.0f} s -> {out}", file=sys.stderr)
    return 0


def load_runs(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    return doc["runs"], doc.get("capacity", {})


def report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+")
    p.add_argument("--md", default="")


def report(a: argparse.Namespace) -> int:
    """Medians over the runs of several compare.json files (e.g. extra repeats at one load)."""
    runs: list[dict[str, Any]] = []
    caps: dict[str, Any] = {}
    ts = 0.0
    for f in a.files:
        r, c = load_runs(f)
        runs += r
        caps.update({k: v for k, v in c.items() if k not in caps})
        ts = ts or float(r[0]["config"].get("time_scale", 0)) if r else ts
    md = markdown(runs, caps, ts)
    if a.md:
        Path(a.md).write_text(md, encoding="utf-8")
    print(md)
    return 0
