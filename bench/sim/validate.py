"""The simulator against the live wall-clock fleet on the same trace.

Input: the output folder of ``gpumesh bench compare-policies`` (``compare.json`` and its
``trace-<fleet>-<workload>.jsonl``), which ran simulated nodes as real processes with gRPC,
heartbeats and routers, ``time_scale`` T times slower than simulated time. For every live run
(fleet, workload, load, policy) the simulator replays the same first N requests of the same
trace at the same rate (x T: simulated seconds), on the same fleet (the ``0.5b`` shape the
live nodes run, their KV and batch limits, heartbeats every 0.25 s / T), and the live
latencies (wall ms / T) are set beside the simulated ones: TTFT and end-to-end p50 and p99,
and their ratio sim / live.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpumesh_bench.sim import fleets
from gpumesh_bench.sim import workloads as wl
from gpumesh_bench.sim.core import simulate
from gpumesh_bench.sim.metrics import SLOSpec, mean_ci, run_metrics

LIVE_FLEETS = {"hetero-eqkv": ("hetero-speed", False), "hetero-kvspeed": ("hetero-speed", True),
               "homo": ("homo", False)}


def live_fleet(name: str, time_scale: float, kv_tokens: int = 8192,
               max_num_seqs: int = 32) -> fleets.FleetSpec:
    """The compare-policies fleet ``name`` as a simulator fleet (module docstring)."""
    base, kv_grows = LIVE_FLEETS[name]
    speeds = fleets.HETERO_SPEEDS if base == "hetero-speed" else (1,) * 8
    groups = [{"count": 1, "speed": float(s), "prefix": f"n{i:02d}",
               "kv_capacity_tokens": int(kv_tokens * (s if kv_grows else 1)) // 16 * 16}
              for i, s in enumerate(speeds)]
    return fleets.from_dict({"name": name, "shape": "0.5b", "heartbeat_interval_s":
                             0.25 / time_scale, "network_delay_s": 0.0,
                             "engine": {"max_num_seqs": max_num_seqs,
                                        "kv_capacity_tokens": kv_tokens,
                                        "max_context_length": 4096}, "group": groups})


def compare(folder: Path, seeds: tuple[int, ...] = (1, 2, 3, 4, 5)) -> list[dict[str, Any]]:
    doc = json.loads((folder / "compare.json").read_text())
    rows = []
    for run in doc["runs"]:
        c = run["config"]
        if c["label"] == "nginx":
            continue
        ts = float(c["time_scale"])
        n = int(run["summary"]["requests"])
        trace = wl.load_trace(folder / f"trace-{c['fleet']}-{c['workload']}.jsonl")
        arrivals = trace.arrivals[:n]
        rate = float(c["rate"]) * ts
        scale = 1.0 / rate   # the trace is at 1 req/s; the live run divided it by its rate
        w = wl.Workload(trace.name, [wl.Arrival(a.index, a.arrival_s * scale, a.prompt_tokens,
                                                a.output_tokens) for a in arrivals], [])
        fleet = live_fleet(c["fleet"], ts)
        per = [run_metrics(simulate(fleet, w, c["label"], s), SLOSpec(), warmup=0.0)
               for s in seeds]
        live = run["summary"]
        row = {"fleet": c["fleet"], "workload": c["workload"], "load": c["load"],
               "policy": c["label"], "requests": n, "time_scale": ts}
        for key, live_key in (("ttft_p50", ("ttft_ms", "p50")), ("ttft_p99", ("ttft_ms", "p99")),
                              ("e2e_p50", ("latency_ms", "p50")),
                              ("e2e_p99", ("latency_ms", "p99"))):
            lv = float(live[live_key[0]][live_key[1]]) / ts
            sm = mean_ci([p[key] for p in per])
            row[key] = {"live": lv, "sim": sm[0], "sim_ci": sm[1], "ratio": sm[0] / lv}
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| fleet | workload | load | policy | requests | TTFT p50 live / sim (ms) | "
             "TTFT p99 live / sim | e2e p50 live / sim | e2e p99 live / sim |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k]['live']:.1f} / {r[k]['sim']:.1f} ({r[k]['ratio']:.2f}x)"
                 for k in ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")]
        lines.append(f"| {r['fleet']} | {r['workload']} | {r['load']:.0%} | {r['policy']} | "
                     f"{r['requests']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(folder: str, out: str = "") -> int:
    rows = compare(Path(folder))
    md = markdown(rows)
    print(md)
    if out:
        Path(out).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(*sys.argv[1:]))
