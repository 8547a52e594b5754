"""A quick step-time calibration of a live engine through its node (no router): the
simulator's step model ``step_ms = a + b_decode * decode_tokens + b_prefill *
prefill_tokens`` and the node's fixed time per request, fitted from three probes.

- decode: ``B`` requests sent at once (prompts of their own, ``context`` tokens long, 64
  output tokens), for B in ``DECODE_BATCHES``; each stream's token arrival times after the
  batch's last first token (every prefill done) give its time per token, and their median is
  one decode step of B sequences. A least-squares line over B gives ``a`` and ``b_decode``.
  The probe runs at ``context`` = the workload's typical prompt (the fit the simulator uses:
  its step model has no context term, so decode is calibrated where the workload decodes)
  and at 16 tokens (recorded, to show how much the context costs);
- prefill: one request at a time (a prompt of its own, L tokens, 1 output token), for L in
  ``PREFILL_LENGTHS``; the median TTFT's slope over L is ``b_prefill``, its intercept minus
  ``a`` is the node's fixed time per request (gRPC in and out, the front end), which the
  simulator takes as two one-way message delays;
- cached prefill (recorded, not fitted): a 512-token prefix is prefilled, then the prefix
  plus 48 new tokens is sent; its TTFT against the model's (the 48 new tokens only) says what
  a prefix-cache hit costs beyond the tokens it computes (attention over the cached context).

This is the fallback when no engine profile (``gpumesh calibrate``) is given; it runs on the
same engines as the live side, just before it.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import grpc

from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc
from gpumesh_bench.sim.livefleet import token_request

DECODE_BATCHES = (1, 4, 16, 32)
PREFILL_LENGTHS = (16, 256, 768, 1536)


def _fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


async def _stream(stub: pb_grpc.InferenceStub,
                  msg: pb.GenerateRequest) -> tuple[float, list[tuple[float, int]]]:
    """(send time, [(arrival time, tokens so far)]) of one streamed request."""
    t0 = time.perf_counter()
    pts: list[tuple[float, int]] = []
    n = 0
    async for chunk in stub.GenerateStream(msg, timeout=120):
        if chunk.token_ids:
            n += len(chunk.token_ids)
            pts.append((time.perf_counter(), n))
    return t0, pts


class _Probe:
    def __init__(self, stub: pb_grpc.InferenceStub, model: str, vocab: int, seed: int) -> None:
        self.stub, self.model, self.vocab = stub, model, vocab
        self.rng = random.Random(seed)
        self.k = 0

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(10, self.vocab - 1) for _ in range(n)]

    def msg(self, ids: list[int], out: int) -> pb.GenerateRequest:
        self.k += 1
        return token_request(self.model, ids, out, f"cal-{self.k}")

    async def ttft_ms(self, ids: list[int]) -> float:
        t0, pts = await _stream(self.stub, self.msg(ids, 1))
        return 1000 * (pts[0][0] - t0)

    async def decode_step_ms(self, batch: int, context: int, out: int = 64) -> float:
        runs = await asyncio.gather(*[_stream(self.stub, self.msg(self.ids(context), out))
                                      for _ in range(batch)])
        last_first = max(p[0][0] for _, p in runs)
        per_token = []
        for _, pts in runs:
            after = [p for p in pts if p[0] > last_first]
            if len(after) >= 2 and after[-1][1] > after[0][1]:
                per_token.append((after[-1][0] - after[0][0]) / (after[-1][1] - after[0][1]))
        return 1000 * statistics.median(per_token) if per_token else float("nan")


async def calibrate(address: str, model: str, vocab: int, context: int = 16, reps: int = 2,
                    seed: int = 99) -> dict[str, Any]:
    """Fits the step model on the node at ``address`` (module docstring). Returns
    ``{"step_a_ms", "step_b_decode_ms", "step_b_prefill_ms", "front_end_ms", "samples",
    ...}``."""
    async with grpc.aio.insecure_channel(address) as ch:
        p = _Probe(pb_grpc.InferenceStub(ch), model, vocab, seed)
        await p.ttft_ms(p.ids(16))
        decode: dict[int, list[tuple[int, float]]] = {}
        for ctx in sorted({16, context}):
            decode[ctx] = [(b, await p.decode_step_ms(b, ctx)) for b in DECODE_BATCHES
                           for _ in range(reps)]
        prefill = [(n, await p.ttft_ms(p.ids(n))) for n in PREFILL_LENGTHS for _ in range(reps)]
        cached = []
        for _ in range(reps + 1):
            prefix = p.ids(512)
            await p.ttft_ms(prefix + p.ids(8))
            cached.append(await p.ttft_ms(prefix + p.ids(48)))
    fits = {}
    for ctx, pts in decode.items():
        ok = [(b, y) for b, y in pts if y == y]
        if len({b for b, _ in ok}) < 2:
            raise RuntimeError(f"decode calibration failed at context {ctx}: {pts}")
        fits[ctx] = _fit([float(b) for b, _ in ok], [y for _, y in ok])
    a, b_dec = fits[context]
    c0, b_pre = _fit([float(n) for n, _ in prefill], [y for _, y in prefill])
    a = max(a, 0.05)
    front = max(c0 - a, 0.0)
    model_48 = a + max(b_pre, 0.0) * 48 + front
    return {"step_a_ms": a, "step_b_decode_ms": max(b_dec, 0.0),
            "step_b_prefill_ms": max(b_pre, 0.0), "front_end_ms": front,
            "decode_context_tokens": context,
            "decode_fit_by_context": {str(k): {"a_ms": v[0], "b_decode_ms": v[1]}
                                      for k, v in fits.items()},
            "cached_prefill_ms": {"measured_median": statistics.median(cached),
                                  "model": model_48},
            "samples": {"decode": {str(k): v for k, v in decode.items()},
                        "prefill": prefill, "cached_prefill_512_48": cached}}
