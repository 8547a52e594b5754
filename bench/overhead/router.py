"""``gpumesh bench overhead``: what the router costs, against the same node reached directly.

Setup (``--pin``, the default): one simulated node at real H200 speed (time_scale 1) pinned to
core 1 with this load-generator process, each router pinned to core 0 (taskset). Every
measurement below is a closed loop of streamed requests, the direct and routed variants
interleaved, ``--repeats`` times; tables give medians. Router CPU is read from /proc (the
router's whole process group) before and after each run.

Parts (``--parts``, default all):
- ``direct``: direct vs through the router at ``--concurrency`` 8 and 32 (32-token streams):
  req/s ratio, added TTFT / latency p50 and p99, router CPU per request; ``short``: the
  router's max req/s with 1-token requests (closed loop, 64 in flight), and the CPU ceiling
  1 / (router CPU per request).
- ``modes``: per-token proxy vs coalesced proxy vs lookaside (``MeshClient(lookaside=True)``):
  router CPU per 32-token stream, streamed tokens/s per router core (= tokens / router CPU
  seconds), added TTFT and the inter-chunk gap vs direct.
- ``workers``: ``--workers 2`` vs 1 (unpinned, clients on 8 separate connections so
  SO_REUSEPORT spreads them), 1-token requests.
- ``tracing``: router req/s and CPU per request with tracing off, 100 % and 1 % sampling
  (OTLP to a local receiver).
- ``decision``: the routing decision alone per policy and fleet size (``decision``).
- ``tls``: router CPU per 32-token stream with TLS on every hop vs plaintext, side by side
  (``tls``).
- ``security`` (not in the default; needs ``--baseline-pkgs``): router CPU per 32-token
  stream with the hostile-peer checks against the same router without them, side by side
  (``security``).
- ``prefix`` (not in the default): the decision with prefix locality, the index holding
  ``--prefix-blocks`` entries, and the index's memory (``prefix_decision``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from gpumesh_bench import REPO_ROOT
from gpumesh_bench.fleet import Fleet, RouterSpec, SimNodeSpec, group_cpu_s
from gpumesh_bench.overhead import decision, prefix_decision
from gpumesh_bench.report import write_json
from gpumesh_bench.stats import percentile
from gpumesh_bench.workload import synth_prompt


@dataclass
class Sample:
    ttft: float
    latency: float
    tokens: int
    chunks: int
    gaps: list[float] = field(default_factory=list)


async def drive(target: str, *, concurrency: int, duration_s: float, max_tokens: int,
                prompt_tokens: int = 128, per_token: bool = False, lookaside: bool = False,
                connections: int = 1, seed: int = 0, tls: Any = None
                ) -> tuple[list[Sample], int, float]:
    """Closed loop through ``gpumesh.client.MeshClient``; returns (samples, errors, wall s).
    ``tls``: a ``gpumesh.security.client.ClientTls`` (None = plaintext)."""
    from gpumesh.client import MeshClient, build_request

    opts = [("grpc.use_local_subchannel_pool", 1)] if connections > 1 else []
    clients = [MeshClient(target, lookaside=lookaside, channel_options=opts, tls=tls)
               for _ in range(connections)]
    prompts = [synth_prompt(prompt_tokens, seed, i) for i in range(64)]
    samples: list[Sample] = []
    errors = 0
    counter = 0
    try:
        # warm the channels (and, in lookaside, the node channel)
        await asyncio.gather(*(_one(c, build_request(prompts[0], max_tokens=2, ignore_eos=True))
                               for c in clients))
        t0 = time.perf_counter()
        end = t0 + duration_s

        async def worker(k: int) -> None:
            nonlocal errors, counter
            c = clients[k % len(clients)]
            while time.perf_counter() < end:
                counter += 1
                req = build_request(prompts[counter % len(prompts)], max_tokens=max_tokens,
                                    ignore_eos=True, per_token=per_token)
                try:
                    samples.append(await _one(c, req))
                except Exception:  # noqa: BLE001 (counted)
                    errors += 1

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        wall = time.perf_counter() - t0
    finally:
        for c in clients:
            await c.close()
    return samples, errors, wall


async def _one(client: Any, req: Any) -> Sample:
    start = time.perf_counter()
    last = start
    ttft = None
    tokens = chunks = 0
    gaps: list[float] = []
    async for chunk in client.stream(req, timeout=60):
        now = time.perf_counter()
        n = len(chunk.token_ids)
        if n:
            if ttft is None:
                ttft = now - start
            else:
                gaps.append(now - last)
            last = now
            tokens += n
            chunks += 1
    end = time.perf_counter()
    return Sample(ttft if ttft is not None else end - start, end - start, tokens, chunks, gaps)


def summarize(samples: list[Sample], errors: int, wall: float, cpu_s: float) -> dict[str, Any]:
    n = max(1, len(samples))
    ttft = [s.ttft * 1000 for s in samples]
    lat = [s.latency * 1000 for s in samples]
    gaps = [g * 1000 for s in samples for g in s.gaps]
    tokens = sum(s.tokens for s in samples)
    return {
        "requests": len(samples), "errors": errors, "wall_s": wall,
        "req_per_s": len(samples) / wall, "tok_per_s": tokens / wall,
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
        "lat_p50_ms": percentile(lat, 50), "lat_p99_ms": percentile(lat, 99),
        "gap_p50_ms": percentile(gaps, 50), "gap_p99_ms": percentile(gaps, 99),
        "chunks_per_req": sum(s.chunks for s in samples) / n,
        "router_cpu_s": cpu_s, "router_cpu_pct": 100 * cpu_s / wall,
        "router_cpu_ms_per_req": 1000 * cpu_s / n,
        "tokens_per_router_cpu_s": tokens / cpu_s if cpu_s > 0 else float("nan"),
    }


async def measure(fleet: Fleet, target_name: str, **kw: Any) -> dict[str, Any]:
    """One closed-loop run against a router (by name) or the node ("direct")."""
    if target_name == "direct":
        target, pgid = fleet.node_address(fleet.nodes[0].node_id), None
    else:
        target, pgid = fleet.address(target_name), fleet.routers[target_name].pid
    lookaside = kw.pop("lookaside", False)
    c0 = group_cpu_s(pgid) if pgid else 0.0
    samples, errors, wall = await drive(target, lookaside=lookaside, **kw)
    c1 = group_cpu_s(pgid) if pgid else 0.0
    return summarize(samples, errors, wall, c1 - c0)


def _med(rows: list[dict[str, Any]], key: str) -> float:
    xs = [r[key] for r in rows if not math.isnan(r.get(key, math.nan))]
    return percentile(xs, 50) if xs else float("nan")


def medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {k: _med(rows, k) for k in rows[0] if isinstance(rows[0][k], (int, float))}


async def _interleave(fleet: Fleet, variants: dict[str, dict[str, Any]], repeats: int,
                      log_prefix: str) -> dict[str, dict[str, float]]:
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
    names = list(variants)
    for rep in range(repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            kw = dict(variants[name])
            target = kw.pop("target")
            r = await measure(fleet, target, **kw)
            runs[name].append(r)
            print(f"[overhead] {log_prefix} {name:24s} rep={rep} {r['req_per_s']:7.1f} req/s "
                  f"ttft p50={r['ttft_p50_ms']:.1f} p99={r['ttft_p99_ms']:.1f} "
                  f"router cpu={r['router_cpu_pct']:.0f}% {r['router_cpu_ms_per_req']:.2f} ms/req",
                  file=sys.stderr, flush=True)
    return {k: {**medians(v), "runs": len(v)} for k, v in runs.items()}


def _pin_self(cpus: set[int]) -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, cpus)


async def part_direct(fleet: Fleet, a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in (8, 32):
        v = {"direct": {"target": "direct"}, "router": {"target": "proxy"}}
        for kw in v.values():
            kw.update(concurrency=c, duration_s=a.duration, max_tokens=32)
        out[f"c{c}"] = await _interleave(fleet, v, a.repeats, f"c={c}")
    v = {"direct": {"target": "direct"}, "router": {"target": "proxy"}}
    for kw in v.values():
        kw.update(concurrency=64, duration_s=a.duration, max_tokens=1, prompt_tokens=16)
    out["short"] = await _interleave(fleet, v, a.repeats, "short")
    return out


async def part_modes(fleet: Fleet, a: argparse.Namespace) -> dict[str, Any]:
    base = {"concurrency": 32, "duration_s": a.duration, "max_tokens": 32}
    v = {"direct (coalesced)": {"target": "direct", **base},
         "direct (per-token)": {"target": "direct", "per_token": True, **base},
         "proxy per-token": {"target": "proxy", "per_token": True, **base},
         "proxy coalesced": {"target": "proxy", **base},
         "lookaside": {"target": "proxy", "lookaside": True, **base}}
    return await _interleave(fleet, v, a.repeats, "modes")


async def part_workers(fleet: Fleet, a: argparse.Namespace) -> dict[str, Any]:
    base = {"concurrency": 64, "duration_s": a.duration, "max_tokens": 1, "prompt_tokens": 16,
            "connections": 8}
    v = {"workers=1": {"target": "w1", **base}, "workers=2": {"target": "w2", **base}}
    return await _interleave(fleet, v, a.repeats, "workers")


async def part_tracing(fleet: Fleet, a: argparse.Namespace) -> dict[str, Any]:
    base = {"concurrency": 32, "duration_s": a.duration, "max_tokens": 8}
    v = {"tracing off": {"target": "proxy", **base}, "tracing 100%": {"target": "trace100", **base},
         "tracing 1%": {"target": "trace1", **base}}
    return await _interleave(fleet, v, a.repeats, "tracing")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", default="direct,modes,workers,tracing,decision,tls")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-pin", action="store_true", help="do not taskset router / node")
    p.add_argument("--decision-sizes", default="16,64,256,1024,4096")
    p.add_argument("--decision-iters", type=int, default=3000)
    p.add_argument("--prefix-blocks", type=int, default=1_000_000,
                   help="part prefix: (node, block) entries in the prefix index")
    p.add_argument("--baseline-pkgs", default="",
                   help="part security: a folder with the gpumesh package to compare against")
    p.add_argument("--out", default="bench-results/overhead")


def main(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = [p for p in a.parts.split(",") if p]
    result: dict[str, Any] = {"args": vars(a)}
    pin = not a.no_pin and (os.cpu_count() or 1) >= 2
    node = [SimNodeSpec("sim0", 1.0)]
    secret = {"GPUMESH_TICKET_SECRET": "bench-secret-not-for-production"}
    os.environ.update(secret)
    try:
        if {"direct", "modes"} & set(parts):
            if pin:
                _pin_self({1})
            with Fleet(node, routers=[RouterSpec("proxy", "least_request", cpus="0" if pin else "")],
                       time_scale=1.0, node_cpus="1" if pin else "",
                       log_dir=out / "logs" / "pinned") as fleet:
                if "direct" in parts:
                    result["direct"] = asyncio.run(part_direct(fleet, a))
                if "modes" in parts:
                    result["modes"] = asyncio.run(part_modes(fleet, a))
            write_json(out / "overhead.json", result)
        _pin_self(set(range(os.cpu_count() or 1)))
        if "workers" in parts:
            with Fleet(node, routers=[RouterSpec("w1", "least_request"),
                                      RouterSpec("w2", "least_request", workers=2)],
                       time_scale=1.0, log_dir=out / "logs" / "workers") as fleet:
                result["workers"] = asyncio.run(part_workers(fleet, a))
            write_json(out / "overhead.json", result)
        if "tracing" in parts:
            result["tracing"] = _tracing(node, a, out, pin)
            write_json(out / "overhead.json", result)
        for part in ("tls", "security"):
            if part in parts:
                if pin:
                    _pin_self({1})
                result[part] = _side_by_side(part).run(a, out, pin)
                _pin_self(set(range(os.cpu_count() or 1)))
                write_json(out / "overhead.json", result)
        if "decision" in parts:
            sizes = [int(x) for x in a.decision_sizes.split(",") if x]
            result["decision"] = decision.run(sizes, a.decision_iters)
            print(decision.markdown(result["decision"]))
        if "prefix" in parts:
            sizes = [int(x) for x in a.decision_sizes.split(",") if x]
            result["prefix"] = prefix_decision.run(sizes, a.decision_iters,
                                                   blocks=a.prefix_blocks)
            print(prefix_decision.markdown(result["prefix"]))
    finally:
        write_json(out / "overhead.json", result)
        (out / "overhead.md").write_text(markdown(result), encoding="utf-8")
        print(markdown(result))
    return 0


def _side_by_side(part: str) -> ModuleType:
    """The module of a part that runs two meshes side by side (``run`` and ``markdown``)."""
    from gpumesh_bench.overhead import security, tls

    return {"tls": tls, "security": security}[part]


def _tracing(node: list[SimNodeSpec], a: argparse.Namespace, out: Path, pin: bool) -> dict[str, Any]:
    sys.path.insert(0, str(REPO_ROOT))
    from tests.tracing.otlp_receiver import Receiver

    rx = Receiver().start()
    try:
        ep = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint, "OTEL_METRICS_EXPORTER": "none"}
        ratio = {**ep, "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                 "OTEL_TRACES_SAMPLER_ARG": "0.01"}
        cpus = "0" if pin else ""
        if pin:
            _pin_self({1})
        with Fleet(node, routers=[RouterSpec("proxy", "least_request", cpus=cpus),
                                  RouterSpec("trace100", "least_request", cpus=cpus, env=ep),
                                  RouterSpec("trace1", "least_request", cpus=cpus, env=ratio)],
                   time_scale=1.0, node_cpus="1" if pin else "",
                   log_dir=out / "logs" / "tracing") as fleet:
            return asyncio.run(part_tracing(fleet, a))
    finally:
        rx.stop()
        _pin_self(set(range(os.cpu_count() or 1)))


def _f(x: Any, d: int = 1) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:,.{d}f}"


def markdown(r: dict[str, Any]) -> str:
    lines: list[str] = []
    if "direct" in r:
        head = ("| load | req/s direct | req/s router | ratio | TTFT p50 added ms | "
                "TTFT p99 added ms | latency p50 added ms | latency p99 added ms | "
                "router CPU ms/req | router CPU % |")
        lines += ["### Router vs direct (one sim node, router pinned to core 0)", "", head,
                  "|" + "---|" * 10]
        for k, v in r["direct"].items():
            d, t = v["direct"], v["router"]
            lines.append(
                f"| {k} | {_f(d['req_per_s'])} | {_f(t['req_per_s'])} | "
                f"{t['req_per_s'] / d['req_per_s']:.3f} | {_f(t['ttft_p50_ms'] - d['ttft_p50_ms'], 2)} | "
                f"{_f(t['ttft_p99_ms'] - d['ttft_p99_ms'], 2)} | {_f(t['lat_p50_ms'] - d['lat_p50_ms'], 2)} | "
                f"{_f(t['lat_p99_ms'] - d['lat_p99_ms'], 2)} | {_f(t['router_cpu_ms_per_req'], 3)} | "
                f"{_f(t['router_cpu_pct'], 0)} |")
        lines.append("")
    if "modes" in r:
        m = r["modes"]
        head = ("| mode | req/s | router CPU ms per 32-token stream | tokens/s per router core "
                "| chunks/stream | TTFT p50 ms | TTFT p99 ms | gap p50 ms | gap p99 ms |")
        lines += ["### Streaming modes (32-token streams, 32 in flight)", "", head, "|" + "---|" * 9]
        for k, v in m.items():
            lines.append(f"| {k} | {_f(v['req_per_s'])} | {_f(v['router_cpu_ms_per_req'], 3)} | "
                         f"{_f(v['tokens_per_router_cpu_s'], 0)} | {_f(v['chunks_per_req'])} | "
                         f"{_f(v['ttft_p50_ms'], 2)} | {_f(v['ttft_p99_ms'], 2)} | "
                         f"{_f(v['gap_p50_ms'], 2)} | {_f(v['gap_p99_ms'], 2)} |")
        lines.append("")
    for key, title in (("workers", "Router workers (1-token requests, 64 in flight, 8 connections)"),
                       ("tracing", "Tracing overhead (8-token streams, 32 in flight)")):
        if key in r:
            head = ("| variant | req/s | router CPU ms/req | router CPU % | TTFT p50 ms | "
                    "TTFT p99 ms |")
            lines += [f"### {title}", "", head, "|" + "---|" * 6]
            for k, v in r[key].items():
                lines.append(f"| {k} | {_f(v['req_per_s'])} | {_f(v['router_cpu_ms_per_req'], 3)} | "
                             f"{_f(v['router_cpu_pct'], 0)} | {_f(v['ttft_p50_ms'], 2)} | "
                             f"{_f(v['ttft_p99_ms'], 2)} |")
            lines.append("")
    for part in ("tls", "security"):
        if part in r:
            lines.append(_side_by_side(part).markdown(r[part]))
    if "decision" in r:
        lines += ["### Routing decision time", "", decision.markdown(r["decision"])]
    if "prefix" in r:
        lines += ["### Routing decision time with a prefix index", "",
                  prefix_decision.markdown(r["prefix"])]
    return "\n".join(lines) + "\n"
