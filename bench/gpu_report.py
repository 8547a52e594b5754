"""The GPU benchmark's report: markdown tables and plots from ``gpumesh_bench.gpu``'s records.

  python -m gpumesh_bench.gpu report DIR/results.json[.gz]... --md OUT.md --png OUT.png

Holds the raw-vLLM reference figures the records are compared with (shared/gpu/README.md)
and every derived line: ratios against the reference, the session's own raw run and the
seed's table; data parallel against one GPU at equal p50; interleaved rounds against the
same round's client split; per-node heartbeat tables; cores by process group.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpumesh_bench.workload import REFERENCE_OUTPUT, REFERENCE_PROMPT

# Raw vLLM 0.26.0 on H200 (shared/gpu/README.md, seed_table.sh, 2026-11-29, nvidia-h200-x2):
# (shape, setup) -> (QPS, p50 latency s, TTFT p50 s or None), input 32, output 256, ignore_eos.
RAW_REFERENCE: dict[tuple[str, str], tuple[float, float, float | None]] = {
    ("0.5b", "1gpu"): (128.0, 0.92, None), ("0.5b", "dp2"): (161.0, 0.72, None),
    ("0.5b", "tp2"): (145.0, 0.84, None),
    ("7b", "1gpu"): (60.0, 3.19, 1.65), ("7b", "dp2"): (137.0, 1.63, 0.09),
    ("7b", "tp2"): (85.0, 2.41, None),
}
RAW_CONCURRENCY = {"0.5b": 128, "7b": 256}
# The seed's table (older GPUs): setup -> (QPS, p50 latency s).
SEED_TABLE = {"1gpu": (20.0, 1.2), "dp2": (38.0, 1.3), "tp2": (22.0, 1.8)}


def _call(rec: dict[str, Any]) -> int | None:
    """The 1-based device call that measured a record (``gpu.py`` records it); None for
    archived records from before it did."""
    return rec.get("call") or None


def _call_tagger(records: list[dict[str, Any]]) -> Callable[[dict[str, Any]], str]:
    """`` (call N)`` for a row's label where the records come from more than one call (one
    results.json several device calls appended to, or several files), else ""."""
    multi = len({_call(r) for r in records} - {None}) > 1
    return lambda r: f" (call {_call(r)})" if multi and _call(r) is not None else ""


def _setup_key(rec: dict[str, Any]) -> str:
    s = rec["setup"]
    if "data parallel" in s:
        return "dp2"
    if "tensor parallel" in s:
        return "tp2"
    return "1gpu"


# The raw reference's workload as (prompt, output) length specs (gpumesh_bench.workload).
REFERENCE_WORKLOAD = (str(REFERENCE_PROMPT), str(REFERENCE_OUTPUT))


def _workload(rec: dict[str, Any]) -> tuple[str, str]:
    """(prompt, output) length specs of a record; older records without them ran the
    reference's workload."""
    return (str(rec.get("prompt") or REFERENCE_WORKLOAD[0]),
            str(rec.get("output") or REFERENCE_WORKLOAD[1]))


def _workload_label(rec: dict[str, Any]) -> str:
    wl = _workload(rec)
    return "reference" if wl == REFERENCE_WORKLOAD else f"{wl[0]} -> {wl[1]}"


def _by_workload(records: list[dict[str, Any]]
                 ) -> dict[tuple[int | None, str, tuple[str, str]], list[dict[str, Any]]]:
    out: dict[tuple[int | None, str, tuple[str, str]], list[dict[str, Any]]] = {}
    for r in records:
        if r["phase"] in ("p05", "p7"):
            out.setdefault((_call(r), r["shape"], _workload(r)), []).append(r)
    return out


