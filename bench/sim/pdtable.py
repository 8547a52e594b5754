"""The disaggregation table: when do prefill and decode pools beat aggregated serving on the
same GPUs? (``gpumesh sim pd``; docs/simulator.md has the table and the command.)

For each workload (``prompt-N``: prompts of about N tokens, outputs of about 128; or any named
workload) the aggregated fleet (``agg``: G nodes of role ``both``) is measured at saturation
(:func:`capacity`), and every split (``PpDd``: P prefill and D decode nodes, P + D = G) runs at
the same request rates, ``load`` x that capacity: equal GPUs and equal offered throughput.
Per seed, every split replays the same requests (paired), so the ratios to ``agg`` come with
the confidence interval of the paired ratio. Each node is the ``shape`` engine profile as it
is (its KV cache, ``max_num_batched_tokens``), with ``max_num_seqs`` and the context length
set here; one router, the router's default policy (``RoutingSettings().policy``) for whole
requests, the simulator's pool choice and rule (``pools``) for disaggregated ones.

SLO (goodput and attainment): TTFT within max(100 ms, 3 x a lone request's prefill of the
workload's median prompt on the profile), TPOT within ``tpot_ms`` (default 15 ms).
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpumesh.profiles import builtin_profile
from gpumesh.router.scheduling.settings import RoutingSettings
from gpumesh_bench.sim import fleets
from gpumesh_bench.sim import workloads as wl
from gpumesh_bench.sim.core import Simulation, simulate
from gpumesh_bench.sim.metrics import SLOSpec, aggregate, mean_ci, ratio_ci, run_metrics
from gpumesh_bench.sim.pools import KvLink, PdRule
from gpumesh_bench.stats import percentile

POLICY = RoutingSettings().policy   # whole requests: the router's default policy
SPLITS = ("agg", "2P2D", "1P3D", "3P1D")


def parse_split(split: str, gpus: int) -> tuple[int, int]:
    """``agg`` -> (0, 0); ``PpDd`` (``2P2D``) -> (P, D) with P + D = ``gpus``."""
    if split == "agg":
        return 0, 0
    s = split.upper()
    try:
        p, _, d = s.rstrip("D").partition("P")
        pd = int(p), int(d)
    except ValueError as e:
        raise ValueError(f"split {split!r}: expected agg or PpDd, e.g. 2P2D") from e
    if min(pd) < 1 or sum(pd) != gpus:
        raise ValueError(f"split {split!r}: P, D >= 1 and P + D = {gpus}")
    return pd


def fleet(split: str, shape: str, gpus: int, engine: dict[str, Any], link: KvLink,
          rule: PdRule) -> fleets.FleetSpec:
    """The fleet of ``split`` (``agg`` or ``PpDd``) on ``gpus`` nodes of ``shape``."""
    p, d = parse_split(split, gpus)
    groups = ([{"count": gpus, "prefix": "agg"}] if not p else
              [{"count": p, "role": "prefill", "prefix": "pre"},
               {"count": d, "role": "decode", "prefix": "dec"}])
    f = fleets.from_dict({"name": split, "shape": shape, "engine": engine, "group": groups})
    return fleets.with_pd(f, link, rule)


def capacity(f: fleets.FleetSpec, workload: str, seed: int = 1000) -> float:
    """Completions per simulated second of ``f`` at saturation on ``workload``: a closed loop
    through ``least_request`` holding, per node, as many requests as its ``max_num_seqs`` and
    its KV cache allow (at the workload's largest prompt and output), between the 20th and
    80th percentile of completion times."""
    ids = [x.node_id for x in f.nodes]
    probe = wl.build(workload, 3000, 1.0, seed, ids)
    biggest = max(a.prompt_tokens + a.output_tokens for a in probe.arrivals)
    conc = sum(min(x.engine.max_num_seqs, max(1, x.engine.kv_capacity_tokens // biggest))
               for x in f.nodes)
    # enough requests that the closed loop's start-up wave is a small part of the window
    w = wl.Workload(probe.name, wl.build(workload, max(3000, 8 * conc), 1.0, seed, ids).arrivals,
                    [])
    r = simulate(f, w, "least_request", seed, closed_concurrency=conc)
    ends = sorted(x.end_s for x in r.records if not x.error)
    lo, hi = int(0.2 * len(ends)), int(0.8 * len(ends))
    return (hi - lo) / (ends[hi] - ends[lo])


def slo_for(workload: str, shape: str, tpot_ms: float) -> SLOSpec:
    """The workload's SLO (module docstring)."""
    probe = wl.build(workload, 2001, 1.0, 7, ["n"])
    median = int(statistics.median(a.prompt_tokens for a in probe.arrivals))
    lone = builtin_profile(shape).prefill_ms(median)
    return SLOSpec(max(100.0, round(3 * lone, -1)), tpot_ms)


def pd_metrics(sim: Simulation, warmup: float = 0.05) -> dict[str, Any]:
    """A disaggregated run's own figures: the share of measured requests disaggregated, the
    transfer time p50/p99 (ms) and why requests were or were not disaggregated."""
    recs = sim.records[int(len(sim.records) * warmup):]
    moved = [r.transfer_s * 1000 for r in recs if r.prefill_node and not r.error]
    return {"disagg_frac": len(moved) / max(len(recs), 1),
            "transfer_p50": percentile(moved, 50) if moved else math.nan,
            "transfer_p99": percentile(moved, 99) if moved else math.nan,
            "reasons": dict(sim.pd.reasons) if sim.pd is not None else {}}


def run(workloads: Sequence[str], loads: Sequence[float], splits: Sequence[str], *,
        shape: str = "7b-h200", gpus: int = 4, seeds: Sequence[int] = (1, 2, 3),
        n: int = 2000, engine: dict[str, Any] | None = None, link: KvLink = KvLink(),
        rule: PdRule = PdRule(), tpot_ms: float = 15.0,
        log: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """One record per (workload, load, split) (module docstring)."""
    prof = builtin_profile(shape)
    eng = {"max_num_seqs": 256, "kv_capacity_tokens": prof.kv_capacity_tokens,
           "max_context_length": 40960, **(engine or {})}
    if "agg" not in splits:
        splits = ["agg", *splits]
    fl = {s: fleet(s, shape, gpus, eng, link, rule) for s in splits}
    out: list[dict[str, Any]] = []
    for w in workloads:
        cap = capacity(fl["agg"], w)
        slo = slo_for(w, shape, tpot_ms)
        log(f"{w}: aggregated capacity {cap:.2f} req/s, SLO {slo.ttft_ms:g}:{slo.tpot_ms:g} ms")
        for load in loads:
            rate = load * cap
            per: dict[str, list[dict[str, Any]]] = {s: [] for s in splits}
            extra: dict[str, list[dict[str, Any]]] = {s: [] for s in splits}
            for seed in seeds:
                arr = wl.build(w, n, rate, seed, [x.node_id for x in fl["agg"].nodes])
                for s in splits:
                    t0 = time.process_time()
                    sim = Simulation(fl[s], arr, POLICY, seed)
                    per[s].append(run_metrics(sim.run(), slo))
                    extra[s].append({**pd_metrics(sim), "cpu_s": time.process_time() - t0})
            for s in splits:
                rec = {"workload": w, "load": load, "split": s, "shape": shape, "gpus": gpus,
                       "capacity": cap, "rate": rate, "requests": n, "seeds": list(seeds),
                       "policy": POLICY, "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
                       "link": {"gbytes_per_s": link.bandwidth_bytes_per_s / 1e9,
                                "latency_ms": link.latency_s * 1000},
                       "rule": {"min_prompt_tokens": rule.min_prompt_tokens,
                                "stall_weight": rule.stall_weight},
                       "engine": eng, "runs": per[s], "pd_runs": extra[s],
                       "agg": aggregate(per[s]),
                       "disagg_frac": list(mean_ci([x["disagg_frac"] for x in extra[s]])),
                       "transfer_p99": list(mean_ci([x["transfer_p99"] for x in extra[s]]))}
                for m in ("ttft_p99", "tpot_p99", "goodput"):
                    rec[f"{m}_vs_agg"] = list(ratio_ci([x[m] for x in per[s]],
                                                       [x[m] for x in per["agg"]]))
                out.append(rec)
                a = rec["agg"]
                log(f"  {w} load {load} {s}: TTFT p99 {a['ttft_p99'][0]:.0f} ms, TPOT p99 "
                    f"{a['tpot_p99'][0]:.1f} ms, in SLO {a['slo_frac'][0]:.1%}, "
                    f"disaggregated {rec['disagg_frac'][0]:.0%}")
    return out


def _mc(v: Sequence[float], digits: int = 0) -> str:
    m, ci = v
    if math.isnan(m):
        return "-"
    return f"{m:.{digits}f}" + ("" if math.isnan(ci) else f" ± {ci:.{digits}f}")


def markdown(records: Sequence[dict[str, Any]]) -> str:
    """The table: one row per (workload, load, split); ratios against ``agg`` at the same
    rate (mean of the per-seed ratios ± 95 % CI)."""
    lines = ["| workload | load | rate req/s | split | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms "
             "| TPOT p99 ms | goodput req/s | in SLO % | disaggregated % | TTFT p99 ÷ agg "
             "| TPOT p99 ÷ agg |", "|" + "---|" * 13]
    for r in records:
        a = r["agg"]
        agg = r["split"] == "agg"
        lines.append(
            f"| {r['workload']} | {r['load']:g} | {r['rate']:.2f} | {r['split']} | "
            f"{_mc(a['ttft_p50'])} | {_mc(a['ttft_p99'])} | {_mc(a['tpot_p50'], 1)} | "
            f"{_mc(a['tpot_p99'], 1)} | {_mc(a['goodput'], 2)} | "
            f"{_mc([x * 100 for x in a['slo_frac']], 1)} | "
            f"{'-' if agg else _mc([x * 100 for x in r['disagg_frac']])} | "
            f"{'1' if agg else _mc(r['ttft_p99_vs_agg'], 2)} | "
            f"{'1' if agg else _mc(r['tpot_p99_vs_agg'], 2)} |")
    return "\n".join(lines)


def write(records: Sequence[dict[str, Any]], out: Path) -> tuple[Path, Path]:
    """``out/pd.jsonl.gz`` (every record, every seed's metrics) and ``out/pd.md``."""
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "pd.jsonl.gz"
    with gzip.open(raw, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    md = out / "pd.md"
    md.write_text(markdown(records) + "\n", encoding="utf-8")
    return raw, md


def add_arguments(p: Any) -> None:
    """``gpumesh sim pd``'s arguments (an argparse parser)."""
    p.add_argument("--workloads", default="prompt-512,prompt-2048,prompt-8192,prompt-32768",
                   help="prompt-N workloads (prompts of about N tokens) or named ones")
    p.add_argument("--loads", default="0.5,0.8,0.95",
                   help="fractions of the aggregated fleet's capacity, comma-separated")
    p.add_argument("--splits", default=",".join(SPLITS),
                   help="agg and PpDd splits (2P2D: 2 prefill + 2 decode nodes)")
    p.add_argument("--shape", default="7b-h200", help="every node's engine profile")
    p.add_argument("--gpus", type=int, default=4, help="nodes (GPUs) per fleet")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seeds", default="3", help='"N" (seeds 1..N) or "1,4,7"')
    p.add_argument("--requests", type=int, default=2000, help="requests per run")
    p.add_argument("--tpot-ms", type=float, default=15.0, help="the SLO's TPOT bound")
    add_pd_arguments(p)
    p.add_argument("--out", required=True, help="folder for pd.jsonl.gz and pd.md")


def add_pd_arguments(p: Any) -> None:
    """The KV link and the rule (``gpumesh sim pd`` and ``run``); None = the default."""
    p.add_argument("--link-gbytes", type=float, default=None,
                   help="KV link bandwidth, GB/s (default 25: a 200 Gb/s RDMA NIC; 100 GbE "
                        "is 12.5)")
    p.add_argument("--link-latency-ms", type=float, default=None,
                   help="fixed cost of one KV transfer, ms (default 1)")
    p.add_argument("--pd-min-prompt", type=int, default=None,
                   help="prompts shorter than this are served whole (default 256)")
    p.add_argument("--pd-stall-weight", type=float, default=None,
                   help="weight of the decode streams a local prefill would stall against "
                        "the TTFT disaggregating loses (default 0.1)")


def pd_overrides(a: Any, f: fleets.FleetSpec) -> fleets.FleetSpec:
    """``f`` with the link and rule arguments that were given."""
    link = KvLink(f.link.bandwidth_bytes_per_s if a.link_gbytes is None else a.link_gbytes * 1e9,
                  f.link.latency_s if a.link_latency_ms is None else a.link_latency_ms / 1000)
    rule = PdRule(f.pd_rule.min_prompt_tokens if a.pd_min_prompt is None else a.pd_min_prompt,
                  f.pd_rule.stall_weight if a.pd_stall_weight is None else a.pd_stall_weight)
    return fleets.with_pd(f, link, rule)


def command(a: Any) -> int:
    """``gpumesh sim pd``: runs the table, writes ``OUT/pd.jsonl.gz`` and ``OUT/pd.md``."""
    base = pd_overrides(a, fleets.parse_inline("1xboth:" + a.shape))
    seeds = ([int(x) for x in a.seeds.split(",")] if "," in a.seeds
             else list(range(1, int(a.seeds) + 1)))
    for w in a.workloads.split(","):
        wl.check_name(w)
    records: list[dict[str, Any]] = []
    for w in a.workloads.split(","):   # written after each workload: a stopped run keeps them
        records += run([w], [float(x) for x in a.loads.split(",")], a.splits.split(","),
                       shape=a.shape, gpus=a.gpus, seeds=seeds, n=a.requests,
                       engine={"max_num_seqs": a.max_num_seqs}, link=base.link,
                       rule=base.pd_rule, tpot_ms=a.tpot_ms,
                       log=lambda m: print(m, file=sys.stderr, flush=True))
        raw, md = write(records, Path(a.out))
    sys.stdout.write(markdown(records) + f"\n\n{raw}\n{md}\n")
    return 0
