"""Markdown tables and PNG plots of a simulator grid (``grid.jsonl``).

- ``cell_table``: per cell, each policy's metrics as mean ± 95 % CI half-width over seeds.
- ``ratio_table``: per cell, the default policy against least_request, paired per seed
  (same trace): TTFT p50 / p99 and end-to-end p99 ratios (mean ± CI), goodput ratio against
  the best other policy, and whether the targets hold (heterogeneous fleets: TTFT p99 <=
  0.65x, e2e p99 <= 0.9x, TTFT p50 <= 1.1x; homogeneous: TTFT p99 <= 0.8x and TTFT p50,
  e2e p99 <= 1.0x; everywhere goodput >= every other policy's).
- ``plot_fleet``: one PNG per fleet, TTFT p99, e2e p99 and goodput per workload x load, a bar
  per policy with its CI.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from gpumesh_bench.sim.fleets import HETEROGENEOUS
from gpumesh_bench.sim.metrics import mean_ci, ratio_ci

DEFAULT = "predicted_latency"
BASE = "least_request"
SHORT = {"predicted_latency": "predicted (default)", "least_request": "least_request",
         "power_of_two": "power_of_two", "round_robin": "round_robin"}


def load_cells(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """The cells of grid.jsonl files, one record per cell (``grid.merge_records``: a later
    file's policy runs replace an earlier one's)."""
    from gpumesh_bench.sim.grid import merge_records, read_records

    return merge_records(r for p in paths for r in read_records(Path(p)))


def _fmt(mean: float, ci: float, digits: int = 0) -> str:
    if math.isnan(mean):
        return "–"
    if math.isnan(ci):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {ci:.{digits}f}"


def ci_label(cell: dict[str, Any]) -> str:
    """What the ± of a cell's figures spans: fresh workload draws per seed, or (a replayed
    trace, ``trace_replayed``) only the simulator's own randomness on one fixed trace."""
    k = len(cell["seeds"])
    if cell.get("trace_replayed"):
        return (f"mean ± 95 % CI over {k} seeds of the simulator's own randomness on one "
                "fixed trace (heartbeat phases, decision sampling); workload variation is "
                "not in it")
    return f"mean ± 95 % CI over {k} seeds, each a fresh draw of the workload"


def warnings_md(cell: dict[str, Any]) -> str:
    return "".join(f"\n\nWARNING: {w}" for w in cell.get("warnings", []))


