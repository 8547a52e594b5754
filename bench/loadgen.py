"""The asyncio gRPC load generator: many concurrent ``GenerateStream`` calls from one process.

Works against any ``gpumesh.v1.Inference`` target (a router or a node). Two modes:

- open loop (``rate > 0``): requests start at their workload arrival offsets (Poisson, or a
  trace's), whatever the target's latency: the offered load is fixed;
- closed loop (``concurrency > 0``): that many workers each send their next request when the
  previous one ends.

A run stops by itself: after ``num_requests`` requests and/or once ``duration_s`` has passed
(no new request starts after it; those in flight finish or hit ``timeout_s``).

Timings are ``time.perf_counter`` seconds. TTFT is measured to the first message carrying a
token; latency to the stream's end; TPOT = (latency - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import grpc

from gpumesh import metadata as md
from gpumesh_bench.workload import BenchRequest, prompt_text
from gpumesh.client import SPREAD_OPTIONS, spread_target
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadConfig:
    target: str
    rate: float = 0.0  # req/s, open loop (the workload's arrivals carry it)
    concurrency: int = 0  # closed loop when > 0
    num_requests: int = 0  # 0 = unbounded (then duration_s bounds the run)
    duration_s: float = 0.0  # 0 = unbounded (then num_requests bounds the run)
    timeout_s: float = 300.0  # per-request deadline
    seed: int = 0  # prompt synthesis
    per_token: bool = False  # ask for one message per token (no coalescing)
    # > 0: ask for this coalescing interval (the node keeps it as asked, without widening it
    # under load); 0: the node's default
    flush_interval_ms: int = 0
    temperature: float | None = None
    progress_s: float = 5.0  # a progress line on stderr every so often; 0 = quiet
    label: str = ""  # the policy / setup name, for reports and plots
    # A router with --workers N: round-robin each process's calls over the workers' own
    # ports (gpumesh.client.spread_target) instead of one SO_REUSEPORT-hashed connection.
    spread_workers: bool = False

    def __post_init__(self) -> None:
        if (self.rate > 0) == (self.concurrency > 0):
            raise ValueError("set exactly one of rate (open loop) and concurrency (closed loop)")
        if self.num_requests <= 0 and self.duration_s <= 0:
            raise ValueError("bound the run by num_requests and/or duration_s")


@dataclass
class RequestResult:
    index: int
    start_s: float  # since the run's start
    latency_s: float
    ttft_s: float | None  # None: no token arrived
    output_tokens: int
    prompt_tokens: int  # from usage (0 if the stream did not end cleanly)
    status: str  # grpc.StatusCode name, "OK" on success
    node_id: str = ""
    chunks: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class RunResult:
    config: dict[str, Any]
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "wall_s": self.wall_s,
                "requests": [asdict(r) for r in self.results]}


def build_request(r: BenchRequest, cfg: LoadConfig) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(model=r.model, text=prompt_text(r, cfg.seed),
                             request_id=f"bench-{cfg.seed}-{r.index}")
    s = msg.sampling
    s.max_tokens = r.max_tokens
    s.ignore_eos = True
    if cfg.temperature is not None:
        s.temperature = cfg.temperature
    if cfg.per_token:
        msg.stream_options.per_token = True
    if cfg.flush_interval_ms > 0:
        msg.stream_options.flush_interval_ms = cfg.flush_interval_ms
    return msg


def _node_of(md_pairs: Any) -> str:
    for k, v in md_pairs or ():
        if k == md.NODE_ID:
            return v if isinstance(v, str) else v.decode()
    return ""


async def send_one(stub: pb_grpc.InferenceStub, r: BenchRequest, cfg: LoadConfig,
                   t0: float) -> RequestResult:
    """One streamed request, measured. Never raises for RPC errors (they become a status)."""
    return await send_message(stub, build_request(r, cfg), r, cfg, t0)


async def send_message(stub: pb_grpc.InferenceStub, msg: pb.GenerateRequest, r: BenchRequest,
                       cfg: LoadConfig, t0: float) -> RequestResult:
    """``send_one`` for a prebuilt request message (e.g. a token-id prompt)."""
    start = time.perf_counter()
    ttft: float | None = None
    tokens = chunks = prompt = 0
    status, err, node = "OK", "", ""
    call = stub.GenerateStream(msg, timeout=cfg.timeout_s)
    try:
        async for chunk in call:
            chunks += 1
            n = len(chunk.token_ids)
            if n and ttft is None:
                ttft = time.perf_counter() - start
            tokens += n
            if chunk.HasField("usage"):
                prompt = chunk.usage.prompt_tokens
                tokens = max(tokens, chunk.usage.completion_tokens)
        node = _node_of(await call.trailing_metadata())
    except grpc.aio.AioRpcError as e:
        status, err = e.code().name, (e.details() or "")[:200]
        node = _node_of(e.trailing_metadata())
    except asyncio.CancelledError:
        call.cancel()
        raise
    end = time.perf_counter()
    return RequestResult(r.index, start - t0, end - start, ttft, tokens, prompt, status, node,
                         chunks, err)


class _Progress:
    def __init__(self, every_s: float, out: TextIO, prefix: str) -> None:
        self.every, self.out, self.prefix = every_s, out, prefix
        self.done = self.ok = self.tokens = self.inflight = 0

    def add(self, res: RequestResult) -> None:
        self.done += 1
        self.ok += res.status == "OK"
        self.tokens += res.output_tokens

    async def run(self, t0: float) -> None:
        last_t, last_done, last_tok = t0, 0, 0
        while True:
            await asyncio.sleep(self.every)
            now = time.perf_counter()
            dt = max(now - last_t, 1e-9)
            print(f"{self.prefix}t={now - t0:6.1f}s done={self.done} ok={self.ok} "
                  f"in_flight={self.inflight} {(self.done - last_done) / dt:.1f} req/s "
                  f"{(self.tokens - last_tok) / dt:.0f} tok/s", file=self.out, flush=True)
            last_t, last_done, last_tok = now, self.done, self.tokens


async def run_load(cfg: LoadConfig, requests: Iterable[BenchRequest], *,
                   start_at: float | None = None, progress_prefix: str = "",
                   on_result: Callable[[RequestResult], None] | None = None,
                   channel_options: list[tuple[str, Any]] | None = None) -> RunResult:
    """Drive ``requests`` against ``cfg.target``; returns every request's result.

    ``start_at`` (a ``time.time()`` epoch) aligns several processes on one start instant.
    """
    opts = [("grpc.max_receive_message_length", 64 << 20), *(channel_options or [])]
    target = cfg.target
    if cfg.spread_workers:
        target = await spread_target(cfg.target)
        if target != cfg.target:
            opts += SPREAD_OPTIONS
    async with grpc.aio.insecure_channel(target, options=opts) as channel:
        stub = pb_grpc.InferenceStub(channel)
        await asyncio.wait_for(channel.channel_ready(), timeout=30)
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        return await drive(cfg, requests, lambda r, t0: send_one(stub, r, cfg, t0),
                           progress_prefix=progress_prefix, on_result=on_result)


async def drive(cfg: LoadConfig, requests: Iterable[BenchRequest],
                send: Callable[[BenchRequest, float], Awaitable[RequestResult]], *,
                progress_prefix: str = "",
                on_result: Callable[[RequestResult], None] | None = None) -> RunResult:
    """The open/closed loops and bookkeeping around any client path: ``send(request, t0)``
    performs and measures one request (gRPC here, HTTP/SSE in smg_fleet)."""
    reqs = _bounded(iter(requests), cfg.num_requests)
    results: list[RequestResult] = []
    prog = _Progress(cfg.progress_s, sys.stderr, progress_prefix)
    t0 = time.perf_counter()
    deadline = t0 + cfg.duration_s if cfg.duration_s > 0 else float("inf")

    async def one(r: BenchRequest) -> None:
        prog.inflight += 1
        try:
            res = await send(r, t0)
        finally:
            prog.inflight -= 1
        results.append(res)
        prog.add(res)
        if on_result is not None:
            on_result(res)

    ptask = asyncio.create_task(prog.run(t0)) if cfg.progress_s > 0 else None
    try:
        if cfg.concurrency > 0:
            await _closed_loop(cfg.concurrency, reqs, one, deadline)
        else:
            await _open_loop(reqs, one, t0, deadline)
    finally:
        if ptask is not None:
            ptask.cancel()
    wall = time.perf_counter() - t0
    results.sort(key=lambda x: x.index)
    return RunResult(config=asdict(cfg), results=results, wall_s=wall)


def _bounded(it: Iterator[BenchRequest], n: int) -> Iterator[BenchRequest]:
    if n <= 0:
        return it
    return (r for _, r in zip(range(n), it))


async def _open_loop(reqs: Iterator[BenchRequest], one: Callable[[BenchRequest], Any],
                     t0: float, deadline: float) -> None:
    tasks: set[asyncio.Task[None]] = set()
    try:
        for r in reqs:
            at = t0 + r.arrival_s
            if at >= deadline:
                break
            delay = at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            t = asyncio.create_task(one(r))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def _closed_loop(n: int, reqs: Iterator[BenchRequest],
                       one: Callable[[BenchRequest], Any], deadline: float) -> None:
    async def worker() -> None:
        for r in reqs:  # a shared iterator: each request is taken by exactly one worker
            if time.perf_counter() >= deadline:
                return
            await one(r)

    await asyncio.gather(*(worker() for _ in range(n)))
