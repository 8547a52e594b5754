"""The GPU report's paired tables: interleaved rounds against the same round's client split,
message budget on/off, one front end against several, the mesh against raw vLLM per round."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from gpumesh_bench.gpu.records import _call, _call_tagger, _workload, _workload_label, fmt

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
