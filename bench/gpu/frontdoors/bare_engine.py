"""The bare-engine front door: one engine in this process and the closed-loop load in the same
event loop, no server and no network (the physical limit the other front doors approach).

  python -m gpumesh_bench.gpu.frontdoors.bare_engine --engine vllm --model DIR --tokenizer DIR/tokenizer \
      --gpu-mem 0.14 --max-model-len 2048 [--engine-args JSON]
  python -m gpumesh_bench.gpu.frontdoors.bare_engine --engine sim --shape 0.5b --time-scale 4

vLLM: an ``AsyncLLM`` built with the very ``AsyncEngineArgs`` a gpumesh node builds for the same
settings (``gpumesh.node.engines.vllm.engine_args.engine_kwargs``: CUDA graphs mode, prefix
caching, stream interval), prompts given as text (the engine tokenizes, as a server would),
detokenized outputs (vLLM's default). ``--engine sim``: the node's simulated engine (a CPU dry
run of the harness; no figures come from it).

Protocol (the harness keeps the process up across rounds): prints ``READY`` once the engine
serves; then reads one JSON command per stdin line::

  {"cmd": "run", "concurrency": C, "duration_s": D, "start_at": EPOCH, "prompt_tokens": 32,
   "output_tokens": 256, "seed": 0, "index_base": 0, "out": PATH}

runs C streams from ``start_at`` (``time.time()``) until ``start_at + D`` (a stream starts no
request after that and the run waits for the last ones), writes ``{"results": [...]}`` to
PATH (``gpumesh_bench.loadgen.RequestResult`` fields; ``start_s`` counts from ``start_at``) and
prints ``DONE PATH``. ``{"cmd": "quit"}`` or end of input stops the engine and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from gpumesh_bench.loadgen import RequestResult
from gpumesh_bench.workload import synth_prompt

# One stream's request: (prompt text, max tokens, request id) -> async iterator of token counts
Generate = Callable[[str, int, str], AsyncIterator[int]]


async def _vllm(a: argparse.Namespace) -> tuple[Generate, Callable[[], Any]]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from gpumesh.node.engines.vllm.config import VllmEngineConfig
    from gpumesh.node.engines.vllm.engine_args import engine_kwargs

    cfg = VllmEngineConfig(served_name=a.served_name, model=a.model, tokenizer=a.tokenizer,
                           dtype="bfloat16", max_model_len=a.max_model_len,
                           gpu_memory_utilization=a.gpu_mem, load_format="dummy",
                           num_gpu_blocks_override=a.blocks or None,
                           enable_prefix_caching=False, extra=json.loads(a.engine_args))
    kw = engine_kwargs(cfg)
    print("ENGINE_ARGS " + json.dumps(kw, default=str), flush=True)
    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))

    async def gen(prompt: str, max_tokens: int, rid: str) -> AsyncIterator[int]:
        sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
        async for out in eng.generate(prompt, sp, request_id=rid):
            yield len(out.outputs[0].token_ids)

    return gen, eng.shutdown


async def _sim(a: argparse.Namespace) -> tuple[Generate, Callable[[], Any]]:
    from gpumesh.node.engines.base import EngineRequest, Sampling
    from gpumesh.node.engines.sim import SimEngine, SimEngineConfig

    eng = SimEngine(SimEngineConfig.for_shape(a.shape, time_scale=a.time_scale))
    await eng.start()

    async def gen(prompt: str, max_tokens: int, rid: str) -> AsyncIterator[int]:
        req = EngineRequest(rid, tuple(eng.tokenize(prompt)),
                            Sampling(max_tokens=max_tokens, ignore_eos=True))
        async for out in eng.generate(req):
            yield len(out.token_ids)

    return gen, eng.shutdown


async def _one(gen: Generate, cmd: dict[str, Any], index: int, t0: float) -> RequestResult:
    prompt = synth_prompt(int(cmd.get("prompt_tokens", 32)), int(cmd.get("seed", 0)), index)
    start = time.perf_counter()
    start_s = time.time() - t0
    first: float | None = None
    n = chunks = 0
    status, err = "OK", ""
    try:
        async for d in gen(prompt, int(cmd.get("output_tokens", 256)), f"bare-{index}-{time.monotonic_ns()}"):
            if d and first is None:
                first = time.perf_counter() - start
            n += d
            chunks += 1
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        status, err = "ENGINE_ERROR", repr(e)[:200]
    return RequestResult(index, start_s, time.perf_counter() - start, first, n,
                         int(cmd.get("prompt_tokens", 32)), status, "bare", chunks, err)


async def run(gen: Generate, cmd: dict[str, Any]) -> list[RequestResult]:
    """``cmd``'s closed loop: C streams from ``start_at`` until ``start_at + duration_s``."""
    t0 = float(cmd["start_at"])
    end = t0 + float(cmd["duration_s"])
    counter = itertools.count(int(cmd.get("index_base", 0)))
    results: list[RequestResult] = []
    await asyncio.sleep(max(0.0, t0 - time.time()))

    async def stream() -> None:
        while time.time() < end:
            results.append(await _one(gen, cmd, next(counter), t0))

    await asyncio.gather(*(stream() for _ in range(int(cmd["concurrency"]))))
    return results


async def main(a: argparse.Namespace) -> int:
    gen, shutdown = await (_vllm(a) if a.engine == "vllm" else _sim(a))
    # a short warm-up so the first measured request does not pay lazy initialisation
    await run(gen, {"start_at": time.time(), "duration_s": 0.01, "concurrency": 2,
                    "output_tokens": 4, "index_base": 10**9})
    print("READY", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd.get("cmd") == "quit":
                break
            res = await run(gen, cmd)
            Path(cmd["out"]).write_text(json.dumps({"results": [dataclasses.asdict(r) for r in res]}))
            print(f"DONE {cmd['out']}", flush=True)
    finally:
        r = shutdown()
        if asyncio.iscoroutine(r):
            await r
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gpumesh_bench.gpu.frontdoors.bare_engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("vllm", "sim"), default="vllm")
    p.add_argument("--model", default="")
    p.add_argument("--tokenizer", default="")
    p.add_argument("--served-name", default="model")
    p.add_argument("--gpu-mem", type=float, default=0.14)
    p.add_argument("--blocks", type=int, default=0, help="num_gpu_blocks_override (0: what fits)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--engine-args", default="{}", help="JSON: extra AsyncEngineArgs (as a node's)")
    p.add_argument("--shape", default="0.5b", help="sim: the simulated shape")
    p.add_argument("--time-scale", type=float, default=1.0, help="sim: wall seconds per sim second")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
