"""Aggregates over a run's per-request results: throughput, percentiles, goodput, node share.

Pure functions (no I/O). Times in the summary are milliseconds, rates per wall-clock second.

- Percentiles interpolate linearly between closest ranks (numpy's default ``linear``).
- The measurement window is first request start -> last request end.
- Latency, TTFT and TPOT percentiles are over successful requests only; errors are counted by
  gRPC status name.
- Goodput: successful requests with TTFT <= ``slo.ttft_ms`` and TPOT <= ``slo.tpot_ms`` (a
  request with one output token has no TPOT and passes that half), per second of the window.

``window_metrics`` is the other method: the raw-vLLM reference's fixed window after a warm-up
(seconds, not milliseconds), used by the GPU bench and the engine loop.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpumesh_bench.loadgen import RequestResult


@dataclass(frozen=True)
class SLO:
    ttft_ms: float = math.inf
    tpot_ms: float = math.inf

    def met(self, r: RequestResult) -> bool:
        if r.status != "OK" or r.ttft_s is None:
            return False
        tpot = r.tpot_s
        return r.ttft_s * 1000 <= self.ttft_ms and (tpot is None or tpot * 1000 <= self.tpot_ms)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError("p must be in [0, 100]")
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _dist_ms(values_s: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {"mean": sum(ms) / len(ms) if ms else math.nan, "p50": percentile(ms, 50),
            "p90": percentile(ms, 90), "p99": percentile(ms, 99),
            "max": max(ms) if ms else math.nan}


def summarize(results: Sequence[RequestResult], slo: SLO | None = None) -> dict[str, Any]:
    slo = slo or SLO()
    n = len(results)
    ok = [r for r in results if r.status == "OK"]
    if results:
        t_first = min(r.start_s for r in results)
        t_last = max(r.start_s + r.latency_s for r in results)
        window = max(t_last - t_first, 1e-9)
    else:
        window = math.nan
    out_tokens = sum(r.output_tokens for r in ok)
    good = sum(1 for r in ok if slo.met(r))
    nodes = Counter(r.node_id or "?" for r in ok)
    return {
        "requests": n,
        "ok": len(ok),
        "errors": dict(sorted(Counter(r.status for r in results if r.status != "OK").items())),
        "window_s": window,
        "req_per_s": len(ok) / window if n else 0.0,
        "output_tok_per_s": out_tokens / window if n else 0.0,
        "output_tokens": out_tokens,
        "latency_ms": _dist_ms([r.latency_s for r in ok]),
        "ttft_ms": _dist_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _dist_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "goodput_req_per_s": good / window if n else 0.0,
        "goodput_fraction": good / n if n else 0.0,
        "node_share": {k: v / len(ok) for k, v in sorted(nodes.items())},
        "node_requests": dict(sorted(nodes.items())),
    }


def window_metrics(results: Sequence[RequestResult], warmup_s: float,
                   window_s: float) -> dict[str, Any]:
    """Metrics over the window ``[warmup_s, warmup_s + window_s]`` (offsets of ``start_s``),
    computed as the raw-vLLM reference tool computes them (``gpumesh_bench.gpu.reference``).

    - ``completed``, ``qps``: successful requests that started in the window and finished
      inside it, and their count per second of the window (this undercounts the completion
      rate by about latency / window);
    - ``done_qps``, ``out_tok_s``: successful requests that finished in the window (wherever
      they started), and their output tokens, per second of the window;
    - ``lat_*``, ``ttft_*``, ``tpot_p50``, ``out_tokens_p50`` (seconds, tokens): percentiles
      over the ``completed`` requests (NaN when there are none), rounded to 0.1 ms;
    - ``requests``, ``errors``, ``error_kinds``: every result given, the failed ones, and up to
      five distinct "STATUS: message" strings.
    """
    ok = [r for r in results if r.status == "OK"]
    lo, hi = warmup_s, warmup_s + window_s
    inwin = [r for r in ok if r.start_s >= lo and r.start_s + r.latency_s <= hi]
    done = [r for r in ok if lo <= r.start_s + r.latency_s <= hi]

    def pct(xs: Sequence[float], p: float) -> float:
        v = percentile(xs, p)
        return v if math.isnan(v) else round(v, 4)

    ttft = [r.ttft_s for r in inwin if r.ttft_s is not None]
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "error_kinds": sorted({f"{r.status}: {r.error[:80]}" for r in results
                               if r.status != "OK"})[:5],
        "completed": len(inwin), "qps": round(len(inwin) / window_s, 2),
        "done_qps": round(len(done) / window_s, 2),
        "out_tok_s": round(sum(r.output_tokens for r in done) / window_s, 1),
        "lat_p50": pct([r.latency_s for r in inwin], 50),
        "lat_p99": pct([r.latency_s for r in inwin], 99),
        "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
        "tpot_p50": pct([t for r in inwin if (t := r.tpot_s) is not None], 50),
        "out_tokens_p50": pct([r.output_tokens for r in inwin], 50),
    }
