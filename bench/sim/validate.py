"""The simulator against live fleets on the same trace.

``gpumesh sim validate`` (:func:`validate`): the fidelity check against REAL engines. One
``LiveFleet`` (``gpumesh_bench.livefleet``: real vLLM engines behind one real gpumesh router
per policy) and the simulator run the same traces (``fidelity_trace``: arrival times, prompts
with their shared-prefix structure, output lengths). The simulator's engines take an engine
profile: ``--profile FILE`` (the TOML ``gpumesh calibrate`` writes), else a step model fitted
just before the runs on the same live engines (``gpumesh_bench.livecal``). For every workload
and policy the live run goes first (the policies' order rotated per workload, each run after
the fleet is idle and on its own salt of the trace, so that no run finds another's prompts
in the engines' prefix caches), then the simulator replays the trace on the mirrored fleet
(``fidelity.sim_fleet``). Output: ``OUT/validate.json`` (every number, the per-request live
results, the profile, the command) and ``OUT/validate.md`` (``fidelity.markdown``).

:func:`compare` (``python -m gpumesh_bench.sim.validate DIR``) is the older check against
the live fleet of SIMULATED nodes. Input: the output folder of ``gpumesh bench compare-policies`` (``compare.json`` and its
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
import sys
import time
from pathlib import Path
from typing import Any

from gpumesh_bench.sim import fleets
from gpumesh_bench.sim import workloads as wl
from gpumesh_bench.sim.core import simulate
from gpumesh_bench.sim.metrics import SLOSpec, mean_ci, run_metrics

LIVE_POLICIES = "least_request,predicted_latency,round_robin"   # validate's default
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


# --- the fidelity check against real engines (`gpumesh sim validate`) --------------------

def add_arguments(p: Any) -> None:
    """``gpumesh sim validate``'s options (docs/simulator.md, "Fidelity")."""
    p.add_argument("--model", default="models/tiny",
                   help="model folder the live engines serve (models/tiny is built if absent)")
    p.add_argument("--workloads", default="shared-prefix,unique")
    p.add_argument("--policies", default="",
                   help=f"default {LIVE_POLICIES}; with --merge: only these policies' live "
                        "runs (default every one)")
    p.add_argument("--requests", type=int, default=2000, help="per live run")
    p.add_argument("--rate", default="8",
                   help="req/s of the trace: one value, or one per workload (R1,R2)")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--cores", default="0,1",
                   help="one CPU core per engine (vLLM CPU pinning); '' on CUDA")
    p.add_argument("--router-cpus", default="", help="taskset list for the routers")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a vllm AsyncEngineArgs field for every engine (repeatable); default "
                        "max_num_seqs=64, max_num_batched_tokens=2048")
    p.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of every node (default VLLM_CPU_KVCACHE_SPACE=1 with "
                        "--cores)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--profile", default="",
                   help="engine profile for the simulator: a TOML file (gpumesh calibrate) "
                        "or a built-in name (tiny-cpu); default: fitted on the live engines "
                        "first")
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sim-seeds", type=int, default=3)
    p.add_argument("--step-scale", type=float, default=1.0,
                   help="with --merge: multiply the profile's step terms by this (a step "
                        "model fitted in place on a live run, docs/simulator.md#fidelity)")
    p.add_argument("--serving", default="",
                   help="with --merge: the serving path's CPU costs (the [front_end] cpu_* and "
                        "[router] keys) from this profile TOML, on top of the step model "
                        "(docs/simulator.md#fidelity)")
    p.add_argument("--merge", nargs="+", default=[], metavar="VALIDATE.json",
                   help="no live runs: fold earlier validate.json files (e.g. one policy "
                        "each) into one comparison in --out, the simulator re-run with one "
                        "profile (--profile, else the median of the files' fits)")
    p.add_argument("--out", default="bench/sim/results/fidelity")


