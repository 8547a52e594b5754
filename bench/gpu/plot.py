"""The GPU report's figure: QPS by setup against the raw reference, decode step vs batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpumesh_bench.gpu.records import (
    RAW_CONCURRENCY,
    RAW_REFERENCE,
    REFERENCE_WORKLOAD,
    _call_tagger,
    _setup_key,
    _workload,
    dedupe,
)

def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = dedupe(records)
    tag = _call_tagger(records)
    main = [r for r in records if r["phase"] in ("p05", "p7", "tp05", "tp7", "share", "raw", "eng")]
    sw = [r for r in records if r["phase"] == "sweep" and r["output"] != "fixed:1"]
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    ax = axes[0]
    labels = [f"{r['shape']} {r['setup']}{tag(r)} C={r['concurrency']}" for r in main]
    ys = [r["qps"] for r in main]
    ax.barh(range(len(ys)), ys, color=[{"raw": "#888", "eng": "#b73"}.get(r["phase"], "#37a") for r in main])
    for i, r in enumerate(main):
        ref = RAW_REFERENCE.get((r["shape"], _setup_key(r)))
        if (ref and r["concurrency"] == RAW_CONCURRENCY[r["shape"]] and r["phase"] != "share"
                and _workload(r) == REFERENCE_WORKLOAD):
            ax.plot([ref[0]], [i], "k|", markersize=14)
        ax.text(r["qps"], i, f" {r['qps']:.0f} QPS, p50 {r['lat_p50']:.2f}s", va="center", fontsize=7)
    ax.set_yticks(range(len(ys)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("QPS (window method); | = raw vLLM reference")
    ax.set_title("gpumesh on H200: QPS by setup")
    ax = axes[1]
    for shape in sorted({r["shape"] for r in sw}):
        rs = sorted((r for r in sw if r["shape"] == shape), key=lambda r: r["concurrency"])
        ax.plot([r["concurrency"] for r in rs], [r["tpot_p50"] * 1000 for r in rs], "o-",
                label=f"{shape} measured (TPOT p50)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (batch)")
    ax.set_ylabel("ms per decode step")
    ax.set_title("decode step time vs batch (direct to node)")
    if sw:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
