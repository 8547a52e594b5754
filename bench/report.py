"""Result files and their renderings: JSON, markdown tables, PNG plots.

A result file is JSON: ``{"config": LoadConfig fields + workload, "summary": stats.summarize,
"wall_s", "requests": [per-request results]}``; non-finite numbers are written as null.
Plots take several result files and draw one curve per ``config.label`` (the policy) against
the offered load (``config.rate`` req/s for open loop, ``config.concurrency`` for closed loop).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpumesh_bench.loadgen import RunResult


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def result_document(run: RunResult, summary: dict[str, Any], extra_config: dict[str, Any] | None = None,
                    include_requests: bool = True) -> dict[str, Any]:
    doc = run.to_dict()
    doc["config"] = {**doc["config"], **(extra_config or {})}
    doc["summary"] = summary
    if not include_requests:
        doc.pop("requests")
    return _clean(doc)


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(_clean(doc), indent=1, allow_nan=False) + "\n", encoding="utf-8")


def load_result(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def label_of(doc: dict[str, Any]) -> str:
    c = doc.get("config", {})
    return str(c.get("label") or c.get("target") or "run")


def offered_load(doc: dict[str, Any]) -> float:
    c = doc.get("config", {})
    return float(c.get("rate") or c.get("concurrency") or 0)


def _f(x: Any, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown_table(docs: Sequence[dict[str, Any]]) -> str:
    """One row per result: label, offered load, throughput, latency/TTFT/TPOT, goodput, errors."""
    head = ("| label | offered | req/s | out tok/s | lat p50 ms | lat p99 ms | TTFT p50 ms | "
            "TTFT p99 ms | TPOT p50 ms | goodput req/s | good % | errors | node share |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for d in docs:
        s, c = d["summary"], d.get("config", {})
        offered = f"{c['rate']:g} req/s" if c.get("rate") else f"c={c.get('concurrency')}"
        errs = ", ".join(f"{k} {v}" for k, v in s.get("errors", {}).items()) or "0"
        share = " ".join(f"{k}:{v:.0%}" for k, v in s.get("node_share", {}).items())
        lines.append(
            f"| {label_of(d)} | {offered} | {_f(s['req_per_s'], 2)} | {_f(s['output_tok_per_s'], 0)} "
            f"| {_f(s['latency_ms']['p50'])} | {_f(s['latency_ms']['p99'])} "
            f"| {_f(s['ttft_ms']['p50'])} | {_f(s['ttft_ms']['p99'])} | {_f(s['tpot_ms']['p50'], 2)} "
            f"| {_f(s['goodput_req_per_s'], 2)} | {_f(100 * s['goodput_fraction'], 0)} | {errs} "
            f"| {share} |")
    return "\n".join(lines) + "\n"


def plot(docs: Sequence[dict[str, Any]], out: str | Path, title: str = "") -> Path:
    """Latency (p50 dashed, p99 solid) and goodput vs offered load, one curve per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for d in docs:
        curves[label_of(d)].append(d)
    closed = all(not d.get("config", {}).get("rate") for d in docs)
    xlabel = "concurrency (closed loop)" if closed else "offered load (req/s)"
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.5))
    for i, (label, ds) in enumerate(sorted(curves.items())):
        ds = sorted(ds, key=offered_load)
        x = [offered_load(d) for d in ds]

        def col(key: str, q: str, ds: list[dict[str, Any]] = ds) -> list[float]:
            return [math.nan if d["summary"][key][q] is None else d["summary"][key][q] for d in ds]

        color = f"C{i % 10}"
        ax1.plot(x, col("latency_ms", "p99"), "-o", color=color, label=f"{label} p99")
        ax1.plot(x, col("latency_ms", "p50"), "--", color=color, label=f"{label} p50")
        ax2.plot(x, col("ttft_ms", "p99"), "-o", color=color, label=f"{label} p99")
        ax2.plot(x, col("ttft_ms", "p50"), "--", color=color, label=f"{label} p50")
        ax3.plot(x, [d["summary"]["goodput_req_per_s"] for d in ds], "-o", color=color, label=label)
    for ax, yl in ((ax1, "latency (ms)"), (ax2, "TTFT (ms)"), (ax3, "goodput (req/s within SLO)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_yscale("log")
    ax2.set_yscale("log")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
