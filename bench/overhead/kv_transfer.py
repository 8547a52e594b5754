"""What a disaggregated prefill costs over an aggregated one, per prompt token, on real vLLM
engines: two engines on one machine (a prefill engine with the node's ``prefill`` role, a
decode engine with ``decode``: vLLM's NixlConnector), the same prompt lengths both ways.

Per prompt length and trial (a fresh random prompt each time, so no prefix-cache hit):

- ``aggregated_s``: one engine, ``max_tokens`` 1: its time to first token (the prefill).
- ``prefill_leg_s``: the prefill engine, ``max_tokens`` 1 with ``do_remote_decode``.
- ``decode_first_s``: the decode engine's first token for the same prompt with the prefill
  leg's ``kv_transfer_params``: the KV transfer (handshake on first use, then the pull) plus
  one decode step.
- ``nixl_transfer_s`` / ``nixl_bytes``: what the decode engine's connector reported for the
  pull (NIXL's own transfer telemetry).
- ``decode_step_s``: one decode step of the decode engine at that context length (a whole
  request's second token after its first); ``handover_s`` = decode first token - that step:
  what the hand-over (handshake, pull, scheduling the pulled request) adds.

``disaggregated_s`` = prefill leg + decode first token; the per-token cost is
(disaggregated - aggregated) / prompt tokens. On one CPU both engines share the machine, so
this is the cost of the hand-over only, never an interference gain.

    gpumesh bench kv-transfer --model models/tiny --out bench/overhead/results/pd/transfer.json

``--identical N`` also checks, per prompt length, that the disaggregated greedy answer of N
tokens equals the aggregated one token for token (exit status 1 when one differs). On CUDA the
two engines share GPU 0 (``--gpu-memory-utilization`` each; ``bench/gpu/kit/run_pd.sh``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import time
import uuid
from pathlib import Path
from typing import Any


def _config(model: str, role: str, max_len: int, dummy: bool, gpu_mem: float) -> Any:
    from gpumesh.node.engines.vllm import VllmEngineConfig

    return VllmEngineConfig(model=model, served_name="m", max_model_len=max_len,
                            enforce_eager=True, role=role, enable_prefix_caching=True,
                            load_format="dummy" if dummy else "auto",
                            dtype="bfloat16" if dummy else "auto",
                            gpu_memory_utilization=gpu_mem,
                            tokenizer=str(Path(model) / "tokenizer") if dummy else None)


async def _tokens(engine: Any, ids: list[int], max_tokens: int,
                  params: dict | None) -> tuple[list[int], dict | None]:
    """Greedy output token ids of one request, and the kv_transfer_params it ended with."""
    from gpumesh.node.engines.base import EngineRequest, Sampling

    req = EngineRequest(uuid.uuid4().hex, tuple(ids), Sampling(max_tokens=max_tokens,
                        temperature=0.0, ignore_eos=True), None, params)
    out: list[int] = []
    kv = None
    async for o in engine.generate(req):
        out.extend(o.token_ids)
        if o.finish is not None:
            kv = o.kv_transfer_params
    return out, kv


async def _identical(pre: Any, dec: Any, rng: random.Random, vocab: int, lengths: list[int],
                     max_tokens: int) -> list[dict[str, Any]]:
    """Per prompt length: the aggregated answer (prefill engine alone) against the
    disaggregated one (prefill leg, then the decode engine from its KV), greedy, token for
    token."""
    rows = []
    for n in lengths:
        ids = [rng.randrange(10, vocab) for _ in range(n)]
        whole, _ = await _tokens(pre, ids, max_tokens, None)
        _, kv = await _tokens(pre, ids, 1, {"do_remote_decode": True})
        split, _ = await _tokens(dec, ids, max_tokens, kv)
        same = sum(1 for a, b in zip(whole, split) if a == b)
        rows.append({"prompt_tokens": n, "output_tokens": len(whole),
                     "identical": whole == split, "matching_prefix": next(
                         (i for i, (a, b) in enumerate(zip(whole, split)) if a != b),
                         min(len(whole), len(split))), "matching_tokens": same})
    return rows


async def _first(engine: Any, ids: list[int], params: dict | None) -> tuple[float, dict | None]:
    from gpumesh.node.engines.base import EngineRequest, Sampling

    req = EngineRequest(uuid.uuid4().hex, tuple(ids), Sampling(max_tokens=1, temperature=0.0),
                        None, params)
    t0 = time.perf_counter()
    kv = None
    async for out in engine.generate(req):
        if out.finish is not None:
            kv = out.kv_transfer_params
    return time.perf_counter() - t0, kv


async def _decode_step(engine: Any, ids: list[int]) -> float:
    """Seconds between a whole request's first and second token on ``engine``: one decode
    step at this context length (the reference the decode leg's first token is compared to)."""
    from gpumesh.node.engines.base import EngineRequest, Sampling

    req = EngineRequest(uuid.uuid4().hex, tuple(ids), Sampling(max_tokens=2, temperature=0.0,
                                                               ignore_eos=True))
    stamps: list[float] = []
    async for out in engine.generate(req):
        stamps.extend(time.perf_counter() for _ in out.token_ids)
    return stamps[1] - stamps[0]


def _summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1]}


