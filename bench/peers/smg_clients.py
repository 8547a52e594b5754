"""The two client paths of the gpumesh-vs-SMG comparison, measured alike: gRPC to a gpumesh
router with token-id prompts, OpenAI HTTP/SSE to an SMG gateway with the same prompts as text
(``BpePrompts``: N words that are exactly N tokens of the tiny model's BPE)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpumesh_bench.fleet import group_cpu_s
from gpumesh_bench.harness import cpu_use
from gpumesh_bench.loadgen import LoadConfig, RequestResult, RunResult, drive, send_message
from gpumesh_bench.report import result_document
from gpumesh_bench.stats import SLO, summarize
from gpumesh_bench.workload import BenchRequest

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
    path (``stream_completion``); a prompt token count other than the ids sent is noted in the
    result's error text."""
    text, ids = prompts.prompt(r.prompt_tokens, cfg.seed, r.index)
    body: dict[str, Any] = {"model": model, "prompt": text, "max_tokens": r.max_tokens,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if cfg.temperature is not None:
        body["temperature"] = cfg.temperature
    res = await stream_completion(session, base, body, worker_nodes, r, cfg, t0)
    if res.status == "OK" and res.prompt_tokens != len(ids):
        res.error = f"prompt_tokens {res.prompt_tokens} != {len(ids)} sent"
    return res


async def stream_completion(session: Any, base: str, body: dict[str, Any],
                            worker_nodes: dict[str, str], r: BenchRequest, cfg: LoadConfig,
                            t0: float) -> RequestResult:
    """POST ``body`` (a streamed ``/v1/completions`` request) to ``base`` and measure it: TTFT
    at the first SSE event whose text is non-empty, tokens and prompt tokens from the final
    usage (``stream_options.include_usage``), node from SMG's routed-worker header (mapped by
    ``worker_nodes``); INCOMPLETE when the stream ends without ``[DONE]``."""
    import aiohttp

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
    cpu: dict[str, Any] = cpu_use(c0, c1, lg, wall, ok)
    cpu["machine"] = {"busy_cores": (m1[0] - m0[0]) / max(m1[1] - m0[1], 1) * (os.cpu_count() or 1),
                      "pct": 100 * (m1[0] - m0[0]) / max(m1[1] - m0[1], 1)}
    summary["chunks_per_req"] = sum(r.chunks for r in run.results if r.status == "OK") / ok
    summary["prompt_mismatch"] = sum(1 for r in run.results if r.error.startswith("prompt_tokens"))
    doc = result_document(run, summary, extra, include_requests=False)
    doc["cpu"] = cpu
    doc["run_wall_s"] = wall
    doc["sample_errors"] = sorted({r.error for r in run.results if r.status != "OK"})[:5]
    return doc
