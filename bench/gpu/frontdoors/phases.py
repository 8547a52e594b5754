"""The front-door phases: the same engines behind four front doors on one GPU, interleaved over
rounds (``doors05`` / ``doors7``), and two unequal engines sharing the GPU under three
balancers (``uneq05``).

``doors05`` / ``doors7`` (one call of the harness; every process stays up through the phase):

- two gpumesh nodes A, B (router r1 fronts A, r2 fronts A and B, weighted least-load);
- two ``vllm serve`` OpenAI servers S1, S2 (one engine each), nginx least_conn in front of
  S1 (n1) and of S1 and S2 (n2), HTTP/1.1 keepalive, streamed;
- SMG in gRPC mode (least_load) in front of A (g1) and of A and B (g2), speaking the nodes'
  VllmEngine service;
- two bare engines E1, E2 (``bare_engine``: an AsyncLLM with its load in one process).

Every engine is a vLLM engine built from the same ``AsyncEngineArgs`` (the node's
``engine_kwargs``; ``serve_args`` turns them into ``vllm serve`` flags) at ``DOOR_GPU_MEM`` of
the GPU's memory each, with the same scheduler limits stated explicitly (``SCHEDULER``: vLLM
otherwise picks them by how it was started, a bare ``AsyncLLM`` lower than ``vllm serve`` and
the node; every record carries them as ``scheduler``), six on one GPU, only the benched door's engines busy at a time. Each
round benches, for one engine (A / S1 / E1) and for two engines sharing the GPU (A+B / S1+S2
/ E1+E2), every door at the same concurrency; the door order reverses every round. A door that
cannot be started is left out and said so (``meta["doors_failed"]``); the rest still run.

``uneq05``: 0.5B nodes ``big`` and ``small`` on GPU 0, small with a quarter of big's KV blocks;
gpumesh routers with least_request and predicted_latency and nginx least_conn (gRPC, the
deploy template) in front of the same two nodes, the seed workload at ``UNEQ_CONCURRENCY``,
interleaved over rounds.
"""

from __future__ import annotations

import json
import time
from typing import Any

from gpumesh_bench.gpu.frontdoors.load import Door, door_bench
from gpumesh_bench.gpu.env import SERVED, Env, GpuNodeSpec, GpuRouterSpec
from gpumesh_bench.gpu.frontdoors.servers import BareEngine, Nginx, Smg, VllmServe, serve_args, stop_all
from gpumesh_bench.gpu.group import Group

DOOR_GPU_MEM = 0.15          # six engines on one GPU (0.90 in all)
DOOR_CONCURRENCY = {"0.5b": 128, "7b": 128}
# vLLM 0.26's `vllm serve` defaults on a GPU of 70 GiB or more; set for every door's engines
SCHEDULER: dict[str, int] = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192}
DOORS = ("bare", "gpumesh", "nginx", "smg")
DOOR_LABEL = {"bare": "bare AsyncLLM", "gpumesh": "gpumesh router", "nginx": "vllm serve + nginx",
              "smg": "SMG (gRPC)"}
UNEQ_BLOCKS = (4096, 1024)   # big, small: KV blocks of 16 tokens (65,536 and 16,384 tokens)
UNEQ_CONCURRENCY = 256
UNEQ_POLICIES = ("least_request", "predicted_latency")


