"""``gpumesh bench prefix``: cache-aware routing on a live simulated fleet.

One ``Fleet`` of simulated nodes (``--nodes``, the 7B shape, per-node KV ``--kv-tokens``:
about a quarter of all tenants' system prompts) with one router per setup, every node
heartbeating and streaming its KV block events to each:

- ``least_request``: fewest in flight;
- ``wll``: predicted_latency without locality (``--prefix-locality off``);
- ``approximate``: predicted_latency, the router's own record of where it sent prefixes;
- ``precise``: predicted_latency, the nodes' KV events;
- ``affinity``: predicted_latency without locality, session affinity on the conversation id
  (the others run with ``--affinity-max-keys 0``: no routing-key table);
- ``--smg NAME=POLICY,...``: SMG gateways (``smg launch``, 1.13.0) in front of the same nodes'
  ``VllmEngine`` service, reached over OpenAI HTTP ``/v1/completions`` (SSE). SMG's
  ``cache_aware`` runs in its event-driven (exact) mode here: the nodes stream their KV block
  events on ``SubscribeKvEvents`` and SMG subscribes to every gRPC worker's stream.

With ``--model DIR`` (required with ``--smg``) the nodes emit ids of DIR's tokenizer and every
path sends the same token ids: gpumesh routers get the prompt's ids (``token_ids``), SMG gets
the text and tokenizes it back to the same ids (checked against the SSE usage).

Workload (``gpumesh_bench.tenants``): ``--tenants`` tenants with ~4,000-token system prompts,
multi-turn conversations; ``--unique`` the control with no shared prefix. Load is relative to
the fleet's nominal capacity without prefix reuse (each node's full-budget prefill rate over
the mean prompt length: what no cache at all allows). For each load the same Poisson trace is
replayed through every setup (order rotated per load; ``--smg-first``: the SMG doors first);
requests that start in the first
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
from gpumesh.launcher import stop_all
from gpumesh_bench.fleet import Fleet, RouterSpec, SimNodeSpec
from gpumesh_bench.loadgen import BenchRequest, LoadConfig, RequestResult, drive, send_message
from gpumesh_bench.peers.smg_clients import stream_completion
from gpumesh_bench.peers.smg_gateway import SmgGateway, SmgSpec
from gpumesh_bench.stats import percentile
from gpumesh_bench.tenants import TenantRequest, TenantSpec, trace

SETUPS: dict[str, tuple[str, ...]] = {
    "least_request": ("--policy", "least_request", "--locality.prefix-locality", "off"),
    "wll": ("--locality.prefix-locality", "off", "--locality.affinity-max-keys", "0"),
    "approximate": ("--locality.prefix-locality", "approximate",
                    "--locality.affinity-max-keys", "0"),
    "precise": ("--locality.prefix-locality", "precise", "--locality.affinity-max-keys", "0"),
    "affinity": ("--locality.prefix-locality", "off"),
}
SHAPE_7B = {"step_a_ms": 4.74, "step_b_decode_ms": 0.0109, "step_b_prefill_ms": 0.0241}


def nominal_capacity(nodes: int, mean_prompt_tokens: float, budget: int = 16384) -> float:
    """Requests per simulated second the fleet prefills with no prefix reuse at all."""
    step_ms = SHAPE_7B["step_a_ms"] + SHAPE_7B["step_b_prefill_ms"] * budget
    return nodes * budget / (step_ms / 1000) / mean_prompt_tokens


async def http_send(session: Any, base: str, model: str, text: str, n_ids: int,
                    worker_nodes: dict[str, str], r: BenchRequest, cfg: LoadConfig,
                    t0: float) -> RequestResult:
    """One streamed ``/v1/completions`` request through SMG (``stream_completion``); an error
    when SMG's prompt token count is not the ``n_ids`` the gpumesh paths send."""
    body = {"model": model, "prompt": text, "max_tokens": r.max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = await stream_completion(session, base, body, worker_nodes, r, cfg, t0)
    if res.status == "OK" and res.prompt_tokens != n_ids:
        res.status, res.error = "PROMPT_MISMATCH", f"prompt_tokens {res.prompt_tokens} != {n_ids}"
    return res


async def run_one(target: str, reqs: list[TenantRequest], time_scale: float, warmup_s: float,
                  label: str, ids: dict[int, list[int]] | None = None, model: str = "sim",
                  smg: tuple[str, dict[str, str]] | None = None) -> dict[str, Any]:
    """Replays ``reqs`` (arrivals in simulated seconds) against ``target`` (a gpumesh router),
    or against SMG when ``smg`` = (base URL, worker URL -> node id); ``ids``: each request's
    token ids (sent instead of the text to gpumesh routers)."""
    keys = {r.index: r.conversation for r in reqs}
    bench = [BenchRequest(r.index, r.arrival_s * time_scale, len(r.prompt) // 4, r.max_tokens,
                          r.prompt, model) for r in reqs]
    cfg = LoadConfig(target=target, rate=1.0, num_requests=len(bench), timeout_s=600,
                     progress_s=0, label=label)
    if smg is not None:
        import aiohttp

        text = {r.index: r.prompt for r in reqs}
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as session:
            run = await drive(cfg, bench, lambda b, t0: http_send(
                session, smg[0], model, text[b.index], len(ids[b.index]) if ids else 0,
                smg[1], b, cfg, t0))
    else:
        msgs = {}
        for r in reqs:
            m = pb.GenerateRequest(model=model, routing_key=keys[r.index],
                                   request_id=f"{label}-{r.index}")
            if ids:
                m.token_ids.ids.extend(ids[r.index])
            else:
                m.text = r.prompt
            m.sampling.max_tokens = r.max_tokens
            m.sampling.ignore_eos = True
            msgs[r.index] = m
        async with grpc.aio.insecure_channel(
                target, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
            stub = pb_grpc.InferenceStub(ch)
            await asyncio.wait_for(ch.channel_ready(), timeout=30)
            run = await drive(cfg, bench,
                              lambda b, t0: send_message(stub, msgs[b.index], b, cfg, t0))
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
            "nodes": sorted({x.node_id for x in ok}),
            "ttft_all_s": [round(x, 5) for x in ttft],
            "error_samples": sorted({f"{x.status}: {x.error}" for x in kept
                                     if x.status != "OK"})[:5]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench/locality/results")
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
    p.add_argument("--model", default="",
                   help="model folder whose tokenizer every path uses (required with --smg)")
    p.add_argument("--smg", default="", help="SMG doors: NAME=POLICY[,NAME=POLICY...]")
    p.add_argument("--smg-exe", default=".smg-venv/bin/smg")
    p.add_argument("--smg-first", action="store_true",
                   help="run the SMG doors first at every load (with one load per call: on "
                        "a fleet with cold caches, as a simulator replay starts)")


def _model_sim(model: str) -> dict[str, Any]:
    """SimEngineConfig fields for nodes that emit ids of ``model``'s tokenizer."""
    cfg = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    return {"model_name": model, "vocab_size": int(cfg["vocab_size"]),
            "eos_token_id": int(cfg["eos_token_id"]), "max_context_length": 32_768}


def main(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    setups = [s for s in a.setups.split(",") if s]
    smg_doors = [x.split("=", 1) for x in a.smg.split(",") if x]
    if smg_doors and not a.model:
        raise SystemExit("--smg needs --model (SMG tokenizes with the model's tokenizer)")
    model = str(Path(a.model).resolve()) if a.model else "sim"
    tok = None
    if a.model:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    loads = [float(x) for x in a.loads.split(",") if x]
    probe = trace(TenantSpec(tenants=a.tenants, rate=10.0, seed=a.seed, unique=a.unique), 20.0)
    if tok is not None:
        mean_tokens = sum(len(tok.encode(r.prompt).ids) for r in probe) / len(probe)
    else:
        mean_tokens = sum(len(r.prompt) for r in probe) / len(probe) / 4.6  # chars/sim token
    cap = nominal_capacity(a.nodes, mean_tokens)
    extra = _model_sim(model) if a.model else {}
    nodes = [SimNodeSpec(f"n{i:02d}", 1.0, a.kv_tokens, sim={**SHAPE_7B, **extra})
             for i in range(a.nodes)]
    routers = [RouterSpec(s, flags=SETUPS[s]) for s in setups]
    doc: dict[str, Any] = {"args": vars(a), "nominal_capacity_req_per_s": cap,
                           "mean_prompt_tokens": mean_tokens, "runs": [], "smg": {}}
    os.environ.setdefault("GPUMESH_TICKET_SECRET", "bench-secret-not-for-production")
    doors = setups + [name for name, _ in smg_doors]
    with Fleet(nodes, routers=routers, time_scale=a.time_scale, model=model,
               log_dir=out / "logs") as fleet:
        workers = [fleet.node_address(n.node_id) for n in nodes]
        url_node = {f"grpc://{w}": n.node_id for w, n in zip(workers, nodes, strict=True)}
        gws = {name: SmgGateway(a.smg_exe, SmgSpec(name, policy,
                                                   max(1, round(10 * a.time_scale))),
                                workers, model, out / "logs", a.time_scale)
               for name, policy in smg_doors}
        try:
            for name, g in gws.items():
                g.wait_ready(120)
                doc["smg"][name] = {"argv": g.argv}
            for k, load in enumerate(loads):
                spec = TenantSpec(tenants=a.tenants, rate=load * cap, seed=a.seed + k,
                                  unique=a.unique)
                reqs = trace(spec, a.duration)
                ids = ({r.index: tok.encode(r.prompt).ids for r in reqs}
                       if tok is not None else None)
                order = doors[k % len(doors):] + doors[:k % len(doors)]
                if a.smg_first:
                    order = [d for d in order if d in gws] + [d for d in order if d not in gws]
                for s in order:
                    asyncio.run(fleet.wait_idle(setups[0], 120))
                    t = time.perf_counter()
                    g = gws.get(s)
                    r = asyncio.run(run_one(
                        fleet.address(setups[0]) if g else fleet.address(s), reqs,
                        a.time_scale, a.warmup, f"{s}-{load:g}", ids, model,
                        (g.base, url_node) if g else None))
                    r.update({"setup": s, "load": load, "rate_req_per_s": load * cap,
                              "wall_s": time.perf_counter() - t})
                    doc["runs"].append(r)
                    print(f"load {load:g} {s:14s} p50 {r['ttft_s']['p50']:.3f}s "
                          f"p90 {r['ttft_s']['p90']:.3f}s ok {r['ok']}/{r['requests']} "
                          f"{r['req_per_s']:.1f} req/s", flush=True)
                    (out / "prefix.json").write_text(json.dumps(doc, indent=1),
                                                     encoding="utf-8")
            for name, g in gws.items():
                doc["smg"][name]["kv_metrics"] = _smg_kv_metrics(g.metrics_port)
        finally:
            stop_all([g.child for g in gws.values()], 10.0)
    (out / "prefix.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    (out / "prefix.md").write_text(markdown(doc, a.slo_ttft), encoding="utf-8")
    print(markdown(doc, a.slo_ttft))
    return 0


def _smg_kv_metrics(port: int) -> dict[str, float]:
    """SMG's KV-event and cache_aware counters (Prometheus), summed over workers: proof it
    consumed the nodes' events (batches applied, blocks stored, event-index hits)."""
    import re
    import urllib.request

    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as r:
            text = r.read().decode()
    except (OSError, ValueError):
        return out
    for line in text.splitlines():
        if not line.startswith(("smg_kv_event_batches", "smg_kv_event_blocks",
                                "smg_kv_event_gaps", "smg_kv_event_resyncs",
                                "smg_kv_index_entries", "smg_cache_aware_policy_branch")):
            continue
        k, _, v = line.rpartition(" ")
        k = re.sub(r'worker="[^"]*",?', "", k).replace(",}", "}").replace("{}", "")
        out[k] = out.get(k, 0.0) + float(v)
    return out


def _cells(runs: list[dict[str, Any]]) -> dict[tuple[str, float], dict[str, Any]]:
    """Per (setup, load): the repeats' TTFTs pooled (p50 / p90 over every counted request),
    the repeats' own p90s, their mean req/s and their errors."""
    out: dict[tuple[str, float], dict[str, Any]] = {}
    for r in runs:
        c = out.setdefault((r["setup"], r["load"]),
                           {"ttft": [], "p90s": [], "rps": [], "errors": 0, "n": 0})
        c["ttft"] += r.get("ttft_all_s", [])
        c["p90s"].append(r["ttft_s"]["p90"])
        c["rps"].append(r["req_per_s"])
        c["errors"] += r["errors"]
        c["n"] += r["ok"]
    for c in out.values():
        pooled = c.pop("ttft")
        c["p50"] = percentile(pooled, 50) if pooled else math.nan
        c["p90"] = percentile(pooled, 90) if pooled else max(c["p90s"])
        c["req_per_s"] = sum(c["rps"]) / len(c["rps"])
    return out


def markdown(doc: dict[str, Any], slo_s: float) -> str:
    runs = doc["runs"]
    setups = list(dict.fromkeys(r["setup"] for r in runs))
    loads = sorted({r["load"] for r in runs})
    at = _cells(runs)
    base = "least_request" if "least_request" in setups else setups[0]
    lines = [f"p90 TTFT in simulated s over every counted request of the repeats (the repeats' "
             f"own p90s in brackets); x = ratio to {base}", "",
             "| load | setup | requests | p50 TTFT | p90 TTFT [repeats] | x " + base
             + " | req/s | errors |", "|---|---|---|---|---|---|---|---|"]
    for ld in loads:
        ref = at.get((base, ld))
        for s in setups:
            c = at.get((s, ld))
            if c is None:
                continue
            ratio = c["p90"] / ref["p90"] if ref and ref["p90"] else math.nan
            reps = ", ".join(f"{x:.3f}" for x in c["p90s"])
            lines.append(f"| {ld:g} | {s} | {c['n']} | {c['p50']:.3f} | {c['p90']:.3f} "
                         f"[{reps}] | {ratio:.3f} | {c['req_per_s']:.1f} | {c['errors']} |")
    lines += ["", f"Throughput at SLO (p90 TTFT <= {slo_s:g} s, no errors): highest "
              "completed req/s over the loads that meet it.", "",
              "| setup | req/s at SLO | load |", "|---|---|---|"]
    for s in setups:
        good = [(at[(s, ld)]["req_per_s"], ld) for ld in loads if (s, ld) in at
                and at[(s, ld)]["p90"] <= slo_s and at[(s, ld)]["errors"] == 0]
        best = max(good) if good else (0.0, 0.0)
        lines.append(f"| {s} | {best[0]:.1f} | {best[1]:g} |")
    return "\n".join(lines) + "\n"
