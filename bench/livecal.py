"""A quick step-time calibration of a live engine through its node (no router): the
simulator's step model ``step_ms = a + b_decode * decode_tokens + b_prefill *
prefill_tokens`` and the node's fixed front-end time, fitted from two probes.

- decode: ``B`` requests sent at once (prompt 16 tokens of their own, 96 output tokens), for
  B in ``DECODE_BATCHES``; the median inter-token time of the batch is one decode step of B
  sequences; a least-squares line over B gives ``a`` and ``b_decode``;
- prefill: one request at a time (prompt L tokens of its own, 1 output token), for L in
  ``PREFILL_LENGTHS``, ``reps`` each; the median TTFT's slope over L is ``b_prefill``, its
  intercept minus ``a`` is the node's front-end time per request (gRPC, tokenisation-free
  token-id input, the first message out), which the simulator takes as two one-way message
  delays.

This is the fallback when no engine profile (``gpumesh calibrate``) is given; it runs on the
same engines as the live side, just before it.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

from gpumesh_bench.livefleet import direct, token_request

DECODE_BATCHES = (1, 4, 16, 32)
PREFILL_LENGTHS = (16, 256, 768, 1536)


def _fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab - 1) for _ in range(n)]


async def calibrate(address: str, model: str, vocab: int, reps: int = 3,
                    seed: int = 99) -> dict[str, Any]:
    """Fits the step model on the node at ``address`` (module docstring). Returns
    ``{"step_a_ms", "step_b_decode_ms", "step_b_prefill_ms", "front_end_ms", "samples"}``."""
    rng = random.Random(seed)
    await direct(address, [token_request(model, _ids(rng, 16, vocab), 8, "warm")])
    decode: list[tuple[int, float]] = []
    for b in DECODE_BATCHES:
        for _ in range(reps):
            res = await direct(address, [token_request(model, _ids(rng, 16, vocab), 96,
                                                       f"cal-d{b}-{k}") for k in range(b)])
            tpots = [x.tpot_s for x in res if x.status == "OK" and x.tpot_s is not None]
            if tpots:
                decode.append((b, 1000 * statistics.median(tpots)))
    prefill: list[tuple[int, float]] = []
    for n in PREFILL_LENGTHS:
        for _ in range(reps):
            res = await direct(address, [token_request(model, _ids(rng, n, vocab), 1,
                                                       f"cal-p{n}")])
            if res[0].status == "OK" and res[0].ttft_s is not None:
                prefill.append((n, 1000 * res[0].ttft_s))
    if len({b for b, _ in decode}) < 2 or len({n for n, _ in prefill}) < 2:
        raise RuntimeError(f"calibration failed: decode {decode}, prefill {prefill}")
    a, b_dec = _fit([float(b) for b, _ in decode], [y for _, y in decode])
    c0, b_pre = _fit([float(n) for n, _ in prefill], [y for _, y in prefill])
    a = max(a, 0.05)
    return {"step_a_ms": a, "step_b_decode_ms": max(b_dec, 0.0),
            "step_b_prefill_ms": max(b_pre, 0.0), "front_end_ms": max(c0 - a, 0.0),
            "samples": {"decode": decode, "prefill": prefill}}
