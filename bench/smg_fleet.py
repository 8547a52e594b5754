"""``python -m gpumesh_bench.smg_fleet``: gpumesh vs SMG on the same simulated fleet (issue 6, 3).

One simulated fleet (default ``hetero-eqkv``: 8 nodes, speeds 1,1,1,1,2,2,0.5,0.5, 8,192 KV
tokens each, ``max_num_seqs`` 32, as in docs/benchmarks.md section 1) is fronted at the same
time by

- gpumesh routers (``weighted_least_load`` and ``least_request``; every node heartbeats to
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
import os
import random
import sys
import time
import urllib.request
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpumesh_bench.compare import HETERO_SPEEDS, WORKLOADS, parse_variants
from gpumesh_bench.fleet import (
    Child,
    Fleet,
    RouterSpec,
    free_port,
    group_cpu_s,
    hetero_nodes,
)
from gpumesh_bench.harness import closed_loop_throughput, median
from gpumesh_bench.loadgen import (
    LoadConfig,
    RequestResult,
    RunResult,
    drive,
    send_message,
)
from gpumesh_bench.report import result_document, write_json
from gpumesh_bench.stats import SLO, summarize
from gpumesh_bench.workload import (
    BenchRequest,
    LengthDist,
    WorkloadSpec,
    iter_requests,
    load_trace,
    save_trace,
)

REPO = Path(__file__).resolve().parents[2]
SMG = REPO / ".smg-venv" / "bin" / "smg"
DEFAULT_MODEL = REPO / "models" / "tiny"
SMG_ROUTED_HEADER = "x-smg-routed-worker-id"


# --- prompts of an exact token count in the tiny BPE --------------------------------------

class BpePrompts:
    """Prompts of exactly N tokens of ``model_dir``'s tokenizer, deterministic per (seed,
    index): N words, each a single vocabulary token with its leading space (``Ġword``). The
    byte-level pre-tokenizer splits at every space, so the text encodes to exactly these ids."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        words = []
        for tok, i in sorted(self.tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
            w = tok[1:]
            if tok.startswith("\u0120") and w.isascii() and w.isalpha() \
                    and self.tokenizer.encode(" " + w).ids == [i]:
                words.append((w, i))
        if len(words) < 16:
            raise ValueError(f"{model_dir}: too few single-token words ({len(words)})")
        self.words = words

    def prompt(self, n: int, seed: int, index: int) -> tuple[str, list[int]]:
        rng = random.Random((seed << 32) ^ (index * 0x9E3779B1))
        picks = [self.words[int(rng.random() * len(self.words))] for _ in range(max(1, n))]
        return "".join(" " + w for w, _ in picks), [i for _, i in picks]

    def check(self, n: int = 64, seed: int = 0, index: int = 0) -> bool:
        text, ids = self.prompt(n, seed, index)
        return self.tokenizer.encode(text).ids == ids


# --- the two client paths -------------------------------------------------------------------

Send = Callable[[BenchRequest, float], Awaitable[RequestResult]]


async def grpc_send(stub: Any, prompts: BpePrompts, r: BenchRequest, cfg: LoadConfig,
                    t0: float) -> RequestResult:
    """``loadgen.send_one`` with a token-id prompt (same measurement, field for field)."""
    from gpumesh.v1 import inference_pb2 as pb

    _, ids = prompts.prompt(r.prompt_tokens, cfg.seed, r.index)
    msg = pb.GenerateRequest(model=r.model, token_ids=pb.TokenIds(ids=ids),
                             request_id=f"bench-{cfg.seed}-{r.index}-{time.monotonic_ns()}")
    msg.sampling.max_tokens = r.max_tokens
    msg.sampling.ignore_eos = True
    if cfg.temperature is not None:
        msg.sampling.temperature = cfg.temperature
    return await send_message(stub, msg, r, cfg, t0)


async def http_send(session: Any, base: str, model: str, prompts: BpePrompts,
                    worker_nodes: dict[str, str], r: BenchRequest, cfg: LoadConfig,
                    t0: float) -> RequestResult:
    """One streamed OpenAI ``/v1/completions`` request through SMG, measured like the gRPC
    path: TTFT at the first SSE event whose text is non-empty, tokens from the final usage
    (``stream_options.include_usage``), node from SMG's routed-worker header."""
    import aiohttp

    text, ids = prompts.prompt(r.prompt_tokens, cfg.seed, r.index)
    body: dict[str, Any] = {"model": model, "prompt": text, "max_tokens": r.max_tokens,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if cfg.temperature is not None:
        body["temperature"] = cfg.temperature
    start = time.perf_counter()
    ttft: float | None = None
    tokens = chunks = prompt = 0
    status, err, node = "OK", "", ""
    done = False
    try:
        async with session.post(base + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)) as resp:
            node = worker_nodes.get(resp.headers.get(SMG_ROUTED_HEADER, ""), "")
            if resp.status != 200:
                status, err = f"HTTP_{resp.status}", (await resp.text())[:200]
            else:
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    if line.startswith(b"data: [DONE]"):
                        done = True
                        continue
                    ev = json.loads(line[6:])
                    ch = ev.get("choices")
                    if ch and ch[0].get("text"):
                        chunks += 1
                        if ttft is None:
                            ttft = time.perf_counter() - start
                    u = ev.get("usage")
                    if u:
                        tokens = int(u.get("completion_tokens") or 0)
                        prompt = int(u.get("prompt_tokens") or 0)
                if not done:
                    status, err = "INCOMPLETE", "stream ended without [DONE]"
                elif prompt != len(ids):
                    err = f"prompt_tokens {prompt} != {len(ids)} sent"
    except (aiohttp.ClientError, ValueError) as e:
        status, err = "HTTP_ERROR", repr(e)[:200]
    except TimeoutError:
        status, err = "DEADLINE_EXCEEDED", "client timeout"
    end = time.perf_counter()
    return RequestResult(r.index, start - t0, end - start, ttft, tokens, prompt, status, node,
                         chunks, err)


@dataclass(frozen=True)
class Target:
    """Where a run's requests go: a gpumesh router (gRPC) or an SMG gateway (HTTP)."""

    name: str
    kind: str                      # "grpc" | "http"
    address: str                   # host:port (grpc) or http://host:port (http)
    model: str = ""
    worker_nodes: dict[str, str] = field(default_factory=dict)  # SMG worker URL -> node id


async def run_target(cfg: LoadConfig, requests: Iterable[BenchRequest], target: Target,
                     prompts: BpePrompts) -> RunResult:
    """``loadgen.run_load`` for either path (the same open/closed loops and bookkeeping)."""
    async with contextlib.AsyncExitStack() as stack:
        if target.kind == "grpc":
            from gpumesh.v1 import inference_pb2_grpc as pb_grpc

            ch = await stack.enter_async_context(grpc.aio.insecure_channel(
                target.address, options=[("grpc.max_receive_message_length", 64 << 20)]))
            await asyncio.wait_for(ch.channel_ready(), timeout=30)
            stub = pb_grpc.InferenceStub(ch)

            def send(r: BenchRequest, t0: float) -> Awaitable[RequestResult]:
                return grpc_send(stub, prompts, r, cfg, t0)
        else:
            import aiohttp

            session = await stack.enter_async_context(aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=False)))

            def send(r: BenchRequest, t0: float) -> Awaitable[RequestResult]:
                return http_send(session, target.address, target.model, prompts,
                                 target.worker_nodes, r, cfg, t0)

        return await drive(cfg, requests, send, progress_prefix=f"[{target.name}] ")


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat (every process, others'
    too)."""
    with open("/proc/stat", encoding="ascii") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return float(sum(v) - idle), float(sum(v))


async def measured(cfg: LoadConfig, requests: Sequence[BenchRequest], target: Target,
                   prompts: BpePrompts, slo: SLO, watch: dict[str, int],
                   extra: dict[str, Any]) -> dict[str, Any]:
    """One run (``harness.measured_run`` for both paths) + the whole machine's CPU."""
    c0 = {k: group_cpu_s(p) for k, p in watch.items()}
    m0 = machine_cpu()
    p0, w0 = time.process_time(), time.perf_counter()
    run = await run_target(cfg, requests, target, prompts)
    wall = time.perf_counter() - w0
    lg = time.process_time() - p0
    m1 = machine_cpu()
    c1 = {k: group_cpu_s(p) for k, p in watch.items()}
    summary = summarize(run.results, slo)
    ok = max(1, summary["ok"])
    cpu = {k: {"s": c1[k] - c0[k], "pct": 100 * (c1[k] - c0[k]) / wall,
               "ms_per_req": 1000 * (c1[k] - c0[k]) / ok} for k in watch}
    cpu["loadgen"] = {"s": lg, "pct": 100 * lg / wall, "ms_per_req": 1000 * lg / ok}
    cpu["machine"] = {"busy_cores": (m1[0] - m0[0]) / max(m1[1] - m0[1], 1) * (os.cpu_count() or 1),
                      "pct": 100 * (m1[0] - m0[0]) / max(m1[1] - m0[1], 1)}
    summary["chunks_per_req"] = sum(r.chunks for r in run.results if r.status == "OK") / ok
    summary["prompt_mismatch"] = sum(1 for r in run.results if r.error.startswith("prompt_tokens"))
    doc = result_document(run, summary, extra, include_requests=False)
    doc["cpu"] = cpu
    doc["run_wall_s"] = wall
    doc["sample_errors"] = sorted({r.error for r in run.results if r.status != "OK"})[:5]
    return doc


