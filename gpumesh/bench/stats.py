"""Aggregates over a run's per-request results: throughput, percentiles, goodput, node share.

Pure functions (no I/O). Times in the summary are milliseconds, rates per wall-clock second.

- Percentiles interpolate linearly between closest ranks (numpy's default ``linear``).
- The measurement window is first request start -> last request end.
- Latency, TTFT and TPOT percentiles are over successful requests only; errors are counted by
  gRPC status name.
- Goodput: successful requests with TTFT <= ``slo.ttft_ms`` and TPOT <= ``slo.tpot_ms`` (a
  request with one output token has no TPOT and passes that half), per second of the window.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpumesh.bench.loadgen import RequestResult


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
