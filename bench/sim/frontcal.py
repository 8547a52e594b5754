"""The serving path's CPU costs, measured on a live fleet: what the node's front end spends per
request, per engine output and per stream message, and what the router spends per request and
per relayed message (the ``[front_end]`` ``cpu_*`` and ``[router]`` keys of an engine profile,
which the simulator serves as queues: ``serving.py``).

Method (:func:`measure`): requests go through one router to the live nodes in four shapes,
each on prompts of their own (random tokens, nothing cached; 16 tokens unless said):

- ``one``: ``max_tokens = 1``: 1 engine output, 1 stream message;
- ``long``: the same with ``LONG_PROMPT`` prompt tokens (the work per prompt token);
- ``per_token``: ``max_tokens = M``, ``stream_options.per_token``: M outputs, M messages;
- ``coalesced``: ``max_tokens = M``, a 1 s flush interval: M outputs, 2 messages (the first
  token, then the rest with the end);

``concurrency`` requests in flight, each shape ``reps`` times, interleaved. Around each probe
the CPU seconds of the processes are read from ``/proc`` (``cpu()``): the node front ends
(every process of a node but vLLM's engine core and workers, summed over the nodes) and the
router. Their background use (heartbeats, KV event streams), measured over ``idle_s`` idle
seconds before and after, is taken off in proportion to each probe's length. Least squares
over the probes then gives, per process, the CPU ms per request, per prompt token, per output
and per message (the router: all but per output), from the outputs and messages the client
counted.

Run on a live fleet: ``python -m gpumesh_bench.sim.frontcal --out FILE`` (by default the
fidelity check's CPU fleet: the tiny model, two engines pinned to cores 0 and 1, the validate
run's engine settings; ``--cores ''`` and ``--engine-arg`` as ``gpumesh sim validate`` takes
them for CUDA). It writes a profile TOML with the step model fitted by ``livecal`` and the
measured costs, or ``--into PROFILE`` (e.g. ``gpumesh calibrate``'s) with the costs in it.

Several measurements: ``--median RUN.json... --out FILE`` writes the first run's profile with
each cost the median over the runs (the ``.json`` each run writes beside its TOML).

Another host's processes run the same code at another speed: ``--rescale VALIDATE.json
--profile P --costs FILE --fit-workload W --out FILE`` (:func:`rescale`) scales the measured
costs by what that host's live runs of workload W used (their ``cpu_cores_by_process``), and
writes profile P with the scaled costs; the other workloads' runs are the held-out check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc
from gpumesh_bench.sim.livefleet import token_request

SHAPES = ("one", "long", "per_token", "coalesced")
# the default fleet's scheduler limits and KV capacity (for runs that did not record theirs)
DEFAULT_LIVE = {"max_num_seqs": 64, "max_num_batched_tokens": 2048,
                "kv_capacity_tokens": 2097152}
LONG_PROMPT = 512


def _message(shape: str, ids: list[int], out: int, rid: str, model: str) -> pb.GenerateRequest:
    m = token_request(model, ids, 1 if shape in ("one", "long") else out, rid)
    if shape == "per_token":
        m.stream_options.per_token = True
    elif shape == "coalesced":
        m.stream_options.flush_interval_ms = 1000
    return m


async def _one(stub: pb_grpc.InferenceStub, msg: pb.GenerateRequest) -> tuple[int, int]:
    """(tokens, messages) of one streamed request."""
    tokens = msgs = 0
    async for chunk in stub.GenerateStream(msg, timeout=120):
        msgs += 1
        tokens += len(chunk.token_ids)
    return tokens, msgs


async def _probe(stub: pb_grpc.InferenceStub, msgs: Sequence[pb.GenerateRequest],
                 concurrency: int) -> tuple[int, int]:
    sem = asyncio.Semaphore(concurrency)

    async def run(m: pb.GenerateRequest) -> tuple[int, int]:
        async with sem:
            return await _one(stub, m)

    res = await asyncio.gather(*[run(m) for m in msgs])
    return sum(t for t, _ in res), sum(k for _, k in res)


def fit(rows: Sequence[dict[str, float]], cols: Sequence[str], target: str) -> dict[str, float]:
    """Least squares ``target ~ sum(c_k * row[k])`` without intercept; ms per unit, each at
    least 0 (a negative coefficient is refitted without that column)."""
    cols = list(cols)
    while cols:
        x = np.array([[r[c] for c in cols] for r in rows], dtype=float)
        y = np.array([r[target] for r in rows], dtype=float)
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        if (coef >= 0).all():
            return {c: float(v) for c, v in zip(cols, coef, strict=True)}
        cols.pop(int(np.argmin(coef)))
    return {}


async def measure(address: str, cpu: Callable[[], dict[str, float]], model: str, vocab: int,
                  *, requests: int = 60, out_tokens: int = 32, reps: int = 2,
                  concurrency: int = 8, idle_s: float = 3.0, seed: int = 7) -> dict[str, Any]:
    """The costs (module docstring) through the router at ``address``; ``cpu()`` returns the
    CPU seconds so far of ``{"front_end": .., "router": ..}``. Returns the profile keys
    (``front_end_cpu_*``, ``router_cpu_*``, ms), the background CPU rates and every probe."""
    rng = random.Random(seed)

    async def idle() -> dict[str, float]:
        c0, t0 = cpu(), time.monotonic()
        await asyncio.sleep(idle_s)
        c1, dt = cpu(), time.monotonic() - t0
        return {k: (c1[k] - c0[k]) / dt for k in c0}

    rows: list[dict[str, Any]] = []
    k = 0
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        await _probe(stub, [_message("one", [rng.randrange(10, vocab - 1) for _ in range(16)],
                                     1, f"fc-warm-{i}", model) for i in range(8)], 4)
        bg = [await idle()]
        for _ in range(reps):
            for shape in SHAPES:
                n = requests * (2 if shape in ("one", "long") else 1)
                length = LONG_PROMPT if shape == "long" else 16
                msgs = []
                for _ in range(n):
                    k += 1
                    ids = [rng.randrange(10, vocab - 1) for _ in range(length)]
                    msgs.append(_message(shape, ids, out_tokens, f"fc-{k}", model))
                c0, t0 = cpu(), time.monotonic()
                tokens, messages = await _probe(stub, msgs, concurrency)
                c1, dt = cpu(), time.monotonic() - t0
                rows.append({"shape": shape, "requests": n, "prompt_tokens": n * length,
                             "outputs": tokens,
                             "messages": messages, "wall_s": dt,
                             "cpu_s": {p: c1[p] - c0[p] for p in c0}})
        bg.append(await idle())
    rate = {p: statistics.fmean(b[p] for b in bg) for p in bg[0]}
    for r in rows:
        for p in rate:
            r[f"{p}_ms"] = 1000 * max(r["cpu_s"][p] - rate[p] * r["wall_s"], 0.0)
    fe = fit(rows, ("requests", "prompt_tokens", "outputs", "messages"), "front_end_ms")
    rt = fit(rows, ("requests", "prompt_tokens", "messages"), "router_ms")
    out = {"front_end_cpu_request_ms": fe.get("requests", 0.0),
           "front_end_cpu_prompt_token_ms": fe.get("prompt_tokens", 0.0),
           "front_end_cpu_output_ms": fe.get("outputs", 0.0),
           "front_end_cpu_message_ms": fe.get("messages", 0.0),
           "router_cpu_request_ms": rt.get("requests", 0.0),
           "router_cpu_prompt_token_ms": rt.get("prompt_tokens", 0.0),
           "router_cpu_message_ms": rt.get("messages", 0.0),
           "background_cpu_cores": rate, "probes": rows}
    for r in rows:   # what the fit gives back for each probe (a check of the linear model)
        r["front_end_fit_ms"] = sum(r[c] * v for c, v in fe.items())
        r["router_fit_ms"] = sum(r[c] * v for c, v in rt.items())
    return out


def run_cpu(doc: dict[str, Any], profile: dict[str, Any], seed: int = 1
            ) -> list[dict[str, Any]]:
    """Per live run of a ``gpumesh sim validate`` document (``fidelity.read_doc``) that
    recorded its processes' CPU: the CPU seconds its node front ends and its router used
    (less the background: the idle routers' mean rate for the router), beside the work the
    simulator's servers did with ``profile``'s serving costs on the same trace."""
    from gpumesh.config import ConfigError
    from gpumesh_bench.sim import fidelity
    from gpumesh_bench.sim import fidelity_trace as ft
    from gpumesh_bench.sim.core import Simulation

    live, tr = doc["live"], doc["trace"]
    fleet = fidelity.sim_fleet(
        tuple(live["node_engines"]), profile, max_num_seqs=live["max_num_seqs"],
        max_num_batched_tokens=live["max_num_batched_tokens"],
        kv_capacity_tokens=min(live["kv_capacity_tokens"], 1 << 24),
        max_context_length=live["max_model_len"])
    rows = []
    for wk, pols in doc["live_runs"].items():
        info = doc["workloads"][wk]
        w = ft.build(wk, info["requests"], info["rate"], tr["seed"], tr["tenants"],
                     tr["system_tokens"])
        for pol, lv in pols.items():
            procs = lv.get("cpu_cores_by_process")
            if not procs:
                continue
            wall = float(lv["wall_s"])
            fe = rt = 0.0
            idle = []
            for key, cores in procs.items():
                child, comm, _ = key.split("/")
                if child.startswith("node-") and not comm.startswith("VLLM"):
                    fe += cores * wall
                elif child == f"router-{pol}":
                    rt += cores * wall
                elif child.startswith("router-"):
                    idle.append(cores)
            rt -= (statistics.fmean(idle) if idle else 0.0) * wall
            try:
                sim = Simulation(fleet, w, pol, seed)
            except ConfigError:   # a policy the router no longer has
                continue
            sim.run()
            path = sim.path
            rows.append({"workload": wk, "policy": pol, "live_front_end_s": fe,
                         "live_router_s": rt,
                         "sim_front_end_s": sum(f.server.busy_s for f in path.fronts.values())
                         if path else 0.0,
                         "sim_router_s": sum(r.busy_s for r in path.routers) if path else 0.0})
    return rows


def rescale(doc: dict[str, Any], profile: dict[str, Any], fit_workload: str
            ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """``profile``'s serving costs carried to the host of ``doc``'s live runs: the node
    front end's costs times live / simulated CPU seconds over the runs of ``fit_workload``,
    the router's likewise (:func:`run_cpu`); the other workloads' runs are held out.
    Returns the scaled cost keys and, per run, the CPU seconds live and simulated with them."""
    from gpumesh_bench.sim.fidelity import SERVING_KEYS

    rows = [r for r in run_cpu(doc, profile) if r["workload"] == fit_workload]
    if not rows:
        raise ValueError(f"no live run of {fit_workload!r} with its processes' CPU")
    k_fe = sum(r["live_front_end_s"] for r in rows) / sum(r["sim_front_end_s"] for r in rows)
    k_rt = sum(r["live_router_s"] for r in rows) / sum(r["sim_router_s"] for r in rows)
    scaled = {k: float(profile.get(k, 0.0)) * (k_rt if k.startswith("router_") else k_fe)
              for k in SERVING_KEYS}
    check = run_cpu(doc, {**profile, **scaled})
    for r in check:
        r["held_out"] = r["workload"] != fit_workload
    return {**scaled, "front_end_scale": k_fe, "router_scale": k_rt}, check


def fleet_cpu(fleet: Any, policy: str) -> Callable[[], dict[str, float]]:
    """``cpu()`` for :func:`measure` on a ``LiveFleet``: its node front ends (every process
    of a node child but vLLM's ``VLLM::*`` ones) and router ``policy``."""
    from gpumesh_bench.sim.validate import _proc_cpu

    def cpu() -> dict[str, float]:
        fe = rt = 0.0
        for key, s in _proc_cpu(fleet.children).items():
            child, comm, _ = key.split("/")
            if child.startswith("node-") and not comm.startswith("VLLM"):
                fe += s
            elif child == f"router-{policy}":
                rt += s
        return {"front_end": fe, "router": rt}

    return cpu


async def _main(a: argparse.Namespace) -> dict[str, Any]:
    from gpumesh.tiny_model import build_tiny_model
    from gpumesh_bench.sim.livecal import calibrate
    from gpumesh_bench.sim.livefleet import LiveFleet, LiveSpec

    from gpumesh_bench.sim.validate import _kv

    model = Path(a.model)
    if not (model / "config.json").exists() and a.model == "models/tiny":
        build_tiny_model(model)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    cores = tuple(c for c in a.cores.split(",") if c)
    engine_args = {"max_num_seqs": 64, "max_num_batched_tokens": 2048,
                   **_kv(a.engine_arg, "--engine-arg")}
    env = {**({"VLLM_CPU_KVCACHE_SPACE": "1"} if cores else {}),
           **{k: str(v) for k, v in _kv(a.engine_env, "--engine-env").items()}}
    spec = LiveSpec(str(model.resolve()), (a.policy,), len(cores) or a.engines, cores, "tiny",
                    a.max_model_len, engine_args, env)
    with LiveFleet(spec) as fleet:   # its logs in a temporary folder
        await fleet.start()
        step = await calibrate(fleet.node_address(fleet.node_ids[0]), "tiny", vocab,
                               context=560)
        costs = await measure(fleet.address(a.policy), fleet_cpu(fleet, a.policy), "tiny",
                              vocab, requests=a.requests, reps=a.reps)
        live = {**fleet.scheduler_limits(), "kv_capacity_tokens": min(
            int(x.kv_capacity_tokens) for x in (await fleet.loads(a.policy)).values())}
    return {**step, **costs, "live": live,
            "source": f"gpumesh_bench.sim.frontcal: {spec.engines} engines of {model.name}, "
                      f"cores {a.cores or 'unpinned'}"}


def _rescale_main(a: argparse.Namespace) -> dict[str, Any]:
    from gpumesh_bench.sim import fidelity

    doc = fidelity.read_doc(a.rescale)
    costs = fidelity.load_profile(a.costs)
    base = {**fidelity.load_profile(a.profile),
            **{k: costs[k] for k in fidelity.SERVING_KEYS}}
    scaled, check = rescale(doc, base, a.fit_workload)
    return {**base, **scaled, "cpu_check": check, "live": doc["live"],
            "source": f"{a.profile} with the serving costs of {a.costs} scaled to the "
                      f"live runs of {a.fit_workload} in {a.rescale}"}


def _median_main(a: argparse.Namespace) -> dict[str, Any]:
    from gpumesh_bench.sim.fidelity import SERVING_KEYS

    runs = [json.loads(Path(f).read_text(encoding="utf-8")) for f in a.median]
    return {**runs[0], **{k: statistics.median(float(r[k]) for r in runs) for k in SERVING_KEYS},
            "source": f"frontcal: each serving cost the median of {len(runs)} runs",
            "runs": [{k: r[k] for k in SERVING_KEYS} for r in runs]}


def _write(out: Path, doc: dict[str, Any], into: str) -> None:
    """The profile TOML: ``into`` (an engine profile, e.g. from ``gpumesh calibrate``) with
    the serving costs of ``doc`` in place of its own; without ``into`` the step model of
    ``doc`` (``livecal``) with them."""
    from dataclasses import replace

    from gpumesh import profiles
    from gpumesh_bench.sim.fidelity import SERVING_KEYS, profile_toml

    live = doc.pop("live", None) or DEFAULT_LIVE
    if into:   # the profile keys and the EngineProfile attributes share their names
        p = replace(profiles.load_profile(into), **{k: float(doc[k]) for k in SERVING_KEYS})
        out.write_text(profiles.dumps_profile(p), encoding="utf-8")
    else:
        out.write_text(profile_toml(doc, live), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpumesh_bench.sim.frontcal",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/tiny")
    p.add_argument("--cores", default="0,1",
                   help="one CPU core per engine (vLLM CPU pinning); '' on CUDA")
    p.add_argument("--engines", type=int, default=2, help="without --cores")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="as gpumesh sim validate's")
    p.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--policy", default="round_robin")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--rescale", default="", metavar="VALIDATE.json",
                   help="no fleet: scale --costs to this validate run's host (module docstring)")
    p.add_argument("--profile", default="", help="with --rescale: the step model's profile")
    p.add_argument("--costs", default="", help="with --rescale: the measured costs' profile")
    p.add_argument("--fit-workload", default="shared-prefix")
    p.add_argument("--median", nargs="+", default=[], metavar="RUN.json",
                   help="no fleet: the median of these frontcal runs' costs")
    p.add_argument("--into", default="",
                   help="write this engine profile with the costs in place (default: with "
                        "--rescale its --profile; else the livecal step model)")
    p.add_argument("--out", required=True, help="profile TOML to write (+ .json beside it)")
    a = p.parse_args(argv)
    if a.rescale and not (a.profile and a.costs):
        p.error("--rescale needs --profile and --costs")
    doc = (_rescale_main(a) if a.rescale else _median_main(a) if a.median
           else asyncio.run(_main(a)))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _write(out, doc, a.into or (a.profile if a.rescale else ""))
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    sys.stdout.write(json.dumps({k: v for k, v in doc.items()
                                 if k not in ("samples", "probes", "cpu_check")}, indent=1)
                     + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