def _interleaved_markdown(records: list[dict[str, Any]]) -> list[str]:
    """The interleaved data-parallel rounds (dp05/dp7, ab05/ab7): every bench of a round,
    with its done QPS as a multiple of the client's own split in the same call and round."""
    rows = [r for r in records if r["phase"] in ("dp05", "dp7", "ab05", "ab7")
            and "data parallel" in r["setup"]]
    if not rows:
        return []
    tag = _call_tagger(records)
    splits: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        if "client splits" in r["setup"]:
            splits[(_call(r), r["phase"], r["shape"], _workload(r), r.get("round", 0),
                    r.get("pinned", False))] = r
    lines = [("Interleaved data-parallel rounds (same nodes, benches in the order run; `x split` ="
             " done QPS / the client's own split of the same round; router B = the router with "
             "`--router-env-b`):"), "",
             ("| phase | workload | setup | C | QPS | done QPS | x split | p50 s | p99 s |"
             " TTFT p50 s | TPOT p50 ms | in flight abs(A-B) p50 / max |"
             " running (in flight) per node |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sp = splits.get((_call(r), r["phase"], r["shape"], _workload(r), r.get("round", 0),
                         r.get("pinned", False)))
        xs = (fmt(r["done_qps"] / sp["done_qps"]) if sp and r.get("done_qps") and sp.get("done_qps")
              else "-")
        im = r.get("imbalance") or {}
        imb = (f"{im['in_flight_diff_p50']:.0f} / {im['in_flight_diff_max']:.0f}"
               if "in_flight_diff_p50" in im else "-")
        run = " / ".join(f"{n} {fmt(v.get('running_mean'), 0)}"
                         + (f" ({fmt(v['in_flight_mean'], 0)})" if "in_flight_mean" in v else "")
                         for n, v in sorted((r.get("fleet") or {}).items()))
        tpot = r.get("tpot_p50")
        lines.append(f"| {r['phase']} | {_workload_label(r)} | {r['setup']}{tag(r)} | "
                     f"{r['concurrency']} | "
                     f"{fmt(r['qps'], 1)} | {fmt(r.get('done_qps'), 1)} | {xs} | "
                     f"{fmt(r['lat_p50'])} | {fmt(r.get('lat_p99'))} | {fmt(r.get('ttft_p50'), 3)} | "
                     f"{fmt(tpot * 1000 if tpot else None)} | {imb} | {run or '-'} |")
    lines.append("")
    return lines


def _msg_pair(r: dict[str, Any]) -> tuple[tuple[Any, ...], str]:
    """A msg05/msg7 record's pair key (call, phase, base setup, round) and its leg ("budget"
    or "fixed"): the fields gpu.py records; archived records without them, from the setup
    label ("<base>, message budget #k" / "<base>, fixed 20 ms #k") and the asked interval."""
    if "leg" in r:
        base, leg = r["base_setup"], r["leg"]
    elif r.get("flush_interval_ms"):
        base, leg = r["setup"].split(", fixed")[0], "fixed"
    else:
        base, leg = r["setup"].split(", message budget")[0], "budget"
    return (_call(r), r["phase"], base, r.get("round", 0)), leg


def _message_budget_markdown(records: list[dict[str, Any]]) -> list[str]:
    """msg05/msg7: the node's stream-message budget against the fixed interval on the same
    nodes, interleaved; ``x fixed`` = done QPS / the fixed-interval bench of the same call,
    setup and round."""
    return _legs_markdown(
        records, ("msg05", "msg7"), _msg_pair, "fixed", "x fixed",
        "The node's stream-message budget vs a fixed interval (same nodes, interleaved; "
        "`x fixed` = done QPS / the fixed-interval bench of the same round):")


def _fe_pair(r: dict[str, Any]) -> tuple[tuple[Any, ...], str]:
    return (_call(r), r["phase"], r["base_setup"], r.get("round", 0)), r["leg"]


def _frontends_markdown(records: list[dict[str, Any]]) -> list[str]:
    """fe05/fe7: nodes with several front-end processes against one (fresh nodes per leg);
    ``x 1 front end`` = done QPS / the one-front-end bench of the same call, setup, round."""
    return _legs_markdown(
        records, ("fe05", "fe7"), _fe_pair, "fe1", "x 1 front end",
        "Nodes with several front-end processes vs one (fresh nodes per leg, legs "
        "alternating; `x 1 front end` = done QPS / the one-front-end bench of the same "
        "round; node front end cores = each node's front-end processes together):")


