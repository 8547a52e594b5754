"""One bench: a closed loop of the reference workload against a target, measured over the
reference's window, recorded with the fleet's and the host's view of it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gpumesh_bench.gpu.env import Env
from gpumesh_bench.gpu.samplers import CpuSampler, FleetSampler

if TYPE_CHECKING:
    from gpumesh_bench.gpu.affinity import Placement

def bench(env: Env, *, phase: str, setup: str, shape: str, target: str, concurrency: int,
          prompt: str = "", output: str = "", poll: str = "",
          status: bool = False, warmup_s: float | None = None, window_s: float | None = None,
          extra: dict[str, Any] | None = None, split: Sequence[str] = (),
          spread: bool | None = None, placement: Placement | None = None,
          flush_interval_ms: int = 0) -> dict[str, Any]:
    """One closed-loop run; a record with the reference-style window metrics.
    ``spread``: load processes round-robin over the router's workers (None: env's setting).
    ``placement``: pin the process trees to its CPU sets for this run (affinity.Placement).
    ``flush_interval_ms`` > 0: every request asks for that coalescing interval (the node keeps
    it as asked: no message budget); 0: the node's default.

    ``split``: instead of ``target``, these nodes directly, the concurrency and the load
    processes divided evenly between them (a client that spreads its own streams: data
    parallel without a router, the measure of what the router costs at that load)."""
    from gpumesh_bench.multiproc import StreamSpec, run_multi, start_instant
    from gpumesh_bench.loadgen import LoadConfig
    from gpumesh_bench.stats import window_metrics
    from gpumesh_bench.workload import LengthDist, WorkloadSpec

    prompt, output = prompt or env.prompt, output or env.output
    warm = env.warmup_s if warmup_s is None else warmup_s
    win = env.window_s if window_s is None else window_s
    spread = env.spread_workers if spread is None else spread
    procs = max(1, min(env.procs * (2 if concurrency > 256 else 1), concurrency))
    cfg = LoadConfig(target=target, concurrency=concurrency, duration_s=warm + win,
                     timeout_s=180.0, seed=0, progress_s=0.0, label=setup,
                     spread_workers=spread, flush_interval_ms=flush_interval_ms)
    spec = StreamSpec(WorkloadSpec(LengthDist.parse(prompt), LengthDist.parse(output), 0, "", 0.0))
    parts = [(t, concurrency // len(split), max(1, procs // len(split))) for t in split] \
        or [(target, concurrency, procs)]
    cmd = " & ".join(f"gpumesh bench run --target {t} --concurrency {c} --duration {warm + win:g} "
                     f"--prompt {prompt} --output {output} --procs {n} --timeout 180"
                     + (" --spread-workers" if spread else "")
                     + (f" --flush-interval-ms {flush_interval_ms}" if flush_interval_ms else "")
                     for t, c, n in parts)
    t_start = time.time()
    # One start instant for every part (the split's halves start together); the load's clock,
    # the fleet sampler's and the CPU sampler's all count from it.
    t0 = start_instant(max(n for _, _, n in parts))
    sampler = FleetSampler(poll, warm + win / 2 if status else None, origin=t0) if poll else None
    cpu = CpuSampler(t0 + warm, t0 + warm + win)
    with (placement.applied() if placement is not None else contextlib.nullcontext(),
          sampler if sampler is not None else contextlib.nullcontext(), cpu,
          concurrent.futures.ThreadPoolExecutor(len(parts)) as ex):
        runs = list(ex.map(lambda p: run_multi(dataclasses.replace(cfg, target=p[0],
                                                                    concurrency=p[1]),
                                               spec, p[2], start_at=t0), parts))
    res = [r for run in runs for r in run.results]
    ok = [r for r in res if r.status == "OK"]
    nodes: dict[str, int] = {}
    for r in ok:
        if r.start_s >= warm and r.start_s + r.latency_s <= warm + win:
            nodes[r.node_id or "?"] = nodes.get(r.node_id or "?", 0) + 1
    rec: dict[str, Any] = {
        "phase": phase, "setup": setup, "shape": shape, "target": target, "concurrency": concurrency,
        "call": env.call,
        "prompt": prompt, "output": output, "procs": procs, "warmup_s": warm, "window_s": win,
        **window_metrics(res, warm, win),
        "node_share": nodes, "command": cmd, "started": t_start, "engine": env.engine,
        "cpu_cores": cpu.cores}
    if env.engine == "vllm" and env.engine_args:
        rec["engine_args"] = env.engine_args
    if env.node_options:
        rec["node_options"] = env.node_options
    if spread:
        rec["spread_workers"] = True
    if flush_interval_ms:
        rec["flush_interval_ms"] = flush_interval_ms
    if placement is not None:
        rec["cpu_sets"] = placement.describe()
    if sampler is not None:
        rec["fleet"] = sampler.summary(warm, warm + win)
        # every poll, compact, from 2 s before the load's start (t counts from it)
        rec["fleet_polls"] = [[s["t"], s["node"], s["running"], s["waiting"], s["in_flight"],
                               s["tok_s"], round(s["step_s"] * 1000, 2)]
                              for s in sampler.samples if s["t"] >= -2.0]
        imb = sampler.imbalance(warm, warm + win)
        if imb:
            rec["imbalance"] = imb
        if sampler.status_text:
            rec["status_table"] = sampler.status_text
    rec.update(extra or {})
    if res and len(ok) < len(res) / 2:  # a broken setup: stop the phase, keep the GPU's time
        env.records.append(rec)
        env.save()
        raise RuntimeError(f"{setup}: {len(res) - len(ok)} of {len(res)} requests failed: "
                           f"{rec['error_kinds']}")
    env.records.append(rec)
    env.save()
    print(f"[gpu-bench] {phase:8} {setup:28} c={concurrency:<4} qps={rec['qps']:7.1f} "
          f"done_qps={rec['done_qps']:7.1f} p50={rec['lat_p50']:.3f}s p99={rec['lat_p99']:.3f}s "
          f"ttft50={rec['ttft_p50']:.3f}s tpot50={rec['tpot_p50'] * 1000:.2f}ms "
          f"errors={rec['errors']} nodes={nodes}", flush=True)
    if rec.get("imbalance"):
        im = rec["imbalance"]
        print(f"[gpu-bench]          in-flight |A-B| p50 {im['in_flight_diff_p50']:.0f} max "
              f"{im['in_flight_diff_max']:.0f}, waiting A+B mean {im['waiting_sum_mean']:.1f} max "
              f"{im['waiting_sum_max']:.0f}; per node: " + ", ".join(
                  f"{n} run {v['running_mean']:.0f} wait max {v['waiting_max']:.0f}"
                  for n, v in rec.get("fleet", {}).items()), flush=True)
    if cpu.cores:
        print("[gpu-bench]          cores used: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.cores.items()),
              flush=True)
    return rec