def cell_table(cell: dict[str, Any]) -> str:
    # goodput: requests in SLO per second of offered time (first to last arrival)
    cols = [("TTFT p50", "ttft_p50", 1), ("TTFT p90", "ttft_p90", 0), ("TTFT p99", "ttft_p99", 0),
            ("TPOT p50", "tpot_p50", 2), ("e2e p50", "e2e_p50", 0), ("e2e p99", "e2e_p99", 0),
            ("goodput req/s", "goodput", 1), ("in SLO %", "slo_frac", 1)]
    head = "| policy | " + " | ".join(c[0] for c in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for p, a in cell["agg"].items():
        vals = []
        for _, k, d in cols:
            m, ci = a[k]
            if k == "slo_frac":
                m, ci = m * 100, ci * 100
            vals.append(_fmt(m, ci, d))
        lines.append(f"| {SHORT.get(p, p)} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def _per_seed(cell: dict[str, Any], policy: str, metric: str) -> list[float]:
    return [r[metric] for r in cell["runs"][policy]]


def cell_ratios(cell: dict[str, Any]) -> dict[str, Any]:
    """The default policy against least_request and the others (paired per seed)."""
    runs = cell["runs"]
    out: dict[str, Any] = {}
    for m in ("ttft_p50", "ttft_p99", "e2e_p99"):
        out[m] = ratio_ci(_per_seed(cell, DEFAULT, m), _per_seed(cell, BASE, m))
    others = [p for p in runs if p != DEFAULT]
    best = max(others, key=lambda p: mean_ci(_per_seed(cell, p, "goodput"))[0])
    out["goodput_vs"] = best
    out["goodput"] = ratio_ci(_per_seed(cell, DEFAULT, "goodput"), _per_seed(cell, best, "goodput"))
    hetero = cell["fleet"] in HETEROGENEOUS or len(set(cell.get("speeds", [1]))) > 1
    limits = ({"ttft_p99": 0.65, "e2e_p99": 0.9, "ttft_p50": 1.1} if hetero
              else {"ttft_p99": 0.8, "e2e_p99": 1.0, "ttft_p50": 1.0})
    out["limits"] = limits
    out["met"] = {k: out[k][0] <= v for k, v in limits.items()}
    out["met"]["goodput"] = out["goodput"][0] >= 1.0
    return out


def ratio_table(cells: Sequence[dict[str, Any]]) -> str:
    lines = ["| fleet | workload | load | TTFT p50 ÷ LR | TTFT p99 ÷ LR | e2e p99 ÷ LR | "
             "goodput ÷ best other | targets missed |",
             "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        if DEFAULT not in c["runs"] or BASE not in c["runs"] or len(c["runs"]) < 3:
            lines.append(f"| {c['fleet']} | {c['workload']} | {c['load']:.0%} | – | – | – | – | "
                         f"not run yet: only {', '.join(c['runs'])} |")
            continue
        r = cell_ratios(c)
        miss = []
        for k in ("ttft_p50", "ttft_p99", "e2e_p99"):
            if not r["met"][k]:
                miss.append(f"{k.replace('_', ' ')} by {r[k][0] / r['limits'][k] - 1:+.0%}")
        if not r["met"]["goodput"]:
            miss.append(f"goodput {r['goodput'][0] - 1:+.1%} vs {r['goodput_vs']}")

        def f(k: str) -> str:
            m, ci = r[k]
            return f"{m:.2f} ± {ci:.2f}" if not math.isnan(ci) else f"{m:.2f}"
        lines.append(f"| {c['fleet']} | {c['workload']} | {c['load']:.0%} | {f('ttft_p50')} | "
                     f"{f('ttft_p99')} | {f('e2e_p99')} | {f('goodput')} ({r['goodput_vs']}) | "
                     f"{'; '.join(miss) or 'none'} |")
    return "\n".join(lines)


def share_table(cell: dict[str, Any]) -> str:
    speeds = cell.get("speeds") or [1.0] * len(cell["nodes"])
    groups = sorted(set(speeds))
    lines = ["| policy | " + " | ".join(f"share of speed-{s:g} nodes" for s in groups) + " |",
             "|---|" + "---|" * len(groups)]
    for p, a in cell["agg"].items():
        share = a["share"]
        vals = [sum(share.get(n, 0.0) for n, s in zip(cell["nodes"], speeds) if s == g)
                for g in groups]
        lines.append(f"| {SHORT.get(p, p)} | " + " | ".join(f"{v:.1%}" for v in vals) + " |")
    return "\n".join(lines)


def markdown(cells: Sequence[dict[str, Any]]) -> str:
    parts = ["## Default policy against least_request (paired per seed, mean ± 95 % CI)", "",
             ratio_table(cells), ""]
    for c in cells:
        parts += [f"### {c['fleet']} / {c['workload']} at {c['load']:.0%} load "
                  f"({c['rate']:.1f} req/s, {c['requests']} requests x {len(c['seeds'])} seeds)",
                  "", ci_label(c) + warnings_md(c), "", cell_table(c), "", share_table(c), ""]
    return "\n".join(parts)


def plot_fleet(cells: Sequence[dict[str, Any]], out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c['workload']}\n{c['load']:.0%}" for c in cells]
    policies = list(dict.fromkeys(p for c in cells for p in c["agg"]))
    fig, axes = plt.subplots(3, 1, figsize=(max(6, 1.3 * len(cells)), 10), sharex=True)
    width = 0.8 / len(policies)
    for ax, (metric, title) in zip(axes, [("ttft_p99", "TTFT p99 (ms)"),
                                          ("e2e_p99", "end-to-end p99 (ms)"),
                                          ("goodput", "goodput at SLO (req/s)")]):
        for j, p in enumerate(policies):
            nan = (math.nan, math.nan)
            ms = [c["agg"].get(p, {}).get(metric, nan)[0] for c in cells]
            cis = [0 if math.isnan(ci) else ci
                   for ci in (c["agg"].get(p, {}).get(metric, nan)[1] for c in cells)]
            xs = [i + (j - (len(policies) - 1) / 2) * width for i in range(len(cells))]
            ax.bar(xs, ms, width, yerr=cis, label=SHORT.get(p, p), capsize=2)
        ax.set_ylabel(title)
        if metric != "goodput":
            ax.set_yscale("log")
    axes[-1].set_xticks(range(len(cells)), labels, fontsize=8)
    axes[0].legend(fontsize=8, ncol=len(policies))
    fig.suptitle(f"gpumesh sim: {cells[0]['fleet']} ({cells[0]['requests']} requests x "
                 f"{len(cells[0]['seeds'])} seeds per bar)")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def write(cells: Sequence[dict[str, Any]], out_dir: Path) -> tuple[Path, list[Path]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "grid.md"
    md.write_text(markdown(cells) + "\n", encoding="utf-8")
    pngs = []
    for fleet in dict.fromkeys(c["fleet"] for c in cells):
        pngs.append(plot_fleet([c for c in cells if c["fleet"] == fleet],
                               out_dir / f"{fleet}.png"))
    return md, pngs