VSRAW_PHASES = ("vsraw05", "vsraw7", "vsrawdp05", "vsrawdp7")


def _vs_raw_markdown(records: list[dict[str, Any]]) -> list[str]:
    """vsraw05/vsraw7/vsrawdp05/vsrawdp7: the nodes direct and through the router (and with
    ``--vs-eng`` the node's engine without gRPC) against the raw reference tool run on the
    same GPUs in the same round; ``x raw`` = QPS / that raw run's QPS (the reference's
    metric: requests started and finished in the window), with the median of each leg over
    the rounds, and the median of raw's p50 latency over the leg's (not quantised by waves).
    """
    lines = _legs_markdown(
        records, VSRAW_PHASES, _fe_pair, "raw", "x raw",
        "The mesh against raw vLLM on the same GPUs (every engine at the same share of its "
        "GPU's memory: 0.42, or 0.28 with a variant's nodes (`, variant`: "
        "`--vs-variant` engine arguments) also up; one loaded at a time; legs alternating per "
        "round; `x raw` = QPS / the raw run of the same round):",
        metric="qps")
    if not lines:
        return lines
    raws = {_fe_pair(r)[0]: r for r in records
            if r["phase"] in VSRAW_PHASES and r.get("leg") == "raw"}
    ratios: dict[tuple[Any, ...], list[float]] = {}
    by_latency: dict[tuple[Any, ...], list[float]] = {}
    for r in records:
        if r["phase"] not in VSRAW_PHASES or r.get("leg") in (None, "raw"):
            continue
        key, leg = _fe_pair(r)
        raw = raws.get(key)
        if raw and raw.get("qps") and r.get("qps") is not None:
            ratios.setdefault((_call(r), r["phase"], leg), []).append(r["qps"] / raw["qps"])
            if raw.get("lat_p50") and r.get("lat_p50"):
                by_latency.setdefault((_call(r), r["phase"], leg), []).append(
                    raw["lat_p50"] / r["lat_p50"])

    def listed(xs: list[float]) -> str:
        return f"**{fmt(statistics.median(xs))}** over {len(xs)} round(s) " \
               f"({', '.join(fmt(x) for x in xs)})"
    # QPS counts requests that started and ended in the window: on the reference's fixed
    # lengths a closed loop's streams end in waves of C, so QPS moves in steps of C / window
    # (~8% of a 0.5B run). At a fixed C, throughput ~ C / latency: raw's p50 over the leg's
    # is the same comparison without those steps.
    for k, xs in sorted(ratios.items(), key=lambda kv: str(kv[0])):
        call, phase, leg = k
        lat = by_latency.get(k)
        lines.append(f"- {phase}{f' (call {call})' if call else ''}, {leg}: median x raw "
                     f"{listed(xs)}" + (f"; raw p50 / p50 {listed(lat)}" if lat else ""))
    return lines + [""] if ratios else lines