# --- SMG gateways -----------------------------------------------------------------------------

@dataclass(frozen=True)
class SmgSpec:
    name: str                  # label
    policy: str
    interval_s: int            # --load-monitor-interval (integer seconds in SMG 1.13.0)
    flags: tuple[str, ...] = ()


def parse_smg(items: Sequence[str], time_scale: float) -> list[SmgSpec]:
    """``NAME=POLICY[@INTERVAL][:FLAGS]``; INTERVAL ``scaled`` = 10 s x time_scale."""
    out = []
    for it in items:
        name, _, rest = it.partition("=")
        head, _, flags = rest.partition(":")
        policy, _, iv = head.partition("@")
        interval = (max(1, round(10 * time_scale)) if iv == "scaled" else int(iv or 1))
        out.append(SmgSpec(name, policy, interval, tuple(flags.split())))
    return out


def smg_scaled_flags(time_scale: float) -> list[str]:
    """SMG's seconds / rates for a fleet slowed ``time_scale`` times (its defaults: 0.15 s KV
    pressure weight, 2000 tok/s fallback throughput)."""
    if time_scale <= 0 or time_scale == 1:
        return []
    return ["--least-load-kv-pressure-weight", f"{0.15 * time_scale:g}",
            "--least-load-default-throughput", f"{2000 / time_scale:g}"]


