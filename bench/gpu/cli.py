"""``python -m gpumesh_bench.gpu``: ``run`` (phases on this machine, results into OUT) and
``report`` (markdown and plots from results files)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gpumesh_bench.gpu as package
from gpumesh_bench.gpu.frontdoors.phases import (
    DOORS,
    UNEQ_CONCURRENCY,
    doors_need,
    phase_doors,
    phase_uneq,
)
from gpumesh_bench.gpu.frontdoors.report import doors_markdown
from gpumesh_bench.gpu.env import POLICIES, Env
from gpumesh_bench.gpu.group import nvidia_smi, wait_gpus_free
from gpumesh_bench.gpu.phases import (
    _tp_phase,
    phase_ab,
    phase_fe,
    phase_msg,
    phase_p05,
    phase_p05q,
    phase_p7,
    phase_share,
    phase_unequal,
)
from gpumesh_bench.gpu.plot import plot
from gpumesh_bench.gpu.prefix.phases import (
    PREFIX_PHASES,
    PREFIX_SETUPS,
    PrefixWorkload,
    phase_prefix,
    prefix_need,
)
from gpumesh_bench.gpu.prefix.report import prefix_markdown
from gpumesh_bench.gpu.reference import phase_eng, phase_raw
from gpumesh_bench.gpu.report import cmd_report, report_markdown
from gpumesh_bench.gpu.vsraw import VSRAW_LEGS, VSRAW_START_S, phase_vsraw, vsraw_need
from gpumesh_bench.workload import REFERENCE_OUTPUT, REFERENCE_PROMPT

def gpu_count(engine: str) -> int:
    """GPUs on this machine (nvidia-smi); the simulator pretends to have two."""
    return len(gpu_indices()) if engine == "vllm" else 2


def gpu_indices() -> list[str]:
    return [x for x in nvidia_smi("gpu=index").split() if x.strip()]


def device_meta(engine: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"engine": engine, "host_cpus": os.cpu_count(),
                            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if engine == "vllm":
        meta["nvidia_smi"] = nvidia_smi("gpu=index,name,memory.total,driver_version")
        with contextlib.suppress(Exception):
            import importlib.metadata as im

            meta["vllm"] = im.version("vllm")
            meta["torch"] = im.version("torch")
            meta["grpcio"] = im.version("grpcio")
    return meta


def _name_value(kv: str, flag: str) -> tuple[str, Any]:
    """``--engine-arg`` / ``--node-option`` NAME=VALUE: VALUE as JSON, else the string."""
    name, sep, value = kv.partition("=")
    if not sep or not name:
        raise SystemExit(f"{flag} {kv!r}: expected NAME=VALUE")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def cmd_run(a: argparse.Namespace) -> int:
    from gpumesh_bench.gpu.dummy_model import build_dummy_model

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    models = {s: build_dummy_model(Path(a.model_root) / f"qwen-{s}-dummy", s) for s in ("0.5b", "7b")}
    env = Env(out=out, engine=a.engine, models=models, workers=a.workers, procs=a.procs,
              warmup_s=a.warmup, window_s=a.seconds, max_model_len=a.max_model_len,
              sim_time_scale=a.sim_time_scale, small_kv_blocks=a.small_kv_blocks,
              sim_front_end_tok_s=a.sim_front_end_tok_s, sim_max_num_seqs=a.sim_max_num_seqs,
              raw_tool=a.raw_tool, sim_scale_intervals=a.sim_scale_intervals,
              policy=a.policy,
              router_env=dict(kv.split("=", 1) for kv in a.router_env),
              router_env_b=dict(kv.split("=", 1) for kv in a.router_env_b),
              engine_args=dict(_name_value(kv, "--engine-arg") for kv in a.engine_arg),
              node_options=dict(_name_value(kv, "--node-option") for kv in a.node_option),
              spread_workers=a.spread_workers, pin=a.pin, prompt=a.prompt, output=a.output,
              vs_eng=a.vs_eng,
              vs_variant=dict(_name_value(kv, "--vs-variant") for kv in a.vs_variant),
              vs_legs=tuple(x for x in a.vs_legs.split(",") if x))
    unknown = set(env.vs_legs) - set(VSRAW_LEGS)
    if unknown:
        raise SystemExit(f"--vs-legs: unknown leg(s) {sorted(unknown)}; legs: {VSRAW_LEGS}")
    prev = out / "results.json"
    if prev.exists():  # a later call on the same out dir adds to it
        doc = json.loads(prev.read_text())
        env.records, env.meta = doc.get("records", []), doc.get("meta", {})
    gpus = gpu_count(a.engine)
    env.meta.setdefault("calls", []).append({**device_meta(a.engine), "gpus": gpus,
                                             "phases": a.phases, "workers": a.workers,
                                             "procs": a.procs,
                                             "engine_args": env.engine_args,
                                             "node_options": env.node_options,
                                             "router_env_b": env.router_env_b,
                                             "spread_workers": env.spread_workers,
                                             "vs_variant": env.vs_variant,
                                             "vs_legs": env.vs_legs,
                                             "pin": env.pin, "prompt": env.prompt,
                                             "output": env.output})
    env.call = len(env.meta["calls"])
    env.save()
    budget_end = env.budget_end = time.monotonic() + a.budget if a.budget > 0 else math.inf
    # Rough worst cases (s) of each phase, so a bounded run stops before its end, not in a phase.
    # eng05/eng7: one engine start, then two at once (raw7, a phase of that shape, took 155 s).
    need = {"raw": 90, "raw7": 200, "rawdp05": 150, "p05": 290, "p05q": 170, "share": 100, "unequal": 150, "unequal2": 150,
            "tp05": 120, "p7": 260, "tp7": 150, "ab7": 230, "ab05": 200, "dp05": 120,
            "dp7": 330, "eng05": 160, "eng7": 200, "msg05": 300, "msg7": 400,
            "fe05": 300, "fe7": 420,
            **{ph: doors_need(ph) for ph in ("doors05", "doors7", "uneq05")},
            **{ph: prefix_need(env, ph) for ph in PREFIX_PHASES},
            # the node's start and one round (the phase stops before a round that won't fit)
            **{ph: vsraw_need(ph, env) for ph in VSRAW_START_S}}
    failed = []
    doors = tuple(d for d in a.doors.split(",") if d)
    door_engines = tuple(sorted({int(x) for x in a.door_engines.split(",") if x}))
    prefix_setups = tuple(x for x in a.prefix_setups.split(",") if x)
    if not prefix_setups or set(prefix_setups) - set(PREFIX_SETUPS):
        raise SystemExit(f"--prefix-setups: a comma list of {', '.join(PREFIX_SETUPS)}")
    if not door_engines or set(door_engines) - {1, 2}:
        raise SystemExit(f"--door-engines: 1, 2 or 1,2 (not {a.door_engines!r})")
    if set(doors) - set(DOORS):
        raise SystemExit(f"--doors: unknown {sorted(set(doors) - set(DOORS))}; doors: {DOORS}")
    for ph in [p for p in a.phases.split(",") if p]:
        left = budget_end - time.monotonic()
        if left < need.get(ph, 60):
            print(f"[gpu-bench] {ph}: NOT RUN ({left:.0f}s left of the budget, needs ~{need[ph]}s)")
            env.meta.setdefault("not_run", []).append(ph)
            continue
        if ph in ("tp05", "tp7", "unequal2", "vsrawdp05", "vsrawdp7") and gpus < 2:
            print(f"[gpu-bench] {ph}: NOT RUN (needs 2 GPUs, {gpus} here)")
            env.meta.setdefault("not_run", []).append(ph)
            continue
        t = time.monotonic()
        print(f"[gpu-bench] === phase {ph}"
              + (f" ({left:.0f}s of budget left)" if math.isfinite(left) else ""), flush=True)
        try:
            {"raw": lambda: phase_raw(env), "raw7": lambda: phase_raw(env, "7b", gpus >= 2),
             "rawdp05": lambda: phase_raw(env, "0.5b", gpus >= 2), "p05": lambda: phase_p05(env, gpus),
             "p05q": lambda: phase_p05q(env, gpus), "share": lambda: phase_share(env),
             "unequal": lambda: phase_unequal(env),
             "unequal2": lambda: phase_unequal(env, gpus, "unequal2"),
             "tp05": lambda: _tp_phase(env, "0.5b", "tp05"), "p7": lambda: phase_p7(env, gpus),
             "tp7": lambda: _tp_phase(env, "7b", "tp7"),
             "ab7": lambda: phase_ab(env, "7b", gpus, "ab7"),
             "ab05": lambda: phase_ab(env, "0.5b", gpus, "ab05"),
             "dp05": lambda: phase_ab(env, "0.5b", gpus, "dp05", rounds=a.rounds,
                                      dp_only=True),
             "dp7": lambda: phase_ab(env, "7b", gpus, "dp7", rounds=a.rounds,
                                     dp_only=True),
             "eng05": lambda: phase_eng(env, "0.5b", gpus),
             "eng7": lambda: phase_eng(env, "7b", gpus),
             "msg05": lambda: phase_msg(env, "0.5b", gpus, "msg05", rounds=a.rounds),
             "msg7": lambda: phase_msg(env, "7b", gpus, "msg7", rounds=a.rounds),
             "fe05": lambda: phase_fe(env, "0.5b", gpus, "fe05", rounds=a.fe_rounds,
                                      counts=(1, a.frontends)),
             "fe7": lambda: phase_fe(env, "7b", gpus, "fe7", rounds=a.fe_rounds,
                                     counts=(1, a.frontends)),
             "doors05": lambda: phase_doors(env, "0.5b", "doors05", rounds=a.rounds,
                                            doors=doors, concurrency=a.door_concurrency,
                                            engines=door_engines),
             "doors7": lambda: phase_doors(env, "7b", "doors7", rounds=a.rounds,
                                           doors=doors, concurrency=a.door_concurrency,
                                           engines=door_engines),
             "uneq05": lambda: phase_uneq(env, rounds=a.rounds,
                                           concurrency=a.door_concurrency or UNEQ_CONCURRENCY),
             **{pp: (lambda pp=pp: phase_prefix(env, pp, rounds=a.rounds, work=PrefixWorkload(
                 tenants=a.prefix_tenants, system_words=a.prefix_system_words,
                 concurrency=a.prefix_concurrency), setups=prefix_setups))
                 for pp in PREFIX_PHASES},
             "vsraw05": lambda: phase_vsraw(env, "0.5b", "vsraw05", rounds=a.rounds),
             "vsraw7": lambda: phase_vsraw(env, "7b", "vsraw7", rounds=a.rounds),
             "vsrawdp05": lambda: phase_vsraw(env, "0.5b", "vsrawdp05", rounds=a.rounds,
                                              dp=True),
             "vsrawdp7": lambda: phase_vsraw(env, "7b", "vsrawdp7", rounds=a.rounds,
                                             dp=True)}[ph]()
        except Exception as e:  # noqa: BLE001 - one phase failing must not cost the others
            print(f"[gpu-bench] {ph}: FAILED: {type(e).__name__}: {e}"[:4000], flush=True)
            failed.append(ph)
            env.meta.setdefault("failed", []).append(f"{ph}: {type(e).__name__}: {str(e)[:500]}")
            if a.engine == "vllm":
                wait_gpus_free()
        env.meta.setdefault("phase_s", {})[ph] = round(time.monotonic() - t, 1)
        env.save()
    rest = [r for r in env.records if "door" not in r and "prefix" not in r]
    md = ((report_markdown(rest, env.meta) if rest else "") + doors_markdown(env.records, env.meta)
          + prefix_markdown(env.records))
    (out / "summary.md").write_text(md)
    with contextlib.suppress(Exception):
        plot(env.records, out / "plots.png")
    print(md)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpumesh_bench.gpu", description=package.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--phases", default="raw,p05,share,unequal,tp05,p7,tp7")
    r.add_argument("--out", required=True)
    r.add_argument("--engine", choices=["vllm", "sim"], default="vllm")
    r.add_argument("--model-root", default="/tmp/gpumesh-models")
    r.add_argument("--workers", type=int, default=4, help="router --workers")
    r.add_argument("--procs", type=int, default=8,
                   help="load-generator processes (one connection each: SO_REUSEPORT spreads "
                        "connections, not requests, over router workers)")
    r.add_argument("--warmup", type=float, default=4.0)
    r.add_argument("--seconds", type=float, default=15.0)
    r.add_argument("--max-model-len", type=int, default=2048)
    r.add_argument("--sim-time-scale", type=float, default=1.0)
    r.add_argument("--small-kv-blocks", type=int, default=1536)
    r.add_argument("--sim-front-end-tok-s", type=float, default=0.0,
                   help="--engine sim: each node's front-end ceiling in simulated output tokens/s "
                        "(17500 = an H200 host's measured ceiling); 0 = none")
    r.add_argument("--sim-max-num-seqs", type=int, default=0,
                   help="--engine sim: max_num_seqs of each node (128 = vLLM's bare-engine "
                        "default the GPU runs had); 0 = the simulator's default")
    r.add_argument("--sim-scale-intervals", action="store_true",
                   help="--engine sim: scale the nodes' flush and heartbeat intervals and the "
                        "router's freshness window and lease by --sim-time-scale (the GPU "
                        "system's heartbeats per request and tokens per message)")
    r.add_argument("--policy", default="predicted_latency", choices=POLICIES,
                   help="policy of the data-parallel router in ab7/ab05/dp05/dp7")
    r.add_argument("--rounds", type=int, default=2,
                   help="dp05/dp7, msg05/msg7, vsraw*: interleaved rounds")
    r.add_argument("--vs-eng", action="store_true",
                   help="vsraw*: also the node's engine without gRPC (engine loop) every round")
    r.add_argument("--vs-variant", action="append", default=[], metavar="NAME=VALUE",
                   help="vsraw*: a second set of nodes with this engine argument on top "
                        "(VALUE is JSON, else a string), benched in the same rounds "
                        "(legs router-x, direct-x); e.g. vLLM's default graphs against the "
                        "node's full graphs: "
                        "'compilation_config={\"cudagraph_mode\": \"FULL_AND_PIECEWISE\"}'")
    r.add_argument("--vs-legs", default="",
                   help=f"vsraw*: only these legs, comma-separated (of {', '.join(VSRAW_LEGS)})")
    r.add_argument("--fe-rounds", type=int, default=1,
                   help="fe05/fe7: rounds of (1 front end, N) with fresh nodes per leg")
    r.add_argument("--frontends", type=int, default=2, help="fe05/fe7: N front ends per node")
    r.add_argument("--router-env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment of every router (e.g. GPUMESH_ROUTER_...); repeats")
    r.add_argument("--router-env-b", action="append", default=[], metavar="NAME=VALUE",
                   help="dp05/dp7: also a router B with this env (repeatable) on the same nodes, "
                        "benched interleaved with the first, e.g. "
                        "GPUMESH_ROUTER_MEMBERSHIP__STEP_FROM_REPORT=0")
    r.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                   help="extra vLLM engine argument of every vLLM node (the node TOML's "
                        "[engine_args]; VALUE is JSON, else a string), e.g. stream_interval=4; "
                        "repeats")
    r.add_argument("--node-option", action="append", default=[], metavar="NAME=VALUE",
                   help="a key of every node's TOML, by its name (node.config.NodeConfig; VALUE "
                        "is JSON, else a string), e.g. stream_messages_per_s=0; repeats")
    r.add_argument("--spread-workers", action="store_true",
                   help="load processes round-robin over the router's workers' own ports "
                        "(gpumesh.client.spread_target) instead of one hashed connection each")
    r.add_argument("--pin", choices=["off", "on", "both"], default="off",
                   help="dp05/dp7: node process trees on physical cores of their own near their "
                        "GPUs, routers and load on the rest (gpumesh_bench.gpu.affinity); both: "
                        "each setup unpinned then pinned")
    r.add_argument("--prompt", default=str(REFERENCE_PROMPT),
                   help="prompt tokens of the main benches (gpumesh bench's length syntax)")
    r.add_argument("--output", default=str(REFERENCE_OUTPUT),
                   help="output tokens of the main benches; the reference's fixed:256 makes a "
                        "closed loop's streams finish in lock-step waves, uniform:128:384 does not")
    r.add_argument("--doors", default=",".join(DOORS),
                   help=f"doors05/doors7: the front doors, comma-separated (of {', '.join(DOORS)})")
    r.add_argument("--door-engines", default="1,2",
                   help="doors05/doors7: one engine per door (1), two sharing the GPU (2) or both")
    r.add_argument("--door-concurrency", type=int, default=0,
                   help="doors05/doors7/uneq05: concurrency of every door (0: the phase's default)")
    r.add_argument("--prefix-tenants", type=int, default=PrefixWorkload.tenants,
                   help="prefix05/prefix7: tenants of the shared-prefix workload")
    r.add_argument("--prefix-system-words", type=int, default=PrefixWorkload.system_words,
                   help="prefix05/prefix7: tokens of each tenant's system prompt")
    r.add_argument("--prefix-concurrency", type=int, default=PrefixWorkload.concurrency,
                   help="prefix05/prefix7: closed-loop concurrency of every balancer (each node's KV "
                        "is sized from it and the workload: gpu.prefix.PrefixWorkload)")
    r.add_argument("--prefix-setups", default=",".join(PREFIX_SETUPS),
                   help=f"prefix05/prefix7: the balancers, comma-separated (of "
                        f"{', '.join(PREFIX_SETUPS)})")
    r.add_argument("--raw-tool", default="")
    r.add_argument("--budget", type=float, default=0.0,
                   help="seconds for all phases: a phase or round that would not fit is skipped "
                        "(recorded in meta.not_run / meta.cut); 0 = no bound")
    r.set_defaults(func=cmd_run)
    rep = sub.add_parser("report")
    rep.add_argument("files", nargs="+")
    rep.add_argument("--md", default="")
    rep.add_argument("--png", default="")
    rep.add_argument("--from-round", type=int, default=0,
                     help="front-door and cache-aware tables: leave each run's rounds before "
                          "this one out (warm rounds only)")
    rep.set_defaults(func=cmd_report)
    a = p.parse_args(argv)
    return int(a.func(a))


if __name__ == "__main__":
    sys.exit(main())
