"""Aggregates: percentiles, throughput window, goodput under an SLO, errors, node share."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from gpumesh_bench.loadgen import RequestResult
from gpumesh_bench.report import markdown_table
from gpumesh_bench.stats import SLO, percentile, summarize, window_metrics


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101, 1000):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for p in (0, 1, 50, 90, 99, 99.9, 100):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def r(i: int, start: float, lat: float, ttft: float | None, toks: int, status: str = "OK", node: str = "a") -> RequestResult:
    return RequestResult(i, start, lat, ttft, toks, 10, status, node)


def test_tpot() -> None:
    assert r(0, 0, 1.1, 0.1, 11).tpot_s == pytest.approx(0.1)
    assert r(0, 0, 1.0, 0.1, 1).tpot_s is None
    assert r(0, 0, 1.0, None, 0).tpot_s is None


def test_summary_and_goodput() -> None:
    rows = [
        r(0, 0.0, 1.1, 0.1, 11, node="a"),     # tpot 100 ms, ttft 100 ms: good
        r(1, 0.5, 2.2, 0.2, 11, node="b"),     # tpot 200 ms: fails tpot
        r(2, 1.0, 1.0, 0.5, 1, node="a"),      # ttft 500 ms: fails ttft; no tpot
        r(3, 1.5, 0.1, None, 0, status="RESOURCE_EXHAUSTED", node=""),
        r(4, 2.0, 0.5, 0.05, 1, node="a"),     # good (no tpot)
        r(5, 3.0, 1.0, None, 0, status="DEADLINE_EXCEEDED"),
    ]
    s = summarize(rows, SLO(ttft_ms=300, tpot_ms=150))
    assert s["requests"] == 6 and s["ok"] == 4
    assert s["errors"] == {"DEADLINE_EXCEEDED": 1, "RESOURCE_EXHAUSTED": 1}
    assert s["window_s"] == pytest.approx(4.0)  # 0.0 -> 3.0 + 1.0
    assert s["req_per_s"] == pytest.approx(1.0)
    assert s["output_tokens"] == 24 and s["output_tok_per_s"] == pytest.approx(6.0)
    assert s["goodput_req_per_s"] == pytest.approx(0.5) and s["goodput_fraction"] == pytest.approx(2 / 6)
    assert s["latency_ms"]["p50"] == pytest.approx(1050.0)
    assert s["ttft_ms"]["max"] == pytest.approx(500.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert s["node_share"] == {"a": 0.75, "b": 0.25}
    # no SLO: every success is good
    assert summarize(rows)["goodput_fraction"] == pytest.approx(4 / 6)
    table = markdown_table([{"config": {"label": "p2c", "rate": 5.0}, "summary": s}])
    assert "| p2c | 5 req/s |" in table and "RESOURCE_EXHAUSTED 1" in table


def test_empty() -> None:
    s = summarize([])
    assert s["requests"] == 0 and s["req_per_s"] == 0.0 and math.isnan(s["latency_ms"]["p99"])


def test_window_metrics_count_like_the_raw_reference() -> None:
    # warm-up 1 s, window [1, 5]
    rows = [
        r(0, 0.2, 1.0, 0.1, 11),    # started in the warm-up, ended in the window: done only
        r(1, 1.0, 2.0, 0.2, 21),    # in the window: completed and done
        r(2, 2.0, 1.0, 0.1, 11),    # completed and done
        r(3, 4.5, 1.0, 0.1, 11),    # ends after the window: neither
        r(4, 2.0, 0.1, None, 0, status="UNAVAILABLE"),
    ]
    m = window_metrics(rows, 1.0, 4.0)
    assert m["requests"] == 5 and m["errors"] == 1 and m["error_kinds"] == ["UNAVAILABLE: "]
    assert m["completed"] == 2 and m["qps"] == 0.5 and m["done_qps"] == 0.75
    assert m["out_tok_s"] == round(43 / 4, 1)  # the done requests' tokens
    assert m["lat_p50"] == 1.5 and m["ttft_p50"] == 0.15
    assert m["tpot_p50"] == pytest.approx(0.09)   # (0.09 + 0.09) / 2
    assert m["out_tokens_p50"] == 16.0
    assert math.isnan(window_metrics([], 1.0, 4.0)["lat_p50"])