def _legs_markdown(records: list[dict[str, Any]], phases: tuple[str, ...],
                   pair: Callable[[dict[str, Any]], tuple[tuple[Any, ...], str]],
                   base_leg: str, x_label: str, title: str,
                   metric: str = "done_qps") -> list[str]:
    """A/B legs of ``phases``: every record's ``metric`` over its pair key's ``base_leg``
    record's."""
    rows = [r for r in records if r["phase"] in phases]
    if not rows:
        return []
    tag = _call_tagger(records)
    fixed: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        key, leg = pair(r)
        if leg == base_leg:
            fixed[key] = r
    lines = [title, "",
             (f"| phase | setup | C | QPS | done QPS | {x_label} | p50 s | p99 s | TTFT p50 s |"
              " TPOT p50 ms | node front end cores | router cores |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        key, leg = pair(r)
        f = fixed.get(key) if leg != base_leg else None
        xf = (fmt(r[metric] / f[metric]) if f and r.get(metric) is not None and f.get(metric)
              else "-")
        cc = r.get("cpu_cores") or {}
        fe = " / ".join(f"{v:.2f}" for k, v in cc.items() if k.endswith("front end") and v >= 0.05)
        rt = " / ".join(f"{v:.2f}" for k, v in cc.items()
                        if k.startswith("router") and "busiest" not in k and v >= 0.05)
        tpot = r.get("tpot_p50")
        lines.append(f"| {r['phase']} | {r['setup']}{tag(r)} | {r['concurrency']} | "
                     f"{fmt(r['qps'], 1)} | "
                     f"{fmt(r.get('done_qps'), 1)} | {xf} | {fmt(r['lat_p50'])} | "
                     f"{fmt(r.get('lat_p99'))} | {fmt(r.get('ttft_p50'), 3)} | "
                     f"{fmt(tpot * 1000 if tpot else None)} | {fe or '-'} | {rt or '-'} |")
    lines.append("")
    return lines


def fmt(x: Any, nd: int = 2) -> str:
    """A number for a table cell: ``nd`` decimals, "-" for None or NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{nd}f}"


def dedupe(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last record of each (call, phase, setup, shape, C, prompt, output): a rerun within
    one call replaces; another call's records stay (each row says its call)."""
    last: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in records:
        last[(_call(r), r["phase"], r["setup"], r["shape"], r["concurrency"], r.get("prompt"),
              r.get("output"))] = r
    return list(last.values())


def report_markdown(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    records = dedupe(records)
    tag = _call_tagger(records)
    lines: list[str] = []
    main = [r for r in records if r["phase"] in ("p05", "p7", "tp05", "tp7", "share", "raw", "eng")]
    # "x raw (session)": the raw run of the row's own call, else the last raw run
    raw_in: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in records:
        if r["phase"] == "raw":
            raw_in[(_call(r), r["shape"], _setup_key(r))] = r
            raw_in[("last", r["shape"], _setup_key(r))] = r
    if main:
        lines += [("| shape | setup | C | workload | QPS | done QPS | p50 s | p99 s | TTFT p50 s |"
                   " TPOT p50 ms | raw vLLM ref QPS / p50 | x raw ref | x raw (session) |"
                   " x seed QPS | errors |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in main:
            key = _setup_key(r)
            ref = RAW_REFERENCE.get((r["shape"], key))
            # the references' ratios only where the workload and the concurrency are theirs
            same_c = (r["concurrency"] == RAW_CONCURRENCY.get(r["shape"])
                      and _workload(r) == REFERENCE_WORKLOAD)
            xref = fmt(r["qps"] / ref[0]) if ref and same_c and r["phase"] != "share" else "-"
            ses = raw_in.get((_call(r), r["shape"], key)) or raw_in.get(("last", r["shape"], key))
            xses = (fmt(r["qps"] / ses["qps"]) if ses and same_c and r["phase"] != "raw"
                    else "-")
            seed = SEED_TABLE.get(key)
            xseed = fmt(r["qps"] / seed[0], 1) if seed and same_c else "-"
            tpot = r.get("tpot_p50")
            lines.append(
                f"| {r['shape']} | {r['setup']}{tag(r)} | {r['concurrency']} | "
                f"{_workload_label(r)} | {fmt(r['qps'], 1)} | "
                f"{fmt(r.get('done_qps'), 1)} | {fmt(r['lat_p50'])} | {fmt(r.get('lat_p99'))} | "
                f"{fmt(r.get('ttft_p50'), 3)} | {fmt(tpot * 1000 if tpot else None)} | "
                f"{f'{ref[0]:g} / {ref[1]:g}' if ref and same_c else '-'} | {xref} | {xses} | "
                f"{xseed} | {r.get('errors', 0)} |")
        lines.append("")
        # data parallel at equal p50: DP at 2C vs one GPU at C, each workload on its own
        for (_, shape, wl), rs in _by_workload(records).items():
            c2 = 2 * RAW_CONCURRENCY[shape]
            ones = [r for r in rs if r["setup"] == "1 GPU, through router"]
            directs = [r for r in rs if r["setup"] == "1 GPU, direct to node"]
            dp = [r for r in rs if r["concurrency"] == c2
                  and r["setup"] == "2 GPUs data parallel, router"]
            dd = [r for r in rs if r["concurrency"] == c2
                  and r["setup"] == "2 GPUs data parallel, direct (client splits)"]
            if not (ones and dp):
                continue
            o, d = ones[-1], dp[-1]
            what = (tag(o) + ("" if wl == REFERENCE_WORKLOAD
                              else f" (workload {wl[0]} -> {wl[1]})"))
            lines.append(f"- {shape}{what}: data parallel through the router at "
                         f"C={d['concurrency']} gives {d['qps']:.1f} QPS at p50 "
                         f"{d['lat_p50']:.2f} s vs one GPU through the router at "
                         f"C={o['concurrency']}: {o['qps']:.1f} QPS at p50 {o['lat_p50']:.2f} s "
                         f"-> **{d['qps'] / max(o['qps'], 1e-9):.2f}x** "
                         f"(target >= 1.9x at equal p50).")
            if directs:
                x = directs[-1]
                lines.append(f"  Against one GPU direct to the node ({x['qps']:.1f} QPS at p50 "
                             f"{x['lat_p50']:.2f} s): {d['qps'] / max(x['qps'], 1e-9):.2f}x.")
            if dd:
                x = dd[-1]
                lines.append(f"  Without the router (the client splits {c2} streams over the "
                             f"two nodes): {x['qps']:.1f} QPS at p50 {x['lat_p50']:.2f} s "
                             f"({x['qps'] / max(o['qps'], 1e-9):.2f}x one GPU); the router "
                             f"gives {d['qps'] / max(x['qps'], 1e-9):.2f}x of that.")
        lines.append("")
    lines += _interleaved_markdown(records)
    lines += _message_budget_markdown(records)
    lines += _frontends_markdown(records)
    lines += _vs_raw_markdown(records)
    for uph, where in (("unequal", "both nodes on GPU 0"), ("unequal2", "one GPU each")):
        une = [r for r in records if r["phase"] == uph]
        if not une:
            continue
        lines += [f"Policies on an unequal pair ({where}; `small` has a cut KV cache):", "",
                  "| policy | C | QPS | done QPS | p50 s | p99 s | TTFT p50 s | TTFT p99 s | share big/small | KV max big/small |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in une:
            sh = r.get("node_share", {})
            fl = r.get("fleet", {})
            kvs = "/".join(fmt(fl.get(n, {}).get("kv_max"), 2) for n in ("big", "small"))
            lines.append(f"| {r.get('policy')}{tag(r)} | {r['concurrency']} | {fmt(r['qps'], 1)} | "
                         f"{fmt(r.get('done_qps'), 1)} | {fmt(r['lat_p50'])} | {fmt(r['lat_p99'])} | "
                         f"{fmt(r['ttft_p50'], 3)} | {fmt(r['ttft_p99'], 3)} | "
                         f"{sh.get('big', 0)}/{sh.get('small', 0)} | {kvs} |")
        lines.append("")
    cpu_rows = [r for r in records if r.get("cpu_cores")]
    if cpu_rows:
        lines += [("Cores used during the window (CPU seconds / window s; `engine` = vLLM's "
                   "engine core and workers, `front end` = the node process):"), "",
                  "| shape | setup | C | cores by process group | machine |", "|---|---|---|---|---|"]
        for r in cpu_rows:
            cc = dict(r["cpu_cores"])
            total = cc.pop("machine (all processes)", None)
            lines.append(f"| {r['shape']} | {r['setup']}{tag(r)} | {r['concurrency']} | "
                         + ", ".join(f"{k} {v:.2f}" for k, v in cc.items() if v >= 0.05)
                         + f" | {fmt(total)} |")
        lines.append("")
    sw = [r for r in records if r["phase"] == "sweep"]
    if sw:
        lines += [("Sweep on one node, direct (decode: TPOT p50 = step time at batch ~C; "
                  "prefill: TTFT p50 of one request):"), "",
                  "| shape | probe | C | prompt | output | QPS | TTFT p50 ms | TPOT p50 ms | gen tok/s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in sw:
            tp = r.get("tpot_p50")
            lines.append(f"| {r['shape']} | {r['setup']}{tag(r)} | {r['concurrency']} | {r['prompt']} | "
                         f"{r['output']} | {fmt(r['qps'], 1)} | {fmt(r['ttft_p50'] * 1000, 1)} | "
                         f"{fmt(tp * 1000 if tp else None)} | {fmt(r.get('out_tok_s'), 0)} |")
        lines.append("")
    fleet_rows = [(r, n, v) for r in records for n, v in (r.get("fleet") or {}).items()
                  if r["phase"] in ("p05", "p7", "share", "tp05", "tp7")]
    if fleet_rows:
        lines += ["Heartbeats during the window (as the router saw them):", "",
                  "| shape | setup | C | node | KV mean / max | running mean | in flight mean | decode step ms | gen tok/s mean | GPU util mean | GPU mem GiB | GPU |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r, n, v in fleet_rows:
            # older records have neither the node's in-flight mean nor its decode step
            lines.append(f"| {r['shape']} | {r['setup']}{tag(r)} | {r['concurrency']} | {n} | "
                         f"{fmt(v['kv_mean'], 3)} / {fmt(v['kv_max'], 3)} | {fmt(v['running_mean'], 0)} | "
                         f"{fmt(v.get('in_flight_mean'), 0)} | {fmt(v.get('step_ms_mean') or None)} | "
                         f"{fmt(v['tok_s_mean'], 0)} | {fmt(v['gpu_util_mean'] * 100, 0)}% | "
                         f"{fmt(v['gpu_mem_gib'], 1)} | {v.get('gpu_model', '')} |")
        lines.append("")
    if meta.get("kv_tokens"):
        lines.append("KV capacity logged by vLLM (tokens): " + ", ".join(
            f"{k} {v:,}" for k, v in sorted(meta["kv_tokens"].items())))
        lines.append("")
    # A phase skipped by one call and run by a later call on the same results is not "not run".
    ran = {r["phase"] for r in records} | ({"p05"} if any(r["phase"] == "sweep" for r in records)
                                          else set())
    not_run = sorted({p for p in meta.get("not_run", []) if p not in ran})
    failed = [f for f in meta.get("failed", []) if f.split(":")[0] not in ran]
    for k, v in (("not run", not_run), ("failed", failed)):
        if v:
            lines.append(f"**{k}**: " + "; ".join(v))
    return "\n".join(lines) + "\n"


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


def cmd_report(a: argparse.Namespace) -> int:
    records: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    for f in a.files:
        # the archived results in docs/gpu are gzipped (they travel with every device call)
        raw = Path(f).read_bytes()
        doc = json.loads(gzip.decompress(raw) if f.endswith(".gz") else raw)
        # a record's call indexes the merged meta["calls"]: shift it by the earlier files' calls
        shift = len(meta.get("calls", []))
        records += [{**r, "call": r["call"] + shift} if _call(r) and shift else r
                    for r in doc["records"]]
        for k, v in doc.get("meta", {}).items():
            if isinstance(v, dict):
                meta.setdefault(k, {}).update(v)
            elif isinstance(v, list):
                meta.setdefault(k, []).extend(v)
            else:
                meta[k] = v
    md = report_markdown(records, meta)
    if a.md:
        Path(a.md).write_text(md)
    if a.png:
        plot(records, Path(a.png))
    print(md)
    return 0
