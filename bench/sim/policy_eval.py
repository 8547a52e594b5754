"""The predictive policy against least_request and the SMG reference, per grid cell, judged by
the routing targets: SLO attainment (the share of requests within the TTFT and TPOT SLO) at
or above least_request's and the SMG reference's (no loss outside the 95 % CI), at least 1.1x
least_request's on heterogeneous fleets at 95 % load, the fastest nodes taking at least their
share of the fleet's capacity, and TTFT p99 at most 0.8x least_request's on heterogeneous
fleets. Ratios are paired per seed (same trace).

``python -m gpumesh_bench.sim.policy_eval GRID.jsonl[.gz] ...`` prints the markdown table.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from typing import Any

from gpumesh_bench.sim import fleets as fleets_mod
from gpumesh_bench.sim.metrics import mean_ci, ratio_ci
from gpumesh_bench.sim.report import load_cells

POLICY, BASE, PEER = "predicted_latency", "least_request", "smg_cache_aware"


def _seeds(cell: dict[str, Any], policy: str, metric: str) -> list[float]:
    return [r[metric] for r in cell["runs"][policy]]


def _fast(cell: dict[str, Any]) -> tuple[set[str], float]:
    """The fastest nodes of the cell's fleet and their share of its capacity (speed); no
    node and 0 on a fleet whose nodes all run at one speed (``hetero-kv``: KV differs)."""
    fleet = fleets_mod.builtin(cell["fleet"])
    if len({n.engine.speed for n in fleet.nodes}) < 2:
        return set(), 0.0
    top = max(n.engine.speed for n in fleet.nodes)
    fast = {n.node_id for n in fleet.nodes if n.engine.speed == top}
    total = sum(n.engine.speed for n in fleet.nodes)
    return fast, sum(n.engine.speed for n in fleet.nodes if n.node_id in fast) / total


def _share(cell: dict[str, Any], policy: str, fast: set[str]) -> float:
    return statistics.fmean(sum(v for k, v in r["share"].items() if k in fast)
                            for r in cell["runs"][policy])


def evaluate(cell: dict[str, Any]) -> dict[str, Any]:
    """The cell's figures and the targets it misses (module doc)."""
    hetero = cell["fleet"] in fleets_mod.HETEROGENEOUS
    slo = {p: mean_ci(_seeds(cell, p, "slo_frac")) for p in (POLICY, BASE, PEER)}
    vs_lr = ratio_ci(_seeds(cell, POLICY, "slo_frac"), _seeds(cell, BASE, "slo_frac"))
    vs_smg = ratio_ci(_seeds(cell, POLICY, "slo_frac"), _seeds(cell, PEER, "slo_frac"))
    p99 = ratio_ci(_seeds(cell, POLICY, "ttft_p99"), _seeds(cell, BASE, "ttft_p99"))
    fast, cap = _fast(cell)
    share = {p: _share(cell, p, fast) for p in (POLICY, BASE)}
    missed = []
    if vs_lr[0] + vs_lr[1] < 1.0:
        missed.append(f"attainment {vs_lr[0]:.2f}x LR")
    if vs_smg[0] + vs_smg[1] < 1.0:
        missed.append(f"attainment {vs_smg[0]:.2f}x SMG")
    if hetero and float(cell["load"]) >= 0.95 and vs_lr[0] < 1.1:
        missed.append(f"attainment {vs_lr[0]:.2f}x LR < 1.1x")
    if fast and share[POLICY] < cap:
        missed.append(f"fast share {share[POLICY]:.0%} < {cap:.0%}")
    if hetero and p99[0] > 0.8:
        missed.append(f"TTFT p99 {p99[0]:.2f}x LR > 0.8x")
    return {"slo": slo, "vs_lr": vs_lr, "vs_smg": vs_smg, "p99": p99, "share": share,
            "cap": cap, "hetero": hetero, "speeds": bool(fast), "missed": missed}


def _pct(m: tuple[float, float]) -> str:
    return f"{100 * m[0]:.1f} ± {100 * m[1]:.1f}"


def _x(m: tuple[float, float]) -> str:
    return f"{m[0]:.2f} ± {m[1]:.2f}"


def table(cells: Sequence[dict[str, Any]]) -> str:
    lines = ["| fleet | workload | load | in SLO %: predicted | least_request | SMG ref. | "
             "predicted ÷ LR | predicted ÷ SMG | TTFT p99 ÷ LR | fastest nodes' share: "
             "predicted / LR (capacity) | targets missed |", "|" + "---|" * 11]
    for c in cells:
        if not all(p in c["runs"] for p in (POLICY, BASE, PEER)):
            continue
        e = evaluate(c)
        share = (f"{e['share'][POLICY]:.0%} / {e['share'][BASE]:.0%} ({e['cap']:.0%})"
                 if e["speeds"] else "—")
        lines.append(f"| {c['fleet']} | {c['workload']} | {float(c['load']):.0%} | "
                     f"{_pct(e['slo'][POLICY])} | {_pct(e['slo'][BASE])} | "
                     f"{_pct(e['slo'][PEER])} | {_x(e['vs_lr'])} | {_x(e['vs_smg'])} | "
                     f"{_x(e['p99'])} | {share} | {'; '.join(e['missed']) or 'none'} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        sys.stderr.write("usage: python -m gpumesh_bench.sim.policy_eval GRID.jsonl[.gz] ...\n")
        return 2
    cells = sorted(load_cells(paths), key=lambda c: (c["workload"], c["fleet"],
                                                     float(c["load"])))
    sys.stdout.write(table(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