def _engine_kwargs(env: Env, shape: str, mem: float, blocks: int = 0) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` fields a gpumesh node of this shape gets here (node_toml's
    settings through the node's own ``engine_kwargs``)."""
    from gpumesh.node.engines.vllm.config import VllmEngineConfig
    from gpumesh.node.engines.vllm.engine_args import engine_kwargs

    model = env.models[shape]
    return engine_kwargs(VllmEngineConfig(
        model=str(model), served_name=SERVED[shape], tokenizer=str(model / "tokenizer"),
        dtype="bfloat16", max_model_len=env.max_model_len, gpu_memory_utilization=mem,
        load_format="dummy", num_gpu_blocks_override=blocks or None,
        extra={"enable_prefix_caching": False, "seed": 0, **SCHEDULER, **env.engine_args}))


def _serve(env: Env, shape: str, name: str, mem: float) -> VllmServe:
    if env.engine == "vllm":
        return VllmServe(name, serve_args(_engine_kwargs(env, shape, mem)), env.logs)
    # CPU dry run: vLLM CPU's OpenAI server on the repository's tiny model (plumbing only)
    from gpumesh_bench import REPO_ROOT

    tiny = REPO_ROOT / "models" / "tiny"
    return VllmServe(name, ["--model", str(tiny), "--served-model-name", SERVED[shape],
                            "--max-model-len", "512", "--enforce-eager", "--dtype", "bfloat16",
                            "--no-enable-prefix-caching", "--disable-uvicorn-access-log"],
                     env.logs, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"})


def _bare(env: Env, shape: str, name: str, mem: float) -> BareEngine:
    if env.engine == "vllm":
        kw = _engine_kwargs(env, shape, mem)
        args = ["--engine", "vllm", "--model", kw["model"], "--tokenizer", kw["tokenizer"],
                "--served-name", SERVED[shape], "--gpu-mem", str(mem),
                "--max-model-len", str(env.max_model_len),
                "--engine-args", json.dumps({"enable_prefix_caching": False, "seed": 0,
                                             **SCHEDULER, **env.engine_args})]
    else:
        args = ["--engine", "sim", "--shape", shape, "--time-scale", str(env.sim_time_scale)]
    return BareEngine(name, args, env.logs)


def _note_fail(env: Env, what: str, e: BaseException) -> None:
    msg = f"{type(e).__name__}: {e}"
    print(f"[doors] {what}: FAILED: {msg}"[:3000], flush=True)
    env.meta.setdefault("doors_failed", {})[what] = msg[:1500]


def phase_doors(env: Env, shape: str, phase: str, rounds: int = 3,
                doors: tuple[str, ...] = DOORS, concurrency: int = 0,
                mem: float = DOOR_GPU_MEM, engines: tuple[int, ...] = (1, 2)) -> None:
    """``engines``: (1,) starts only the first engine of each door (A, S1, E1) and benches
    the one-engine setups; (1, 2) both."""
    c = concurrency or DOOR_CONCURRENCY[shape]
    tag = shape.replace(".", "")
    a, b = f"a{tag}", f"b{tag}"
    two = 2 in engines
    nodes = [GpuNodeSpec(a, shape, "0", mem, routers=("r1", "r2") if two else ("r1",))]
    routers = [GpuRouterSpec("r1", members=(a,))]
    if two:
        nodes.append(GpuNodeSpec(b, shape, "0", mem, routers=("r2",), after=a))
        routers.append(GpuRouterSpec("r2", members=(a, b)))
    served = SERVED[shape]
    extra: list[Any] = []
    saved = env.engine_args
    env.engine_args = {**SCHEDULER, **saved}   # the nodes' too (node_toml's [engine_args])
    with Group(env, nodes, routers) as g:
        try:
            t = time.monotonic()
            g.start()
            cmds: dict[str, Any] = {"gpumesh": g.commands}
            env.meta.setdefault("kv_tokens", {}).update(g.kv_tokens)
            pid = {ch.name: ch.pid for ch in g.children}
            print(f"[doors] {phase}: gpumesh nodes and routers up in {time.monotonic() - t:.0f}s",
                  flush=True)
            avail: dict[str, dict[int, Door]] = {}
            avail["gpumesh"] = {
                1: Door(DOOR_LABEL["gpumesh"], "grpc", g.addr["r1"], roots=[pid["r1"], pid[a]])}
            if two:
                avail["gpumesh"][2] = Door(DOOR_LABEL["gpumesh"], "grpc", g.addr["r2"],
                                           roots=[pid["r2"], pid[a], pid[b]])
            if "nginx" in doors:
                try:
                    t = time.monotonic()
                    s1 = _serve(env, shape, f"s1{tag}", mem)
                    extra.append(s1)
                    s1.wait_ready(400)
                    n1 = Nginx(f"n1{tag}", [s1.address], env.logs)
                    extra.append(n1)
                    n1.wait_ready()
                    cmds["nginx"] = [s1.command(), " ".join(n1.child.argv)]
                    avail["nginx"] = {1: Door(DOOR_LABEL["nginx"], "http", n1.base, served,
                                              roots=[n1.child.pid, s1.child.pid])}
                    if two:
                        s2 = _serve(env, shape, f"s2{tag}", mem)
                        extra.append(s2)
                        s2.wait_ready(400)
                        n2 = Nginx(f"n2{tag}", [s1.address, s2.address], env.logs)
                        extra.append(n2)
                        n2.wait_ready()
                        cmds["nginx"] += [s2.command(), " ".join(n2.child.argv)]
                        avail["nginx"][2] = Door(DOOR_LABEL["nginx"], "http", n2.base, served,
                                                 roots=[n2.child.pid, s1.child.pid, s2.child.pid])
                    print(f"[doors] {phase}: vllm serve x2 + nginx up in "
                          f"{time.monotonic() - t:.0f}s", flush=True)
                except Exception as e:  # noqa: BLE001 - the other doors still run
                    _note_fail(env, f"{phase} nginx", e)
            if "smg" in doors:
                try:
                    model = env.models[shape]
                    wn = {f"grpc://{g.addr[n]}": n for n in ((a, b) if two else (a,))}
                    g1 = Smg(f"g1{tag}", [g.addr[a]], model, env.logs)
                    extra.append(g1)
                    g1.wait_ready()
                    cmds["smg"] = [g1.command()]
                    avail["smg"] = {1: Door(DOOR_LABEL["smg"], "http", g1.base, served,
                                            roots=[g1.child.pid, pid[a]], worker_nodes=wn)}
                    if two:
                        g2 = Smg(f"g2{tag}", [g.addr[a], g.addr[b]], model, env.logs)
                        extra.append(g2)
                        g2.wait_ready()
                        cmds["smg"].append(g2.command())
                        avail["smg"][2] = Door(DOOR_LABEL["smg"], "http", g2.base, served,
                                               roots=[g2.child.pid, pid[a], pid[b]],
                                               worker_nodes=wn)
                except Exception as e:  # noqa: BLE001
                    _note_fail(env, f"{phase} smg", e)
            if "bare" in doors:
                try:
                    t = time.monotonic()
                    e1 = _bare(env, shape, f"e1{tag}", mem)
                    extra.append(e1)
                    e1.wait_ready(400)
                    cmds["bare"] = [e1.command()]
                    avail["bare"] = {1: Door(DOOR_LABEL["bare"], "bare", bare=[e1], roots=[e1.pid])}
                    if two:
                        e2 = _bare(env, shape, f"e2{tag}", mem)
                        extra.append(e2)
                        e2.wait_ready(400)
                        cmds["bare"].append(e2.command())
                        avail["bare"][2] = Door(DOOR_LABEL["bare"], "bare", bare=[e1, e2],
                                                roots=[e1.pid, e2.pid])
                    print(f"[doors] {phase}: bare engines up in {time.monotonic() - t:.0f}s",
                          flush=True)
                except Exception as e:  # noqa: BLE001
                    _note_fail(env, f"{phase} bare", e)
            env.meta.setdefault("commands", {})[phase] = cmds
            order = [d for d in doors if d in avail]
            _rounds(env, phase, shape, c, order, avail, rounds, mem, engines)
        finally:
            stop_all(reversed(extra))
            env.engine_args = saved


def _rounds(env: Env, phase: str, shape: str, c: int, order: list[str],
            avail: dict[str, dict[int, Door]], rounds: int, mem: float,
            engines: tuple[int, ...]) -> None:
    per_round = None
    for k in range(rounds):
        if env.out_of_time("doors", phase, k, rounds, per_round, margin=20.0):
            break
        t = time.monotonic()
        seq = order if k % 2 == 0 else list(reversed(order))
        for n in engines:
            for d in seq:
                door = avail[d][n]
                try:
                    rec = door_bench(door, concurrency=c, warmup_s=env.warmup_s,
                                     window_s=env.window_s, prompt=env.prompt, output=env.output,
                                     procs=env.procs, out_dir=env.logs)
                except Exception as e:  # noqa: BLE001 - one door failing must not stop the rest
                    _note_fail(env, f"{phase} {d} {n} #{k}", e)
                    continue
                rec.update(phase=phase, shape=shape, engines=n, round=k, door_key=d,
                           setup=f"{DOOR_LABEL[d]}, {n} engine{'s' if n > 1 else ''} #{k}",
                           gpu_mem=mem, call=env.call, engine=env.engine, started=time.time(),
                           scheduler={**SCHEDULER, **{k: v for k, v in env.engine_args.items()
                                                      if k in SCHEDULER}})
                env.records.append(rec)
                env.save()
        per_round = time.monotonic() - t


def phase_uneq(env: Env, phase: str = "uneq05", rounds: int = 2,
               concurrency: int = UNEQ_CONCURRENCY) -> None:
    big, small = UNEQ_BLOCKS
    rs = [GpuRouterSpec(f"q-{p.replace('_', '-')}", p, ("big", "small")) for p in UNEQ_POLICIES]
    names = tuple(r.name for r in rs)
    nodes = [GpuNodeSpec("big", "0.5b", "0", 0.42, blocks=big, routers=names),
             GpuNodeSpec("small", "0.5b", "0", 0.42, blocks=small, routers=names, after="big")]
    extra: list[Any] = []
    with Group(env, nodes, rs) as g:
        try:
            g.start()
            env.meta.setdefault("commands", {})[phase] = g.commands
            env.meta.setdefault("kv_tokens", {}).update(g.kv_tokens)
            pid = {ch.name: ch.pid for ch in g.children}
            doors: list[tuple[str, Door]] = [
                (r.policy, Door(f"gpumesh {r.policy}", "grpc", g.addr[r.name],
                                roots=[pid[r.name], pid["big"], pid["small"]])) for r in rs]
            try:
                ng = Nginx("uneq", [g.addr["big"], g.addr["small"]], env.logs, mode="grpc")
                extra.append(ng)
                ng.wait_ready()
                doors.append(("nginx least_conn", Door("nginx least_conn (gRPC)", "grpc",
                                                       ng.address, roots=[ng.child.pid, pid["big"],
                                                                          pid["small"]])))
                env.meta["commands"][phase].append(" ".join(ng.child.argv))
            except Exception as e:  # noqa: BLE001
                _note_fail(env, f"{phase} nginx", e)
            for k in range(rounds):
                for policy, door in (doors if k % 2 == 0 else list(reversed(doors))):
                    try:
                        rec = door_bench(door, concurrency=concurrency, warmup_s=env.warmup_s,
                                         window_s=env.window_s, prompt=env.prompt,
                                         output=env.output, procs=env.procs, out_dir=env.logs)
                    except Exception as e:  # noqa: BLE001
                        _note_fail(env, f"{phase} {policy} #{k}", e)
                        continue
                    rec.update(phase=phase, shape="0.5b", round=k, policy=policy,
                               setup=f"{policy} #{k}", kv_blocks={"big": big, "small": small},
                               call=env.call, engine=env.engine, started=time.time())
                    env.records.append(rec)
                    env.save()
        finally:
            stop_all(reversed(extra))


def doors_need(phase: str) -> float:
    """Seconds a phase needs to start and run one round (the cli's budget check)."""
    return {"doors05": 240, "doors7": 330, "uneq05": 120}.get(phase, 120)

