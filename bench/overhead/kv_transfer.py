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


def _config(model: str, role: str, max_len: int, dummy: bool) -> Any:
    from gpumesh.node.engines.vllm import VllmEngineConfig

    return VllmEngineConfig(model=model, served_name="m", max_model_len=max_len,
                            enforce_eager=True, role=role, enable_prefix_caching=True,
                            load_format="dummy" if dummy else "auto",
                            tokenizer=str(Path(model) / "tokenizer") if dummy else None)


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
              seed: int) -> dict[str, Any]:
    from gpumesh.node.engines.vllm import VllmEngine

    rng = random.Random(seed)
    max_len = max(lengths) + 16
    engines = []
    for core, role in ((0, "prefill"), (1, "decode")):
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        e = VllmEngine(_config(model, role, max_len, dummy))
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
    finally:
        for e in engines:
            await e.shutdown()
    return {"model": model, "dummy_weights": dummy, "engine": "vllm-cpu",
            "connector": "NixlConnector (UCX, host memory)", "machine": platform.node(),
            "cpus": os.cpu_count(), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model folder (e.g. models/tiny)")
    p.add_argument("--dummy", action="store_true",
                   help="random weights (load_format dummy; tokenizer in MODEL/tokenizer)")
    p.add_argument("--lengths", default="128,512,1024,2000")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--vocab", type=int, default=2000, help="prompt ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSON results file")
    a = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = asyncio.run(run(a.model, [int(x) for x in a.lengths.split(",")], a.trials,
                             a.vocab, a.dummy, a.seed))
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