class SmgGateway:
    def __init__(self, exe: str | Path, spec: SmgSpec, workers: Sequence[str], model: str,
                 log_dir: Path, time_scale: float, cpus: str = "") -> None:
        self.spec = spec
        self.port, self.metrics_port = free_port(), free_port()
        self.argv = [str(exe), "launch", "--host", "127.0.0.1", "--port", str(self.port),
                     "--worker-urls", *[f"grpc://{w}" for w in workers],
                     "--policy", spec.policy, "--model-path", model,
                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                     "--load-monitor-interval", str(spec.interval_s), "--log-level", "warn",
                     *smg_scaled_flags(time_scale), *spec.flags]
        self.child = Child(f"smg-{spec.name}", self.argv, log_dir, cpus=cpus)
        self.base = f"http://127.0.0.1:{self.port}"
        self.n_workers = len(workers)

    def workers(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(self.base + "/workers", timeout=3) as r:
            return json.load(r).get("workers", [])

    def ready(self) -> bool:
        if not self.child.alive():
            raise RuntimeError(f"{self.child.name} exited:\n{self.child.tail()}")
        with contextlib.suppress(OSError, ValueError):
            ws = self.workers()
            return len(ws) == self.n_workers and all(
                w.get("is_healthy") and w.get("status") == "ready" for w in ws)
        return False

    def overload_metrics(self) -> dict[str, float]:
        """SMG's own counters of overload-protection and liveness fallbacks (Prometheus)."""
        out: dict[str, float] = {}
        with contextlib.suppress(OSError, ValueError):
            url = f"http://127.0.0.1:{self.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=3) as r:
                for line in r.read().decode().splitlines():
                    if not line.startswith("#") and ("overload" in line or "fallback" in line):
                        k, _, v = line.rpartition(" ")
                        if float(v):
                            out[k] = float(v)
        return out

    def load_versions(self) -> dict[str, str]:
        """Worker URL -> where its load came from ("pushed", a GetLoads version, or none)."""
        with contextlib.suppress(OSError, ValueError):
            return {w["url"]: (w.get("engine_load") or {}).get("version", "none")
                    for w in self.workers()}
        return {}


def stop_all(kids: Sequence[Child]) -> None:
    for k in kids:
        k.signal(15)
    for k in kids:
        try:
            k.popen.wait(10)
        except Exception:  # noqa: BLE001
            k.signal(9)
            with contextlib.suppress(Exception):
                k.popen.wait(5)
        k.close()


# --- the comparison -----------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", default="hetero-eqkv", choices=("hetero-eqkv", "hetero-kvspeed"))
    p.add_argument("--workloads", default="bimodal,lognormal")
    p.add_argument("--loads", default="0.5,0.8,0.95", help="fractions of measured capacity")
    p.add_argument("--gpumesh", default="weighted_least_load,least_request",
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


def _wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready in {timeout_s} s")
        time.sleep(0.3)


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
    if "weighted_least_load" not in measured_routers:  # the idle / capacity probe
        routers.append(RouterSpec("weighted_least_load", "weighted_least_load"))
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
                _wait_until(g.ready, 90, g.child.name)
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
            stop_all([g.child for g in gws])
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
        cfg = LoadConfig(target=fleet.address("weighted_least_load"), concurrency=conc,
                         duration_s=a.cap_duration, timeout_s=300, progress_s=0,
                         label="capacity", seed=a.seed)
        t = Target("capacity", "grpc", fleet.address("weighted_least_load"))
        run = await run_target(cfg, iter_requests(WorkloadSpec(prompt, output, a.seed + 1000)),
                               t, prompts)
        cap = closed_loop_throughput(run.results, a.cap_duration / 3, a.cap_duration)
        info = {"req_per_s": cap, "concurrency": conc, "duration_s": a.cap_duration,
                "via": "gpumesh weighted_least_load router, token-id prompts"}
    cap = float(info["req_per_s"])
    doc["capacity"][key] = info
    print(f"[smg-fleet] {key}: capacity {cap:.1f} req/s", file=sys.stderr, flush=True)
    await fleet.wait_idle("weighted_least_load")
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
                idle = await fleet.wait_idle("weighted_least_load")
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


# --- report -------------------------------------------------------------------------------

METRICS = (("ttft_p50", "summary.ttft_ms.p50"), ("ttft_p99", "summary.ttft_ms.p99"),
           ("lat_p99", "summary.latency_ms.p99"), ("goodput", "summary.goodput_fraction"),
           ("gw_cpu", "cpu_summary.gateway_pct"), ("lg_cpu", "cpu_summary.loadgen_pct"),
           ("nodes_cpu", "cpu_summary.nodes_pct"), ("machine", "cpu_summary.machine_busy_cores"))


def _get(d: dict[str, Any], path: str) -> float:
    for k in path.split("."):
        d = d.get(k) if isinstance(d, dict) else None  # type: ignore[assignment]
    return math.nan if d is None else float(d)  # type: ignore[arg-type]


def _others(r: dict[str, Any]) -> float:
    """Cores busy with processes outside this benchmark during the run (the shared machine)."""
    c = r.get("cpu_summary", {})
    mine = sum(c.get(k, 0.0) for k in ("gateway_pct", "loadgen_pct", "nodes_pct",
                                           "idle_gateways_pct")) / 100
    return max(0.0, c.get("machine_busy_cores", math.nan) - mine)


def aggregate(runs: list[dict[str, Any]]) -> dict[tuple[str, float, str], dict[str, Any]]:
    groups: dict[tuple[str, float, str], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        c = r["config"]
        groups[(c["workload"], float(c["load"]), c["label"])].append(r)
    out = {}
    for key, rs in groups.items():
        row: dict[str, Any] = {m: median([_get(r, p) for r in rs]) for m, p in METRICS}
        row["others"] = median([_others(r) for r in rs])
        row["p99s"] = [_get(r, "summary.ttft_ms.p99") for r in rs]
        row["errors"] = sum(r["summary"]["requests"] - r["summary"]["ok"] for r in rs)
        row["mismatch"] = sum(r["summary"].get("prompt_mismatch", 0) for r in rs)
        row["n"] = len(rs)
        nodes = sorted({k for r in rs for k in r["summary"]["node_share"]})
        row["share"] = {k: median([r["summary"]["node_share"].get(k, 0.0) for r in rs])
                        for k in nodes}
        row["gateway"] = rs[0]["config"]["gateway"]
        out[key] = row
    return out


def _share_str(share: dict[str, float]) -> str:
    """Per node in fleet order, grouped by speed: ``x1 a/b/c/d · x2 e/f · x0.5 g/h`` (%)."""
    groups: dict[str, list[str]] = defaultdict(list)
    for k in sorted(share):
        sp = k.rsplit("-x", 1)[-1] if "-x" in k else "?"
        groups[sp].append(f"{100 * share[k]:.0f}")
    return " · ".join(f"x{sp} {'/'.join(v)}" for sp, v in groups.items())


def verdict(agg: dict[tuple[str, float, str], dict[str, Any]], wl: str, load: float,
            ref: str = "gpumesh-weighted_least_load") -> str:
    rows = {k[2]: v for k, v in agg.items() if k[:2] == (wl, load)}
    smg = {k: v for k, v in rows.items() if v["gateway"] == "smg"}
    if ref not in rows or not smg:
        return "-"
    best = min(smg, key=lambda k: smg[k]["ttft_p99"])
    w = rows[ref]
    ok_p99 = w["ttft_p99"] <= smg[best]["ttft_p99"]
    ok_good = w["goodput"] >= smg[best]["goodput"]
    ok_good_all = w["goodput"] >= max(v["goodput"] for v in smg.values())
    return (f"WLL p99 {w['ttft_p99']:.0f} vs SMG best ({best}) {smg[best]['ttft_p99']:.0f} ms "
            f"-> {w['ttft_p99'] / smg[best]['ttft_p99']:.2f}x {'met' if ok_p99 else 'MISSED'}; "
            f"goodput {100 * w['goodput']:.1f}% vs {100 * smg[best]['goodput']:.1f}% "
            f"{'met' if ok_good else 'MISSED'} (vs SMG's highest goodput: "
            f"{'met' if ok_good_all else 'missed'})")


def markdown(doc: dict[str, Any]) -> str:
    runs = doc["runs"]
    agg = aggregate(runs)
    lines: list[str] = []
    ts = doc.get("args", {}).get("time_scale", 0)
    for wl in sorted({k[0] for k in agg}):
        cap = doc.get("capacity", {}).get(f"{doc['args']['fleet']}/{wl}", {})
        lines.append(f"\n#### {doc['args']['fleet']} / {wl} (capacity "
                     f"{cap.get('req_per_s', 0):.1f} req/s wall at time_scale {ts:g})\n")
        lines.append("| load | gateway / policy | TTFT p50 ms | TTFT p99 ms (median) | p99 each "
                     "repeat | lat p99 ms | goodput % | p99 / best SMG | gateway CPU % | "
                     "loadgen CPU % | nodes CPU % | machine cores busy (others) | errors | node share % |")
        lines.append("|" + "---|" * 14)
        for load in sorted({k[1] for k in agg if k[0] == wl}):
            rows = {k[2]: v for k, v in agg.items() if k[:2] == (wl, load)}
            smg_best = min((v["ttft_p99"] for v in rows.values() if v["gateway"] == "smg"),
                           default=math.nan)
            for name in sorted(rows, key=lambda n: (rows[n]["gateway"] != "gpumesh", n)):
                r = rows[name]
                mism = f" ({r['mismatch']} prompt-size mismatches)" if r["mismatch"] else ""
                lines.append(
                    f"| {load:.0%} | {name} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | "
                    f"{', '.join(f'{x:.0f}' for x in r['p99s'])} | {r['lat_p99']:.0f} | "
                    f"{100 * r['goodput']:.1f} | {r['ttft_p99'] / smg_best:.2f} | "
                    f"{r['gw_cpu']:.0f} | {r['lg_cpu']:.0f} | {r['nodes_cpu']:.0f} | "
                    f"{r['machine']:.2f} ({r['others']:.2f}) | {r['errors']}{mism} | {_share_str(r['share'])} |")
        lines.append("")
        for load in sorted({k[1] for k in agg if k[0] == wl}):
            lines.append(f"- {wl} {load:.0%}: {verdict(agg, wl, load)}")
    if doc.get("git_head"):
        lines.append(f"\ncode: {doc['git_head']}; wall {doc.get('wall_s', 0):.0f} s")
    src = doc.get("smg_load_source")
    if src:
        lines.append("\nSMG load source per gateway (engine_load.version): "
                     + "; ".join(f"{k}: {', '.join(v)}" for k, v in src.items()))
    for k, v in (doc.get("smg_overload_counters") or {}).items():
        if v:
            lines.append(f"\nSMG {k} fallback/overload counters (whole session): "
                         + "; ".join(f"{m} = {x:g}" for m, x in v.items()))
    return "\n".join(lines) + "\n"


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
    p = argparse.ArgumentParser(prog="python -m gpumesh_bench.smg_fleet report")
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
    p = argparse.ArgumentParser(prog="python -m gpumesh_bench.smg_fleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return main(p.parse_args(args))


if __name__ == "__main__":
    sys.exit(cli())