def _kv(items: list[str], what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or not k:
            raise SystemExit(f"{what} takes KEY=VALUE, got {it!r}")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _live_metrics(results: list[Any], samples: list[dict[str, Any]], n: int,
                  nodes: tuple[str, ...], duration_s: float) -> dict[str, Any]:
    from gpumesh_bench.sim.fidelity import summarize

    ok = [r for r in results if r.status == "OK" and r.ttft_s is not None]
    m = summarize([r.index for r in ok], [r.ttft_s for r in ok], [r.latency_s for r in ok],
                  [r.node_id for r in ok], n, nodes)
    m["errors"] = len(results) - len(ok)
    m["error_samples"] = sorted({f"{r.status}: {r.error}" for r in results
                                 if r.status != "OK"})[:5]
    late = [s for s in samples if s["t"] >= duration_s * 0.2]
    hits = [sum(m["share"][k] * s[k]["hit"] for k in nodes if k in s) for s in late]
    m["prefix_hit"] = sum(hits) / len(hits) if hits else float("nan")
    return m


def _proc_cpu(children: list[Any]) -> dict[str, float]:
    """CPU seconds of every process of the fleet's children, keyed "child/comm/pid" (a
    node's front end and its vLLM engine core apart)."""
    import os

    from gpumesh_bench.fleet import group_pids

    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for c in children:
        for pid in group_pids(c.pid):
            try:
                with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                    head, _, rest = f.read().rpartition(")")
                parts = rest.split()
                out[f"{c.name}/{head.partition('(')[2]}/{pid}"] = (int(parts[11])
                                                                  + int(parts[12])) / tick
            except (OSError, IndexError, ValueError):
                continue
    return out


async def _validate(a: Any, out: Path) -> dict[str, Any]:
    from gpumesh_bench.fleet import group_cpu_s
    from gpumesh_bench.sim.livecal import calibrate
    from gpumesh_bench.sim.livefleet import LiveFleet, LiveSpec, run_trace, token_request
    from gpumesh_bench.sim import fidelity
    from gpumesh_bench.sim import fidelity_trace as ft

    model = Path(a.model)
    if not (model / "config.json").exists() and a.model == "models/tiny":
        from gpumesh.tiny_model import build_tiny_model

        build_tiny_model(model)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    kinds = [w for w in a.workloads.split(",") if w]
    policies = tuple(p for p in (a.policies or LIVE_POLICIES).split(",") if p)
    rates = [float(x) for x in str(a.rate).split(",") if x]
    if len(rates) not in (1, len(kinds)):
        raise SystemExit("--rate: one value or one per workload")
    rates = rates * len(kinds) if len(rates) == 1 else rates
    cores = tuple(c for c in a.cores.split(",") if c)
    engine_args = {"max_num_seqs": 64, "max_num_batched_tokens": 2048,
                   **_kv(a.engine_arg, "--engine-arg")}
    env = {**({"VLLM_CPU_KVCACHE_SPACE": "1"} if cores else {}),
           **{k: str(v) for k, v in _kv(a.engine_env, "--engine-env").items()}}
    spec = LiveSpec(str(model.resolve()), policies, a.engines, cores, "tiny", a.max_model_len,
                    engine_args, env, a.router_cpus)
    doc: dict[str, Any] = {"command": "gpumesh sim validate " + " ".join(a.argv),
                           "live": {"engines": a.engines, "cores": list(cores),
                                    "engine_args": engine_args, "engine_env": env,
                                    "router_cpus": a.router_cpus or "unpinned",
                                    "model": str(model), "max_model_len": a.max_model_len},
                           "trace": {"seed": a.seed, "tenants": a.tenants,
                                     "system_tokens": a.system_tokens},
                           "workloads": {}, "live_runs": {}, "sim_runs": {}}
    fleet = LiveFleet(spec, out / "logs")
    with fleet:
        t0 = time.monotonic()
        await fleet.start()
        doc["live"]["start_s"] = time.monotonic() - t0
        limits = fleet.scheduler_limits()
        loads = await fleet.loads(policies[0])
        kv = min(int(x.kv_capacity_tokens) for x in loads.values()) or 1 << 24
        doc["live"].update(limits, kv_capacity_tokens=kv,
                           node_engines=await fleet.engines(policies[0]))
        if a.profile:
            profile = fidelity.load_profile(a.profile)
        else:
            profile = await calibrate(fleet.node_address(fleet.node_ids[0]), "tiny", vocab,
                                      context=a.system_tokens + 48)
            profile["source"] = "fitted on the live engine e0 (gpumesh_bench.livecal)"
        doc["profile"] = profile
        (out / "profile.toml").write_text(fidelity.profile_toml(profile, doc["live"]),
                                          encoding="utf-8")
        sfleet = fidelity.sim_fleet(
            fleet.node_ids, profile,
            max_num_seqs=limits.get("max_num_seqs", engine_args["max_num_seqs"]),
            max_num_batched_tokens=limits.get("max_num_batched_tokens",
                                              engine_args["max_num_batched_tokens"]),
            kv_capacity_tokens=min(kv, 1 << 24), max_context_length=a.max_model_len)
        salt = 0
        for wi, (kind, rate) in enumerate(zip(kinds, rates, strict=True)):
            w = ft.build(kind, a.requests, rate, a.seed, a.tenants, a.system_tokens)
            ft.save(w, out / f"trace-{kind}.jsonl")
            doc["workloads"][kind] = {"rate": rate, "requests": a.requests,
                                      "duration_s": w.arrivals[-1].arrival_s}
            doc["live_runs"][kind], doc["sim_runs"][kind] = {}, {}
            order = policies[wi % len(policies):] + policies[:wi % len(policies)]
            for pol in order:
                salt += 1
                sw = ft.build(kind, a.requests, rate, a.seed, a.tenants, a.system_tokens, salt)
                msgs = [token_request("tiny", ft.token_ids(x, vocab, a.seed), x.output_tokens,
                                      f"fid-{kind}-{pol}-{x.index}") for x in sw.arrivals]
                await fleet.wait_idle(pol)
                cpu0 = {c.name: group_cpu_s(c.pid) for c in fleet.children}
                procs0 = _proc_cpu(fleet.children)
                t, lg0 = time.monotonic(), time.process_time()
                res, samples = await run_trace(fleet, pol, msgs,
                                               [x.arrival_s for x in sw.arrivals])
                wall = time.monotonic() - t
                lm_loadgen = (time.process_time() - lg0) / wall
                cpu = {k: (group_cpu_s(c.pid) - cpu0[k]) / wall
                       for c in fleet.children if (k := c.name) in cpu0}
                lm = _live_metrics(res, samples, a.requests, fleet.node_ids,
                                   w.arrivals[-1].arrival_s)
                procs1 = _proc_cpu(fleet.children)
                lm["loadgen_cpu_cores"] = lm_loadgen
                lm["cpu_cores_by_process"] = {k: (v - procs0.get(k, 0.0)) / wall
                                              for k, v in procs1.items()}
                lm.update(wall_s=wall, cpu_cores=cpu, salt=salt, hit_samples=samples,
                          requests_raw=[[r.index, round(r.start_s, 5), r.ttft_s and
                                         round(r.ttft_s, 5), round(r.latency_s, 5), r.node_id,
                                         r.output_tokens, r.status] for r in res])
                # the router's own check of its predictions (predicted_latency only)
                lm["prediction"] = await fleet.predictions(pol)
                doc["live_runs"][kind][pol] = lm
                sm = fidelity.simulate_side(sfleet, w, pol, tuple(range(1, a.sim_seeds + 1)))
                doc["sim_runs"][kind][pol] = sm
                print(f"[validate] {kind} {pol}: live ttft p50/p99 {lm['ttft_p50']:.0f}/"
                      f"{lm['ttft_p99']:.0f} ms e2e p50/p99 {lm['e2e_p50']:.0f}/"
                      f"{lm['e2e_p99']:.0f} ms errors {lm['errors']} ({wall:.0f} s); sim "
                      f"{sm['ttft_p50']:.0f}/{sm['ttft_p99']:.0f} {sm['e2e_p50']:.0f}/"
                      f"{sm['e2e_p99']:.0f} busy {sm['busy']:.2f}; prediction "
                      + " ".join(f"{n} x{p['scale']:.2f} err {p['ttft_error_p50']:.2f}"
                                 for n, p in sorted(lm["prediction"].items())),
                      file=sys.stderr, flush=True)
                (out / "validate.json").write_text(json.dumps(doc) + "\n", encoding="utf-8")
    doc["comparison"] = fidelity.compare(doc["live_runs"], doc["sim_runs"])
    return doc


def validate(a: Any) -> int:
    """``gpumesh sim validate`` (module docstring)."""
    import asyncio

    from gpumesh_bench.sim import fidelity

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.merge:
        profile = fidelity.load_profile(a.profile) if a.profile else None
        serving = None
        if a.serving:
            sp = fidelity.load_profile(a.serving)
            serving = {k: sp[k] for k in fidelity.SERVING_KEYS}
        doc = fidelity.merge(a.merge, profile, a.sim_seeds, a.step_scale, serving,
                             [p for p in a.policies.split(",") if p])
        doc["merge_command"] = "gpumesh sim validate " + " ".join(getattr(a, "argv", []))
    else:
        doc = asyncio.run(_validate(a, out))
    md = fidelity.markdown(doc)
    (out / "validate.json").write_text(json.dumps(doc) + "\n", encoding="utf-8")
    head = f"`{doc['command']}`\n\n"
    if doc.get("merge_command"):
        head = f"Live runs: `{doc['command']}`\n\nSimulator: `{doc['merge_command']}`\n\n"
    (out / "validate.md").write_text(head + md, encoding="utf-8")
    sys.stdout.write(md)
    return 0
