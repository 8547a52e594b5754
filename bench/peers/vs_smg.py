"""``gpumesh bench vs-smg``: router overhead against one real vLLM CPU worker, gpumesh vs SMG.

Each gateway is measured against its OWN direct baseline: the worker
pinned to core 1 (``VLLM_CPU_OMP_THREADS_BIND=1``, taskset), the gateway and the load
generator on core 0. Streaming requests, 64-token prompts, 32 output tokens (ignore_eos),
closed loop at 8 and 32 in flight; direct and routed runs interleaved, medians.

- gpumesh: ``gpumesh node --engine vllm`` (the tiny model) behind ``gpumesh router``;
  direct = the node's own gpumesh.v1 gRPC.
- SMG: vLLM's gRPC server (``python -m vllm.entrypoints.launchers.grpc_server``) behind
  ``smg launch --policy least_load`` (OpenAI HTTP ``/v1/completions`` with SSE); direct = the
  worker's VllmEngine.Generate gRPC with the same token ids.

The two phases run one after the other (two CPU vLLM engines would fight for core 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from gpumesh.launcher import ChildProcess, free_port, stop_all, wait_until
from gpumesh_bench import REPO_ROOT
from gpumesh_bench.fleet import bench_child, group_cpu_s
from gpumesh_bench.overhead.router import Sample, _one, medians, summarize
from gpumesh_bench.report import write_json
from gpumesh_bench.workload import synth_prompt

SMG = REPO_ROOT / ".smg-venv" / "bin" / "smg"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("GPUMESH_TINY_MODEL", "models/tiny"))
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--smg", default=str(SMG))
    p.add_argument("--skip-gpumesh", action="store_true")
    p.add_argument("--out", default="bench-results/vs-smg")


async def closed_loop(send: Callable[[int], Awaitable[Sample]], concurrency: int,
                      duration_s: float) -> tuple[list[Sample], int, float]:
    samples: list[Sample] = []
    errors = 0
    for i in range(2):  # warm-up
        await send(i)
    t0 = time.perf_counter()
    end = t0 + duration_s
    k = 0

    async def worker() -> None:
        nonlocal errors, k
        while time.perf_counter() < end:
            k += 1
            try:
                samples.append(await send(k))
            except Exception:  # noqa: BLE001 (counted)
                errors += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, errors, time.perf_counter() - t0


async def _measure(send: Callable[[int], Awaitable[Sample]], conc: int, dur: float,
                   pgid: int | None) -> dict[str, Any]:
    c0 = group_cpu_s(pgid) if pgid else 0.0
    s, e, w = await closed_loop(send, conc, dur)
    c1 = group_cpu_s(pgid) if pgid else 0.0
    return summarize(s, e, w, c1 - c0)


def _wait(check: Callable[[], bool], kids: list[ChildProcess], timeout_s: float,
          what: str) -> None:
    wait_until(check, timeout_s, watch=kids, what=what, poll_s=1.0, not_up=(Exception,))


async def _interleave(variants: dict[str, tuple[Callable[[int], Awaitable[Sample]], int | None]],
                      concs: list[int], a: argparse.Namespace, tag: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in concs:
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
        names = list(variants)
        for rep in range(a.repeats):
            for name in names[rep % 2:] + names[:rep % 2]:
                send, pgid = variants[name]
                r = await _measure(send, c, a.duration, pgid)
                runs[name].append(r)
                print(f"[vs-smg] {tag} c={c} {name:8s} rep={rep} {r['req_per_s']:.1f} req/s "
                      f"ttft p50={r['ttft_p50_ms']:.1f} cpu={r['router_cpu_ms_per_req']:.2f} ms/req",
                      file=sys.stderr, flush=True)
        out[f"c{c}"] = {k: medians(v) for k, v in runs.items()}
    return out


def gpumesh_phase(a: argparse.Namespace, logs: Path, concs: list[int]) -> dict[str, Any]:
    from gpumesh.client import MeshClient, build_request

    rport, nport = free_port(), free_port()
    env = {"VLLM_CPU_OMP_THREADS_BIND": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    kids = [bench_child("gm-router", [sys.executable, "-m", "gpumesh.cli", "--log-level", "warning",
                                "router", "--host", "127.0.0.1", "--port", str(rport),
                                "--policy", "least_request"], logs, cpus="0")]
    try:
        kids.append(bench_child("gm-node", [sys.executable, "-m", "gpumesh.cli", "--log-level", "warning",
                                      "node", "--engine", "vllm", "--model", a.model,
                                      "--served-name", "tiny", "--max-model-len", "512",
                                      "--port", str(nport), "--node-id", "vllm0", "--router",
                                      f"127.0.0.1:{rport}"], logs, env, cpus="1"))

        def ready() -> bool:
            from gpumesh.v1 import control_pb2 as cpb
            from gpumesh.v1 import control_pb2_grpc as cpb_grpc

            with grpc.insecure_channel(f"127.0.0.1:{rport}") as ch:
                fl = cpb_grpc.RouterStub(ch).GetFleet(cpb.GetFleetRequest(), timeout=2)
                return any(n.state == cpb.NodeState.Value("NODE_STATE_HEALTHY") for n in fl.nodes)

        _wait(ready, kids, 300, "gpumesh vLLM node")
        prompt = synth_prompt(64, 0, 0)

        async def run() -> dict[str, Any]:
            direct = MeshClient(f"127.0.0.1:{nport}")
            routed = MeshClient(f"127.0.0.1:{rport}")
            try:
                def sender(client: MeshClient) -> Callable[[int], Awaitable[Sample]]:
                    async def send(i: int) -> Sample:
                        return await _one(client, build_request(prompt, max_tokens=32,
                                                                ignore_eos=True, temperature=0.0))
                    return send
                return await _interleave({"direct": (sender(direct), None),
                                          "gateway": (sender(routed), kids[0].pid)},
                                         concs, a, "gpumesh")
            finally:
                await direct.close()
                await routed.close()

        return asyncio.run(run())
    finally:
        stop_all(kids, 20.0)


def smg_phase(a: argparse.Namespace, logs: Path, concs: list[int]) -> dict[str, Any]:
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc
    from transformers import AutoTokenizer

    wport, gport, mport = free_port(), free_port(), free_port()
    env = {"VLLM_CPU_OMP_THREADS_BIND": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    model = str(Path(a.model).resolve())
    kids = [bench_child("vllm-grpc", [sys.executable, "-m", "vllm.entrypoints.launchers.grpc_server",
                                "--model", model, "--host", "127.0.0.1", "--port", str(wport),
                                "--dtype", "bfloat16", "--max-model-len", "512",
                                "--enforce-eager"], logs, env, cpus="1")]
    try:
        def worker_ready() -> bool:
            with grpc.insecure_channel(f"127.0.0.1:{wport}") as ch:
                return vpb_grpc.VllmEngineStub(ch).HealthCheck(vpb.HealthCheckRequest(),
                                                                timeout=2).healthy

        _wait(worker_ready, kids, 300, "vLLM gRPC worker")
        kids.append(bench_child("smg", [a.smg, "launch", "--host", "127.0.0.1", "--port", str(gport),
                                  "--worker-urls", f"grpc://127.0.0.1:{wport}", "--policy",
                                  "least_load", "--model-path", model, "--prometheus-host",
                                  "127.0.0.1", "--prometheus-port", str(mport)], logs, cpus="0"))

        def smg_ready() -> bool:
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{gport}/health", timeout=2) as r:
                return r.status == 200

        _wait(smg_ready, kids, 120, "smg")
        prompt = synth_prompt(64, 0, 0)
        ids = AutoTokenizer.from_pretrained(model)(prompt)["input_ids"]

        async def run() -> dict[str, Any]:
            import aiohttp

            ch = grpc.aio.insecure_channel(f"127.0.0.1:{wport}")
            stub = vpb_grpc.VllmEngineStub(ch)
            http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

            async def direct(i: int) -> Sample:
                req = vpb.GenerateRequest(request_id=f"d{i}-{time.monotonic_ns()}",
                                          tokenized=vpb.TokenizedInput(input_ids=ids),
                                          stream=True)
                req.sampling_params.max_tokens = 32
                req.sampling_params.temperature = 0.0
                req.sampling_params.ignore_eos = True
                start = last = time.perf_counter()
                ttft, tokens, chunks, gaps = None, 0, 0, []
                async for m in stub.Generate(req, timeout=60):
                    if m.HasField("chunk") and m.chunk.token_ids:
                        now = time.perf_counter()
                        if ttft is None:
                            ttft = now - start
                        else:
                            gaps.append(now - last)
                        last = now
                        tokens += len(m.chunk.token_ids)
                        chunks += 1
                end = time.perf_counter()
                return Sample(ttft or end - start, end - start, tokens, chunks, gaps)

            async def via_smg(i: int) -> Sample:
                body = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                start = last = time.perf_counter()
                ttft, tokens, chunks, gaps = None, 0, 0, []
                async with http.post(f"http://127.0.0.1:{gport}/v1/completions", json=body,
                                     timeout=aiohttp.ClientTimeout(total=60)) as resp:
                    resp.raise_for_status()
                    async for line in resp.content:
                        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                            continue
                        d = json.loads(line[6:])
                        if d.get("choices") and d["choices"][0].get("text"):
                            now = time.perf_counter()
                            if ttft is None:
                                ttft = now - start
                            else:
                                gaps.append(now - last)
                            last = now
                            tokens += 1
                            chunks += 1
                        if d.get("usage"):
                            tokens = d["usage"].get("completion_tokens", tokens)
                end = time.perf_counter()
                return Sample(ttft or end - start, end - start, tokens, chunks, gaps)

            try:
                return await _interleave({"direct": (direct, None),
                                          "gateway": (via_smg, kids[1].pid)}, concs, a, "smg")
            finally:
                await http.close()
                await ch.close()

        return asyncio.run(run())
    finally:
        stop_all(kids, 20.0)


def markdown(res: dict[str, Any]) -> str:
    head = ("| gateway | in flight | req/s direct | req/s via gateway | change | TTFT p50 added ms "
            "| TTFT p99 added ms | gateway CPU ms/req |")
    lines = [head, "|" + "---|" * 8]
    for gw in ("gpumesh", "smg"):
        for k, v in (res.get(gw) or {}).items():
            d, g = v["direct"], v["gateway"]
            lines.append(f"| {gw} | {k[1:]} | {d['req_per_s']:.1f} | {g['req_per_s']:.1f} | "
                         f"{100 * (g['req_per_s'] / d['req_per_s'] - 1):+.1f}% | "
                         f"{g['ttft_p50_ms'] - d['ttft_p50_ms']:+.1f} | "
                         f"{g['ttft_p99_ms'] - d['ttft_p99_ms']:+.1f} | "
                         f"{g['router_cpu_ms_per_req']:.2f} |")
    return "\n".join(lines) + "\n"


def main(a: argparse.Namespace) -> int:
    out = Path(a.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    concs = [int(x) for x in a.concurrency.split(",")]
    res: dict[str, Any] = {"args": vars(a)}
    os.sched_setaffinity(0, {0})  # the load generator shares core 0 with the gateway
    try:
        if not a.skip_gpumesh:
            res["gpumesh"] = gpumesh_phase(a, logs, concs)
            write_json(out / "vs-smg.json", res)
        if Path(a.smg).exists():
            res["smg"] = smg_phase(a, logs, concs)
        else:
            res["smg_missing"] = f"{a.smg} not found"
    finally:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        write_json(out / "vs-smg.json", res)
        md = markdown(res)
        (out / "vs-smg.md").write_text(md, encoding="utf-8")
        print(md)
    return 0
