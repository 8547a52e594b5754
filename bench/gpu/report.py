"""The GPU benchmark's report: markdown tables and plots from ``gpumesh_bench.gpu``'s records.

  python -m gpumesh_bench.gpu report DIR/results.json[.gz]... --md OUT.md --png OUT.png

Every derived line: ratios against the raw reference (``records.RAW_REFERENCE``), the
session's own raw run and the seed's table; data parallel against one GPU at equal p50;
interleaved rounds (``pairs``); per-node heartbeat tables; cores by process group.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gpumesh_bench.gpu.pairs import (
    _frontends_markdown,
    _interleaved_markdown,
    _message_budget_markdown,
    _vs_raw_markdown,
)
from gpumesh_bench.gpu.plot import plot
from gpumesh_bench.gpu.records import (
    RAW_CONCURRENCY,
    RAW_REFERENCE,
    REFERENCE_WORKLOAD,
    SEED_TABLE,
    _by_workload,
    _call,
    _call_tagger,
    _setup_key,
    _workload,
    _workload_label,
    dedupe,
    fmt,
    load_results,
)


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


def cmd_report(a: argparse.Namespace) -> int:
    from gpumesh_bench.gpu.frontdoors.report import doors_markdown
    from gpumesh_bench.gpu.prefix.report import prefix_markdown

    records, meta = load_results(a.files)
    # front-door and cache-aware records have tables of their own
    rest = [r for r in records if "door" not in r and "prefix" not in r]
    k = getattr(a, "from_round", 0)
    md = ((report_markdown(rest, meta) if rest else "") + doors_markdown(records, meta, k)
          + prefix_markdown(records, k))
    if a.md:
        Path(a.md).write_text(md)
    if a.png and rest:
        plot(rest, Path(a.png))
    print(md)
    return 0