async def run(model: str, lengths: list[int], trials: int, vocab: int, dummy: bool,
              seed: int, gpu_mem: float = 0.4, identical_tokens: int = 0) -> dict[str, Any]:
    from gpumesh.node.engines.vllm import VllmEngine
    from gpumesh.node.engines.vllm.compat import current_platform

    cpu = current_platform().is_cpu()

    rng = random.Random(seed)
    max_len = max(lengths) + 16
    engines = []
    for core, role in ((0, "prefill"), (1, "decode")):
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        e = VllmEngine(_config(model, role, max_len + identical_tokens, dummy, gpu_mem))
        await e.start()
        engines.append(e)
    pre, dec = engines
    rows = []
    try:
        warm = [rng.randrange(10, vocab) for _ in range(64)]   # first handshake, warm-up
        _, kv = await _first(pre, warm, {"do_remote_decode": True})
        await _first(dec, warm, kv)
        await _first(pre, [rng.randrange(10, vocab) for _ in range(64)], None)
        for n in lengths:
            samples: dict[str, list[float]] = {k: [] for k in (
                "aggregated_s", "prefill_leg_s", "decode_first_s", "disaggregated_s",
                "nixl_transfer_s", "nixl_bytes", "decode_step_s", "handover_s")}
            for t in range(trials):
                p_agg = [rng.randrange(10, vocab) for _ in range(n)]
                p_dis = [rng.randrange(10, vocab) for _ in range(n)]
                order = (0, 1) if t % 2 == 0 else (1, 0)
                for which in order:
                    if which == 0:
                        agg, _ = await _first(pre, p_agg, None)
                        samples["aggregated_s"].append(agg)
                        continue
                    before = dec.kv_transfers
                    leg, kv = await _first(pre, p_dis, {"do_remote_decode": True})
                    first, _ = await _first(dec, p_dis, kv)
                    await asyncio.sleep(0.05)   # the step's connector stats arrive after it
                    after = dec.kv_transfers
                    samples["prefill_leg_s"].append(leg)
                    samples["decode_first_s"].append(first)
                    samples["disaggregated_s"].append(leg + first)
                    samples["nixl_transfer_s"].append(after.seconds - before.seconds)
                    samples["nixl_bytes"].append(float(after.bytes - before.bytes))
                    step = await _decode_step(dec, [rng.randrange(10, vocab) for _ in range(n)])
                    samples["decode_step_s"].append(step)
                    samples["handover_s"].append(first - step)
            row: dict[str, Any] = {"prompt_tokens": n, "trials": trials}
            row.update({k: _summary(v) for k, v in samples.items()})
            extra = [d - a for d, a in zip(samples["disaggregated_s"], samples["aggregated_s"])]
            row["extra_ms_per_token"] = _summary([1000 * x / n for x in extra])
            row["handover_ms_per_token"] = _summary([1000 * x / n for x in samples["handover_s"]])
            rows.append(row)
        same = (await _identical(pre, dec, rng, vocab, lengths, identical_tokens)
                if identical_tokens else [])
    finally:
        for e in engines:
            await e.shutdown()
    return {"model": model, "dummy_weights": dummy, "engine": "vllm-cpu" if cpu else "vllm-cuda",
            "connector": "NixlConnector (UCX, %s memory)" % ("host" if cpu else "GPU"),
            "gpu_memory_utilization": None if cpu else gpu_mem, "device": _device(cpu),
            "machine": platform.node(), "cpus": os.cpu_count(), "rows": rows,
            "identical": same}


def _device(cpu: bool) -> str:
    if cpu:
        return platform.processor() or platform.machine()
    import torch

    return torch.cuda.get_device_name(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model folder (e.g. models/tiny)")
    p.add_argument("--dummy", action="store_true",
                   help="random weights (load_format dummy; tokenizer in MODEL/tokenizer)")
    p.add_argument("--lengths", default="128,512,1024,2000")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--vocab", type=int, default=2000, help="prompt ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                   help="each engine's share of the GPU (CUDA; two engines share GPU 0)")
    p.add_argument("--identical", type=int, default=0, metavar="N",
                   help="also check, per prompt length, that a disaggregated greedy answer of "
                        "N tokens equals the aggregated one token for token")
    p.add_argument("--out", required=True, help="JSON results file")
    a = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = asyncio.run(run(a.model, [int(x) for x in a.lengths.split(",")], a.trials,
                             a.vocab, a.dummy, a.seed, a.gpu_memory_utilization,
                             a.identical))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    for r in result["rows"]:
        print(f"{r['prompt_tokens']:>5} tokens  aggregated {r['aggregated_s']['median']*1000:7.1f} ms"
              f"  disaggregated {r['disaggregated_s']['median']*1000:7.1f} ms"
              f"  (prefill {r['prefill_leg_s']['median']*1000:.1f} + decode first "
              f"{r['decode_first_s']['median']*1000:.1f})  extra/token "
              f"{r['extra_ms_per_token']['median']:.3f} ms  NIXL {r['nixl_transfer_s']['median']*1000:.2f} ms"
              f" {r['nixl_bytes']['median']/1024:.0f} KiB  hand-over "
              f"{r['handover_s']['median']*1000:.1f} ms")
    for r in result["identical"]:
        print(f"{r['prompt_tokens']:>5} tokens  disaggregated == aggregated over "
              f"{r['output_tokens']} greedy tokens: {r['identical']}")
    return 0 if all(r["identical"] for r in result["identical"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
