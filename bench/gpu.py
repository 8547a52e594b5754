"""GPU measurement of the mesh: vLLM CUDA nodes direct vs through the router vs raw vLLM.

Driven by ``deploy/gpu/run_mesh_gpu.sh`` on a device machine (one ``run`` call per group of
phases, the vLLM kit installed); also runs on CPU with ``--engine sim`` (simulated nodes, same
processes, same router, same load generator) to check the logic before device time is spent.

  python -m gpumesh_bench.gpu run --phases p05,share,unequal --out DIR [--engine vllm|sim]
  python -m gpumesh_bench.gpu report DIR/results.json[.gz]... --md OUT.md --png OUT.png

Phases (each starts its own nodes and routers and stops them, GPUs freed, before the next):

- ``raw``: the raw-vLLM reference tool (``--raw-tool``, shared/gpu/seed_table.py) in this
  session, 0.5B, one GPU, concurrency 128 (the README's method, for an in-session ratio).
  ``raw7``: 7B at 256, one GPU, then (two GPUs) data parallel: two engines at once, 128 each
  (seed_table.sh's method); ``rawdp05``: the same for 0.5B at 128.
- ``eng05`` / ``eng7``: the node's own engine without gRPC (``gpumesh bench engine-loop``:
  the node TOML a node of that shape gets here, engine built by the node's code, a closed loop
  on its ``generate`` in the same process) at the raw phases' concurrency: one GPU, then (two
  GPUs) two loops at once, C/2 each, as one data-parallel row (phase ``eng`` in the results).
  Raw vs engine loop = the node's engine configuration; engine loop vs the node direct = the
  node's serving path (servicer, coalescing, gRPC).
- ``p05``: 0.5B. Node A on GPU 0 and (two GPUs or more) node B on GPU 1, 0.85 of memory each;
  router R1 fronts A alone, R2 fronts A and B. Benches: A direct and R1 at concurrency 128
  (one GPU), R2 at 128 and 256 (data parallel; 256 = 128 per GPU, the equal-latency point),
  A and B direct at 256 with the client splitting its streams (data parallel without a
  router), then a sweep on A direct (concurrency 1..512; prompts up to 1900 tokens) for the
  simulator. ``p05q``: the same without the sweep.
- ``share``: 0.5B, two nodes on GPU 0 (0.42 of memory each) behind one router, 128.
- ``unequal``: 0.5B, one GPU: a normal node and a node whose KV cache is cut to
  ``--small-kv-blocks`` blocks, 512-token prompts; one router per policy, each benched.
  ``unequal2``: the same pair with a GPU each (two GPUs or more).
- ``tp05`` / ``tp7``: one node with tensor_parallel_size 2 (GPUs 0,1) behind a router.
- ``p7``: as ``p05`` with the 7B shape at concurrency 256 (512 for the equal-latency DP point).
- ``ab7`` / ``ab05``: repeats on the same nodes, interleaved: one GPU direct vs through the
  router twice (ABAB), then data parallel through the router vs the client splitting.
  ``dp05`` / ``dp7``: data parallel through the router vs the client splitting, ``--rounds``
  times interleaved, with a multi-worker router also with the load spread over its workers.
- ``vsraw05`` / ``vsraw7``: the mesh against raw vLLM on one GPU, interleaved: node A (with
  ``--node-option``s, e.g. frontends=2) and router R1 stay up on GPU 0 at 0.42 of its memory;
  each of ``--rounds`` rounds runs the raw reference tool (its own engine at 0.42, started per
  run), A direct and R1, the order reversed every other round; the report gives each node
  bench over its round's raw QPS and the medians. ``vsrawdp05`` / ``vsrawdp7`` (two GPUs):
  the same for data parallel: nodes A and B (GPUs 0, 1) behind R2 and the client's own split
  against two raw engines at C/2 each (the reference's data-parallel method). ``--vs-eng``:
  every round also runs the node's engine without gRPC (as ``eng05``) next to raw.
  ``--vs-variant NAME=VALUE``: a second set of nodes (X, Y) with those engine arguments on top,
  behind their own router, up on the same GPUs through the phase and benched in the same
  rounds (legs ``router-x``, ``direct-x``); every engine then gets 0.28 of its GPU's memory.
  ``--vs-legs`` keeps only the named legs.
- ``msg05`` / ``msg7``: the node's stream-message budget on and off on the same nodes,
  interleaved: requests with the node's default interval (the budget widens it under load)
  vs requests asking for the base 20 ms themselves (kept as asked: the old fixed interval);
  one GPU direct at C, then (two GPUs) data parallel through the router at 2C, ``--rounds``
  times each.

Workload: the raw reference's (``shared/gpu/seed_table.py``): a closed loop of C streams,
32 prompt tokens, 256 output tokens with ignore_eos, a 4 s warm-up then a 15 s window. QPS is
computed as the reference computes it: requests that started in the window and finished
inside it, divided by the window (this undercounts the completion rate by about latency /
window; ``done_qps``, completions in the window per second, is reported beside it). Latency
and TTFT percentiles are over the same requests. Load comes from ``gpumesh bench``'s own
multi-process generator (``gpumesh_bench.cli.run_multi``, what ``gpumesh bench run --procs N``
runs) and routers run with ``--workers N``.

``--pin on|both`` (data-parallel and main-table phases): each node's process tree (front end,
engine core) runs on physical cores of its own near its GPU, routers and load on the rest
(``gpumesh_bench.affinity``); ``both`` runs each data-parallel setup unpinned then pinned.

Every bench also records the cores each process group used in its window (``CpuSampler``:
node front end, vLLM engine processes, router, load generator, whole machine), which says
whether a setup was GPU- or CPU-bound.

Nodes disable prefix caching: the synthetic tokenizer maps every benchmark word to one id, so
all prompts would share their prefix, while the reference's random-id prompts never hit.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import grpc

from gpumesh_bench.gpu_report import (
    RAW_CONCURRENCY,
    cmd_report,
    fmt,
    plot,
    report_markdown,
)
from gpumesh_bench.workload import REFERENCE_OUTPUT, REFERENCE_PROMPT
from gpumesh.ports import free_port
from gpumesh.node.config import NodeConfig

if TYPE_CHECKING:
    from gpumesh_bench.affinity import Placement

SERVED = {"0.5b": "qwen2.5-0.5b", "7b": "qwen2.5-7b"}
POLICIES = ("weighted_least_load", "least_request", "power_of_two", "round_robin")


# --- processes ---------------------------------------------------------------------------------

class Child:
    """A ``python -m gpumesh.cli ...`` child in its own process group, logging to a file."""

    def __init__(self, name: str, args: list[str], log_dir: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = [sys.executable, "-m", "gpumesh.cli", *args]
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        self.env = env or {}
        self.popen = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                      env={**os.environ, **self.env}, start_new_session=True)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def command(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return (env + " " if env else "") + "gpumesh " + " ".join(self.argv[3:])

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # the engine core and its workers too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        self._log.close()


@dataclass
class NodeSpec:
    name: str
    shape: str = "0.5b"
    gpus: str = "0"
    gpu_mem: float = 0.85
    tp: int = 1
    blocks: int = 0               # num_gpu_blocks_override (0 = what fits)
    routers: tuple[str, ...] = ()  # router names
    after: str = ""               # start once this node serves (same GPU: profiling is per process)
    engine_args: dict[str, Any] = field(default_factory=dict)  # vLLM: on top of Env.engine_args


@dataclass
class RouterSpec:
    name: str
    policy: str = "weighted_least_load"
    members: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)   # on top of Env.router_env


@dataclass
class Env:
    out: Path
    engine: str
    models: dict[str, Path]
    workers: int
    procs: int
    warmup_s: float
    window_s: float
    max_model_len: int
    sim_time_scale: float
    small_kv_blocks: int
    sim_front_end_tok_s: float = 0.0   # simulated nodes: front-end ceiling (0 = none)
    sim_max_num_seqs: int = 0          # simulated nodes: vLLM's max_num_seqs (0 = default)
    raw_tool: str = ""
    # Simulated nodes: multiply the node's flush interval and heartbeat intervals and the
    # router's freshness window and lease by sim_time_scale, so that heartbeats per request
    # lifetime and messages per token are those of the unscaled (GPU) system.
    sim_scale_intervals: bool = False
    policy: str = "weighted_least_load"   # the data-parallel phases' router policy
    router_env: dict[str, str] = field(default_factory=dict)  # extra env for every router
    # dp05/dp7: a second data-parallel router "r2b" with this env on top, fronting the same
    # two nodes, benched interleaved with r2 (an A/B of router settings on the same nodes)
    router_env_b: dict[str, str] = field(default_factory=dict)
    # vLLM nodes: extra AsyncEngineArgs on top of the bench's (e.g. stream_interval=4)
    engine_args: dict[str, Any] = field(default_factory=dict)
    # Every node: top-level node TOML keys on top of the bench's (e.g. stream_messages_per_s=0)
    node_options: dict[str, Any] = field(default_factory=dict)
    # Load processes round-robin over a multi-worker router's processes (bench --spread-workers)
    spread_workers: bool = False
    # Data-parallel phases: "off", "on" (every bench with node processes on physical cores of
    # their own, gpumesh_bench.affinity), "both" (each setup unpinned then pinned, interleaved)
    pin: str = "off"
    # The reference's workload by default; another output length mix (e.g. uniform:128:384)
    # keeps a closed loop's streams from finishing in lock-step waves
    prompt: str = str(REFERENCE_PROMPT)
    output: str = str(REFERENCE_OUTPUT)
    records: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    # This device call's 1-based index in meta["calls"] (cmd_run sets it; successive calls
    # append to one results.json), recorded with every record as "call"; 0: not set
    call: int = 0
    # time.monotonic() at which this call's --budget ends (cmd_run sets it); phases of
    # several rounds stop before a round that would not fit
    budget_end: float = math.inf
    # vsraw phases: also the node's engine without gRPC (engine loop) in every round
    vs_eng: bool = False
    # vsraw phases: engine arguments of a second set of nodes benched in the same rounds
    vs_variant: dict[str, Any] = field(default_factory=dict)
    # vsraw phases: only these legs (VSRAW_LEGS names), in their usual order; empty: all
    vs_legs: tuple[str, ...] = ()

    @property
    def logs(self) -> Path:
        p = self.out / "logs"
        p.mkdir(parents=True, exist_ok=True)
        return p

    def save(self) -> None:
        doc = {"meta": self.meta, "records": self.records}
        (self.out / "results.json").write_text(json.dumps(doc, indent=1, default=str))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, dict):  # e.g. --engine-arg 'compilation_config={"cudagraph_mode": "FULL"}'
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}"
                                for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def node_toml(env: Env, spec: NodeSpec) -> str:
    top: dict[str, Any] = {"served_name": SERVED[spec.shape], "max_model_len": env.max_model_len,
                           "heartbeat_busy_interval_s": 0.25, "drain_timeout_s": 5.0}
    tables: dict[str, dict[str, Any]] = {}
    if env.engine == "vllm":
        model = env.models[spec.shape]
        top.update(engine="vllm", model=str(model), tokenizer=str(model / "tokenizer"),
                   load_format="dummy", dtype="bfloat16", gpu_memory_utilization=spec.gpu_mem,
                   tensor_parallel_size=spec.tp, num_gpu_blocks_override=spec.blocks)
        tables["engine_args"] = {"enable_prefix_caching": False, "seed": 0, **env.engine_args,
                                 **spec.engine_args}
    else:
        from gpumesh.node.sim_engine import SimEngineConfig

        base = SimEngineConfig.for_shape(spec.shape)
        top.update(engine="sim", model=SERVED[spec.shape], tensor_parallel_size=spec.tp)
        sim: dict[str, Any] = {"time_scale": env.sim_time_scale,
                               "front_end_tokens_per_s": env.sim_front_end_tok_s,
                               "step_a_ms": base.step_a_ms / max(1, spec.tp) ** 0.5,
                               "step_b_decode_ms": base.step_b_decode_ms,
                               "step_b_prefill_ms": base.step_b_prefill_ms,
                               "kv_capacity_tokens": base.kv_capacity_tokens}
        if env.sim_max_num_seqs:
            sim["max_num_seqs"] = env.sim_max_num_seqs
        if spec.blocks:
            sim["kv_capacity_tokens"] = max(spec.blocks * 16, env.max_model_len)
        tables["sim"] = sim
        if env.sim_scale_intervals and env.sim_time_scale > 0:
            t = env.sim_time_scale
            top.update(heartbeat_busy_interval_s=0.25 * t, heartbeat_idle_interval_s=1.0 * t,
                       flush_interval_ms=max(1, round(20 * t)),
                       stream_messages_per_s=NodeConfig.stream_messages_per_s / t)
    top.update(env.node_options)
    lines = [f"{k} = {_toml_value(v)}" for k, v in top.items()]
    for t, kv in tables.items():
        lines.append(f"[{t}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in kv.items()]
    return "\n".join(lines) + "\n"


class Group:
    """Routers and nodes of one phase; ``with`` stops them all and waits for the GPUs."""

    def __init__(self, env: Env, nodes: Sequence[NodeSpec], routers: Sequence[RouterSpec]) -> None:
        self.env = env
        self.node_specs = list(nodes)
        self.router_specs = list(routers)
        self.children: list[Child] = []
        self.addr: dict[str, str] = {}
        self.commands: list[str] = []
        self.kv_tokens: dict[str, int] = {}

    def placement(self) -> Placement:
        """Each node's process tree on physical cores of its own (near its GPUs), routers
        and the load generator on the rest (gpumesh_bench.affinity)."""
        from gpumesh_bench.affinity import Placement

        kids = {c.name: c for c in self.children}
        nodes = {kids[s.name].popen.pid: [int(g) for g in s.gpus.split(",")]
                 for s in self.node_specs}
        routers = [kids[r.name].popen.pid for r in self.router_specs]
        return Placement.plan(nodes, routers)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        for c in reversed(self.children):
            c.stop()
        if self.env.engine == "vllm":
            wait_gpus_free()

    def start(self, timeout_s: float | None = None) -> None:
        """Routers, then nodes (``after`` ordering), then wait until every router has its
        members healthy: within 400 s for vLLM nodes (engine start and compile), 90 s for the
        simulator."""
        env = self.env
        if timeout_s is None:
            timeout_s = 400.0 if env.engine == "vllm" else 90.0
        routers: dict[str, Child] = {}
        for r in self.router_specs:
            port = free_port()
            self.addr[r.name] = f"127.0.0.1:{port}"
            args = ["router", "--host", "127.0.0.1", "--port", str(port), "--policy", r.policy,
                    "--workers", str(env.workers), "--router-id", r.name.replace(".", "-")]
            renv = {"GPUMESH_LOG_LEVEL": "warning"}
            if env.engine == "sim" and env.sim_scale_intervals and env.sim_time_scale > 0:
                t = env.sim_time_scale   # RouterConfig defaults 1.5 s / 3 s, scaled
                renv.update(GPUMESH_ROUTER_FRESHNESS_S=str(1.5 * t),
                            GPUMESH_ROUTER_LEASE_TTL_S=str(3.0 * t))
            renv.update(env.router_env)
            renv.update(r.env)
            c = Child(r.name, args, env.logs, renv)
            self.children.append(c)
            self.commands.append(c.command())
            routers[r.name] = c
        started: dict[str, Child] = {}

        def launch(spec: NodeSpec) -> None:
            port = free_port()
            self.addr[spec.name] = f"127.0.0.1:{port}"
            cfg = env.logs / f"{spec.name}.toml"
            cfg.write_text(node_toml(env, spec))
            args = ["node", "--config", str(cfg), "--port", str(port), "--node-id", spec.name]
            for r in spec.routers:
                args += ["--router", self.addr[r]]
            child_env = {"CUDA_VISIBLE_DEVICES": spec.gpus} if env.engine == "vllm" else {}
            c = Child(spec.name, args, env.logs, child_env)
            self.children.append(c)
            self.commands.append(c.command() + f"   # {cfg.name}: "
                                 + node_toml(env, spec).replace("\n", "; "))
            started[spec.name] = c

        deadline = time.monotonic() + timeout_s
        pending = list(self.node_specs)
        while pending:
            ready = [s for s in pending if not s.after or s.after in started]
            for s in ready:
                if s.after:
                    wait_serving(self.addr[s.after], started[s.after], deadline)
                launch(s)
                pending.remove(s)
        for s in self.node_specs:
            wait_serving(self.addr[s.name], started[s.name], deadline)
            self.kv_tokens[s.name] = kv_capacity(started[s.name].log_path)
        for r in self.router_specs:
            wait_fleet(self.addr[r.name], set(r.members), deadline, routers[r.name])


def wait_serving(addr: str, child: Child, deadline: float) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            if not child.alive():
                raise RuntimeError(f"{child.name} exited:\n{child.tail()}")
            with contextlib.suppress(grpc.RpcError):
                h = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if h.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{child.name} not serving:\n{child.tail()}")
            time.sleep(0.5)


def fleet_once(router: str, timeout: float = 3.0) -> Any:
    from gpumesh.v1 import control_pb2 as cpb
    from gpumesh.v1 import control_pb2_grpc as cpb_grpc

    with grpc.insecure_channel(router) as ch:
        return cpb_grpc.RouterStub(ch).GetFleet(cpb.GetFleetRequest(), timeout=timeout)


def wait_fleet(router: str, members: set[str], deadline: float,
               child: Child | None = None) -> None:
    """Until ``router`` reports every member healthy; fails at once if its process exits."""
    from gpumesh.v1 import control_pb2 as cpb

    last = "no answer yet"
    while True:
        if child is not None and not child.alive():
            raise RuntimeError(f"router {child.name} exited:\n{child.tail()}")
        try:
            f = fleet_once(router)
        except grpc.RpcError as e:
            last = f"GetFleet: {e.code().name} {e.details()}"
        else:
            healthy = {n.node_id for n in f.nodes if n.state == cpb.NODE_STATE_HEALTHY}
            if members <= healthy:
                time.sleep(1.5)  # every router worker has the whole fleet by now
                return
            last = "fleet: " + ", ".join(
                f"{n.node_id} {cpb.NodeState.Name(n.state)}" for n in f.nodes)
        if time.monotonic() > deadline:
            raise TimeoutError(f"router {router} never saw {sorted(members)} healthy ({last})")
        time.sleep(0.3)


_KV_RE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


def kv_capacity(log: Path) -> int:
    """vLLM's logged KV capacity in tokens (summed over log lines of one node: one per engine)."""
    m = _KV_RE.findall(log.read_text(errors="replace"))
    return int(m[-1].replace(",", "")) if m else 0


def nvidia_smi(query: str) -> str:
    """``nvidia-smi --query-<query> --format=csv,noheader`` output; "" without nvidia-smi."""
    try:
        return subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def gpu_pids() -> list[int]:
    return [int(x) for x in nvidia_smi("compute-apps=pid").split() if x.strip().isdigit()]


def wait_gpus_free(timeout_s: float = 20.0, keep: set[int] | frozenset[int] = frozenset()) -> None:
    """Until no process but ``keep`` holds GPU memory; what still does after ``timeout_s`` is
    killed (an engine core left behind must not cost the next phase its memory)."""
    deadline = time.monotonic() + timeout_s
    while set(gpu_pids()) - keep and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in set(gpu_pids()) - keep:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    time.sleep(1.0)


# --- load and measurement ---------------------------------------------------------------------

class FleetSampler:
    """Polls a router's GetFleet once a second in a thread (the bench runs in processes)."""

    def __init__(self, router: str, status_at_s: float | None,
                 origin: float | None = None) -> None:
        """``origin``: the ``time.time()`` that sample times count from (the load's start
        instant, so ``summary(warm, warm + window)`` is the load's own window); None: from
        entering the context."""
        self.router = router
        self._origin = origin
        self.samples: list[dict[str, Any]] = []
        self.status_text = ""
        self._status_at = status_at_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        if self._origin is None:
            self._origin = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        assert self._origin is not None
        while not self._stop.wait(1.0):
            t = time.time() - self._origin
            with contextlib.suppress(grpc.RpcError):
                f = fleet_once(self.router)
                for n in f.nodes:
                    ld = n.load
                    self.samples.append({
                        "t": round(t, 1), "node": n.node_id, "running": ld.num_running,
                        "waiting": ld.num_waiting, "kv": round(ld.kv_cache_usage, 4),
                        "tok_s": round(ld.generation_tokens_per_s), "in_flight": ld.in_flight,
                        "step_s": ld.decode_step_s,
                        "gpus": [(g.index, round(g.utilization, 2), g.memory_used_bytes,
                               g.memory_total_bytes) for g in ld.gpus], "gpu_model": n.gpu_model})
            if self._status_at is not None and not self.status_text and t >= self._status_at:
                r = subprocess.run([sys.executable, "-m", "gpumesh.cli", "status", "--router",
                                    self.router], capture_output=True, text=True, timeout=20, check=False)
                self.status_text = r.stdout + r.stderr

    def summary(self, t_lo: float, t_hi: float) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for node in sorted({s["node"] for s in self.samples}):
            ss = [s for s in self.samples if s["node"] == node and t_lo <= s["t"] <= t_hi]
            if not ss:
                continue
            util = [g[1] for s in ss for g in s["gpus"]]
            mem = [g[2] for s in ss for g in s["gpus"]]
            out[node] = {
                "kv_mean": _mean([s["kv"] for s in ss]), "kv_max": max(s["kv"] for s in ss),
                "running_mean": _mean([s["running"] for s in ss]),
                # the node servicer's requests: in_flight - running - waiting is what sits in
                # the node process outside the engine (arriving, or streaming its last tokens)
                "in_flight_mean": _mean([s["in_flight"] for s in ss]),
                "waiting_max": max(s["waiting"] for s in ss),
                "step_ms_mean": _mean([s.get("step_s", 0.0) * 1000 for s in ss]),
                "tok_s_mean": _mean([s["tok_s"] for s in ss]),
                "gpu_util_mean": _mean(util) if util else math.nan,
                "gpu_mem_gib": max(mem) / 2**30 if mem else math.nan,
                "gpu_model": ss[-1]["gpu_model"]}
        return out

    def imbalance(self, t_lo: float, t_hi: float) -> dict[str, float]:
        """Two nodes: |in_flight A - in_flight B| (node-reported, the servicer's requests) and
        total waiting over the window's polls (each poll shows the last report of each)."""
        nodes = sorted({s["node"] for s in self.samples})
        if len(nodes) != 2:
            return {}
        by_t: dict[float, dict[str, dict[str, Any]]] = {}
        for s in self.samples:
            if t_lo <= s["t"] <= t_hi:
                by_t.setdefault(s["t"], {})[s["node"]] = s
        pairs = [v for v in by_t.values() if len(v) == 2]
        if not pairs:
            return {}
        diff = sorted(abs(v[nodes[0]]["in_flight"] - v[nodes[1]]["in_flight"]) for v in pairs)
        wait = [v[nodes[0]]["waiting"] + v[nodes[1]]["waiting"] for v in pairs]
        return {"polls": len(pairs), "in_flight_diff_p50": _pct(diff, 50),
                "in_flight_diff_max": diff[-1], "in_flight_diff_mean": _mean(diff),
                "waiting_sum_mean": _mean(wait), "waiting_sum_max": max(wait)}


class CpuSampler:
    """Where the host's cores go during a window: CPU seconds per process group between two
    instants (``time.time()``), as cores. Groups: each node's own process (vLLM's front end:
    output processing, detokenising, our gRPC servicer), the node's children (vLLM's engine
    core and, with TP, its workers), each router (its workers included), the load generator's
    processes; plus the whole machine's busy cores. Reads /proc through psutil (a vLLM
    dependency), so it costs nothing while the window runs."""

    def __init__(self, t_lo: float, t_hi: float) -> None:
        self.t_lo, self.t_hi = t_lo, t_hi
        self.cores: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(max(5.0, self.t_hi - time.time() + 5.0))

    @staticmethod
    def _snapshot() -> tuple[dict[int, tuple[int, list[str], float]], float]:
        import psutil

        procs: dict[int, tuple[int, list[str], float]] = {}
        for p in psutil.process_iter(["pid", "ppid", "cmdline", "cpu_times"]):
            with contextlib.suppress(psutil.Error, TypeError, AttributeError):
                ct = p.info["cpu_times"]
                procs[p.info["pid"]] = (p.info["ppid"], p.info["cmdline"] or [],
                                        ct.user + ct.system)
        t = psutil.cpu_times()
        busy = sum(t) - t.idle - getattr(t, "iowait", 0.0)
        return procs, busy

    @staticmethod
    def label(pid: int, procs: dict[int, tuple[int, list[str], float]], me: int) -> str | None:
        """The group a process belongs to, by its nearest gpumesh ancestor (None: not ours).
        A node's other front-end processes (``frontends``) count as its front end."""
        from gpumesh.node.frontends import PROCESS_TITLE

        own = procs[pid][1] if pid in procs else []
        front = pid if own and own[0].startswith(PROCESS_TITLE) else None
        cur, hops = pid, 0
        while cur in procs and hops < 50:
            if cur == me:
                return "load generator" if pid != me else "bench driver"
            cmd = procs[cur][1]
            if "gpumesh.cli" in cmd and len(cmd) > cmd.index("gpumesh.cli") + 1:
                kind = cmd[cmd.index("gpumesh.cli") + 1]
                if kind not in ("node", "router"):
                    return None
                flag = "--node-id" if kind == "node" else "--router-id"
                name = cmd[cmd.index(flag) + 1] if flag in cmd[:-1] else "?"
                if kind == "router":
                    return f"router {name}"
                return f"node {name}" + (" front end" if pid in (cur, front) else " engine")
            cur, hops = procs[cur][0], hops + 1
        return None

    def _run(self) -> None:
        with contextlib.suppress(Exception):  # a diagnostic: never fails a bench
            time.sleep(max(0.0, self.t_lo - time.time()))
            a, busy_a = self._snapshot()
            t_a = time.time()
            time.sleep(max(0.0, self.t_hi - time.time()))
            b, busy_b = self._snapshot()
            dt = max(1e-6, time.time() - t_a)
            me = os.getpid()
            out: dict[str, float] = {}
            busiest: dict[str, float] = {}   # routers, node front ends: the busiest process
            for pid, (_, _, cpu) in b.items():
                lab = self.label(pid, b, me)
                if lab is None:
                    continue
                c = (cpu - a[pid][2] if pid in a else cpu) / dt
                out[lab] = out.get(lab, 0.0) + c
                if lab.startswith("router ") or lab.endswith(" front end"):
                    busiest[lab] = max(busiest.get(lab, 0.0), c)
            for lab, c in busiest.items():
                # One worker near a full core while the sum is well below workers x 1: the
                # kernel's SO_REUSEPORT split of client connections, not the router's total.
                out[f"{lab} busiest process"] = c
            out["machine (all processes)"] = (busy_b - busy_a) / dt
            self.cores = {k: round(v, 2) for k, v in sorted(out.items())}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _pct(xs: Sequence[float], p: float) -> float:
    from gpumesh_bench.stats import percentile

    return percentile(list(xs), p)


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
    from gpumesh_bench.cli import StreamSpec, run_multi, start_instant
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
    if res and len(ok) < len(res) / 2:  # a broken setup: stop the phase, keep the device time
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


# --- phases -------------------------------------------------------------------------------------

def phase_raw(env: Env, shape: str = "0.5b", dp: bool = False) -> None:
    """The raw-vLLM reference tool in this session at the reference's concurrency C: one
    engine on GPU 0; ``dp``: also two engines at once, C/2 each on GPUs 0 and 1 (the
    reference's data-parallel method, shared/gpu/seed_table.sh), recorded as one row."""
    if env.engine != "vllm" or not env.raw_tool:
        print("[gpu-bench] raw: skipped (needs --engine vllm and --raw-tool)", flush=True)
        return
    c = RAW_CONCURRENCY[shape]
    tag = shape.replace(".", "")
    run_raw(env, shape, "raw vLLM (in session)", [("0", c, 0)], tag)
    if dp:
        run_raw(env, shape, "raw vLLM data parallel (in session)",
                [(g, c // 2, int(g)) for g in ("0", "1")], f"{tag}-dp")


def run_raw(env: Env, shape: str, setup: str, parts: Sequence[tuple[str, int, int]], tag: str,
            *, phase: str = "raw", gpu_mem: float | None = None,
            extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """One run of the raw-vLLM reference tool (``env.raw_tool``, unmodified): an engine per
    (GPU, concurrency, seed) part, all at once, recorded as one row (QPS and tokens/s summed,
    latency percentiles the worst part's). ``gpu_mem``: the tool's ``--gpu-mem`` (its own
    default, 0.85, when None). Returns the record, or None when a part gave no result."""

    def argv(conc: int, json_out: Path, seed: int) -> list[str]:
        cmd = [sys.executable, env.raw_tool, "--shape", shape, "--tp", "1", "--concurrency",
               str(conc), "--seconds", str(env.window_s), "--warmup", str(env.warmup_s),
               "--base", str(env.models["0.5b"]), "--json", str(json_out), "--seed", str(seed)]
        return cmd + (["--gpu-mem", f"{gpu_mem:g}"] if gpu_mem is not None else [])

    def launch(cmd: list[str], gpu: str, log: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as f:
            return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                    env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu})

    suffix = [f"-{g}" if len(parts) > 1 else "" for g, _, _ in parts]
    runs = [(g, argv(c, env.logs / f"raw-{tag}{x}.jsonl", seed), env.logs / f"raw-{tag}{x}.log")
            for (g, c, seed), x in zip(parts, suffix)]
    for _, cmd, _ in runs:
        Path(cmd[cmd.index("--json") + 1]).unlink(missing_ok=True)
    before = set(gpu_pids())   # a node sharing the GPU (phase vsraw) keeps its memory
    procs = [launch(cmd, g, log) for g, cmd, log in runs]
    for p in procs:
        try:
            p.wait(300)
        except subprocess.TimeoutExpired:
            p.kill()
    wait_gpus_free(keep=before)
    rows = []
    for _, cmd, log in runs:
        out = Path(cmd[cmd.index("--json") + 1])
        rows += [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    if len(rows) != len(runs):
        print(f"[gpu-bench] raw {shape} {setup}: no result\n"
              + "\n".join(log.read_text(errors="replace")[-1500:] for _, _, log in runs))
        return None
    rec = {"phase": phase, "setup": setup, "shape": shape, "call": env.call,
           "concurrency": sum(r["concurrency"] for r in rows),
           "qps": round(sum(r["qps"] for r in rows), 2),
           "lat_p50": max(r["lat_p50"] for r in rows), "lat_p99": max(r["lat_p99"] for r in rows),
           "ttft_p50": max(r["ttft_p50"] for r in rows),
           "out_tok_s": round(sum(r["out_tok_s"] for r in rows), 1),
           "command": " & ".join(f"CUDA_VISIBLE_DEVICES={g} python3 seed_table.py "
                                 + " ".join(cmd[2:]) for g, cmd, _ in runs),
           "engine": "vllm-raw", "parts": rows, **(extra or {})}
    env.records.append(rec)
    print(f"[gpu-bench] {phase:8} {shape} {setup:36} c={rec['concurrency']:<4} "
          f"qps={rec['qps']:7.1f} p50={rec['lat_p50']:.3f}s", flush=True)
    env.save()
    return rec


ENG_SETUPS = ("engine loop, 1 GPU (node's engine, no gRPC)",
              "engine loop, 2 GPUs data parallel (node's engine, no gRPC)")


def _max(xs: Sequence[Any]) -> Any:
    vs = [x for x in xs if isinstance(x, (int, float)) and not math.isnan(x)]
    return max(vs) if vs else None


def phase_eng(env: Env, shape: str, gpus: int) -> None:
    """The node's own engine in a closed loop in one process, without gRPC
    (``gpumesh bench engine-loop``, gpumesh_bench.engine_loop), on the node TOML a node of this
    shape gets in the other phases (same engine arguments, ``--engine-arg`` included), at the
    raw reference's concurrency C: one loop on GPU 0, then (two GPUs or more) two loops at
    once on GPUs 0 and 1, C/2 each, starting their load together, recorded as one row the way
    ``phase_raw`` combines its data-parallel pair (QPS and tokens/s summed, latency percentiles
    the worse of the two). Raw vs these rows is the node's engine configuration; these rows vs
    the node direct is the node's serving path (servicer, coalescing, gRPC)."""
    c = RAW_CONCURRENCY[shape]
    run_eng(env, shape, ENG_SETUPS[0], [("0", c)], f"{shape.replace('.', '')}-1gpu")
    if gpus >= 2:
        run_eng(env, shape, ENG_SETUPS[1], [("0", c // 2), ("1", c // 2)],
                f"{shape.replace('.', '')}-2gpu")


def run_eng(env: Env, shape: str, setup: str, parts: Sequence[tuple[str, int]], tag: str, *,
            phase: str = "eng", gpu_mem: float = 0.85,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One engine-loop row: a loop per (GPU, concurrency) part, their load started together,
    each engine at ``gpu_mem`` of its GPU. Raises when a loop gave no record."""
    n = len(parts)
    sync = env.logs / f"eng-{tag}-sync"
    if sync.exists():
        for f in sync.iterdir():
            f.unlink()
    children: list[tuple[Child, Path]] = []
    cmds: list[str] = []
    before = set(gpu_pids())   # a node sharing the GPU (phase vsraw) keeps its memory
    for g, conc in parts:
        spec = NodeSpec(f"eng{tag}-{g}", shape, g, gpu_mem)
        cfg = env.logs / f"{spec.name}.toml"
        cfg.write_text(node_toml(env, spec))
        out = env.logs / f"{spec.name}.json"
        out.unlink(missing_ok=True)
        args = ["bench", "engine-loop", "--config", str(cfg), "--concurrency", str(conc),
                "--warmup", f"{env.warmup_s:g}", "--seconds", f"{env.window_s:g}",
                "--prompt", env.prompt, "--output", env.output, "--json", str(out)]
        if n > 1:
            args += ["--sync-dir", str(sync), "--sync-count", str(n)]
        child_env = {"CUDA_VISIBLE_DEVICES": g} if env.engine == "vllm" else {}
        ch = Child(spec.name, args, env.logs, child_env)
        children.append((ch, out))
        cmds.append(ch.command() + f"   # {cfg.name}: "
                    + node_toml(env, spec).replace("\n", "; "))
    env.meta.setdefault("commands", {})[f"eng{tag}"] = cmds
    # Until every loop has exited or written its record 20 s ago (a process that hangs in
    # its exit after a CUDA engine's shutdown must not cost the budget), or one has died
    # without a record (its partner would wait for it at the sync barrier).
    deadline = time.monotonic() + 300
    written: dict[str, float] = {}
    while time.monotonic() < deadline:
        now = time.monotonic()
        for ch, out in children:
            if ch.name not in written and out.exists():
                written[ch.name] = now
        alive = [ch for ch, _ in children if ch.alive()]
        if all(now - written.get(ch.name, now) > 20 for ch in alive):
            break
        if any(not ch.alive() and not out.exists() for ch, out in children):
            break
        time.sleep(0.5)
    for ch, _ in children:
        if ch.alive():
            print(f"[gpu-bench] eng {shape} {setup}: {ch.name} "
                  + ("had not exited 20 s after its record" if ch.name in written
                     else "timed out or waited for a failed partner") + ": stopped",
                  flush=True)
    for ch, _ in children:
        ch.stop()
    if env.engine == "vllm":
        wait_gpus_free(keep=before)
    rows = [json.loads(out.read_text()) for _, out in children if out.exists()]
    if len(rows) != n:
        raise RuntimeError(f"eng {shape} {setup}: {n - len(rows)} of {n} loops gave no "
                           "result\n" + "\n".join(ch.tail(1500) for ch, _ in children))
    rec: dict[str, Any] = {
        "phase": phase, "setup": setup, "shape": shape, "call": env.call,
        "concurrency": sum(r["concurrency"] for r in rows),
        "prompt": env.prompt, "output": env.output,
        "warmup_s": env.warmup_s, "window_s": env.window_s,
        "requests": sum(r["requests"] for r in rows),
        "errors": sum(r["errors"] for r in rows),
        "completed": sum(r["completed"] for r in rows),
        "qps": round(sum(r["qps"] for r in rows), 2),
        "done_qps": round(sum(r["done_qps"] for r in rows), 2),
        "out_tok_s": round(sum(r["out_tok_s"] for r in rows), 1),
        **{k: _max([r.get(k) for r in rows])
           for k in ("lat_p50", "lat_p99", "ttft_p50", "ttft_p99", "tpot_p50")},
        "engine_load": {f"gpu{g}": r.get("engine_load") for (g, _), r in zip(parts, rows)},
        "cpu_cores": {f"loop gpu{g} {k}": v for (g, _), r in zip(parts, rows)
                      for k, v in (r.get("cpu_cores") or {}).items()},
        "kv_tokens": rows[0].get("kv_tokens"), "init_s": [r.get("init_s") for r in rows],
        "command": " & ".join(ch.command() for ch, _ in children),
        "engine": env.engine, "parts": rows, **(extra or {})}
    if env.engine == "vllm" and env.engine_args:
        rec["engine_args"] = env.engine_args
    if env.node_options:
        rec["node_options"] = env.node_options
    env.records.append(rec)
    env.save()
    run = " / ".join(f"{fmt((r.get('engine_load') or {}).get('running_mean'), 0)}"
                     for r in rows)
    print(f"[gpu-bench] {phase:8} {shape} {setup:58} c={rec['concurrency']:<4} "
          f"qps={rec['qps']:7.1f} done_qps={rec['done_qps']:7.1f} "
          f"p50={fmt(rec['lat_p50'], 3)}s tpot50={fmt((rec['tpot_p50'] or 0) * 1000)}ms "
          f"running {run} errors={rec['errors']}", flush=True)
    return rec


def _pair(env: Env, shape: str, gpus: int) -> tuple[str, str, list[NodeSpec], list[RouterSpec]]:
    """Node A on GPU 0 behind router r1; with two GPUs also node B on GPU 1 and router r2
    (policy ``env.policy``) fronting A and B. Returns (A, B, nodes, routers)."""
    a, b = f"a{shape.replace('.', '')}", f"b{shape.replace('.', '')}"
    two = gpus >= 2
    dp = ("r2", "r2b") if env.router_env_b else ("r2",)
    nodes = [NodeSpec(a, shape, "0", 0.85, routers=("r1", *dp) if two else ("r1",))]
    routers = [RouterSpec("r1", members=(a,))]
    if two:
        # After A serves: B then finds vLLM's compile cache warm instead of racing A to fill it.
        nodes.append(NodeSpec(b, shape, "1", 0.85, routers=dp, after=a))
        routers.append(RouterSpec("r2", policy=env.policy, members=(a, b)))
        if env.router_env_b:
            routers.append(RouterSpec("r2b", policy=env.policy, members=(a, b),
                                      env=dict(env.router_env_b)))
    return a, b, nodes, routers


def _placements(env: Env, g: Group, phase: str) -> list[Placement | None]:
    """The CPU placements a phase's benches run under (``--pin``): [None] (off), [pinned]
    (on), [None, pinned] (both); a host too small to pin runs unpinned and says so."""
    if env.pin == "off":
        return [None]
    try:
        pl = g.placement()
    except ValueError as e:
        print(f"[gpu-bench] {phase}: not pinned: {e}", flush=True)
        env.meta.setdefault("not_pinned", {})[phase] = str(e)
        return [None]
    env.meta.setdefault("cpu_sets", {})[phase] = pl.describe()
    print(f"[gpu-bench] {phase}: cpu sets {pl.describe()}", flush=True)
    return [pl] if env.pin == "on" else [None, pl]


def _pair_phase(env: Env, shape: str, gpus: int, phase: str, sweep: bool) -> None:
    c1 = RAW_CONCURRENCY[shape]
    a, b, nodes, routers = _pair(env, shape, gpus)
    with Group(env, nodes, routers) as g:
        g.start()
        env.meta.setdefault("commands", {})[phase] = g.commands
        env.meta.setdefault("kv_tokens", {}).update(g.kv_tokens)
        pl = _placements(env, g, phase)[-1]   # the main table: pinned under on and both
        kv = {"kv_tokens": g.kv_tokens[a]}
        bench(env, phase=phase, setup="1 GPU, direct to node", shape=shape, target=g.addr[a],
              concurrency=c1, poll=g.addr["r1"], extra=kv, placement=pl)
        bench(env, phase=phase, setup="1 GPU, through router", shape=shape, target=g.addr["r1"],
              concurrency=c1, poll=g.addr["r1"], status=True, extra=kv, placement=pl)
        if gpus >= 2:
            for c in (c1, 2 * c1):
                bench(env, phase=phase, setup="2 GPUs data parallel, router", shape=shape,
                      target=g.addr["r2"], concurrency=c, poll=g.addr["r2"], status=c == c1,
                      placement=pl)
            # The same two nodes with the client splitting its streams itself: what data
            # parallel gives on this machine without a router, so the router's share shows.
            bench(env, phase=phase, setup="2 GPUs data parallel, direct (client splits)",
                  shape=shape, target=g.addr[a], concurrency=2 * c1, poll=g.addr["r2"],
                  split=(g.addr[a], g.addr[b]), placement=pl)
        if sweep:
            _sweep(env, shape, g.addr[a], g.addr["r1"])


def _sweep(env: Env, shape: str, target: str, poll: str) -> None:
    """Step time vs batch (TPOT at concurrency C) and prefill time vs prompt length."""
    for c in (1, 32, 256, 512):
        bench(env, phase="sweep", setup="decode sweep, direct", shape=shape, target=target,
              concurrency=c, poll=poll, warmup_s=2.0, window_s=6.0)
    for n in (1024, 1900):
        bench(env, phase="sweep", setup="prefill probe, direct", shape=shape, target=target,
              concurrency=1, prompt=f"fixed:{n}", output="fixed:1", warmup_s=1.0, window_s=3.0)


def phase_p05(env: Env, gpus: int) -> None:
    _pair_phase(env, "0.5b", gpus, "p05", sweep=True)


def phase_ab(env: Env, shape: str, gpus: int, phase: str, rounds: int = 2,
             dp_only: bool = False) -> None:
    """Repeats, interleaved on the same nodes: one GPU direct vs through the router (ABAB),
    then (two GPUs) data parallel through the router vs the client splitting its streams;
    ``dp_only``: data parallel router vs client split, ``rounds`` times (ABAB); with a
    multi-worker router also the router with the load spread over its workers (ABCABC)."""
    c1 = RAW_CONCURRENCY[shape]
    a, b, nodes, routers = _pair(env, shape, gpus)
    with Group(env, nodes, routers) as g:
        g.start()
        env.meta.setdefault("commands", {})[phase] = g.commands
        if dp_only and gpus >= 2:
            x = {"policy": env.policy, "workers": env.workers}
            pins = _placements(env, g, phase)
            for k in range(rounds):
                for pl in pins:
                    tag = ", pinned" if pl is not None else ""
                    y = {**x, "round": k, "pinned": pl is not None}
                    bench(env, phase=phase, setup=f"2 GPUs data parallel, router{tag} #{k}",
                          shape=shape, target=g.addr["r2"], concurrency=2 * c1,
                          poll=g.addr["r2"], extra=y, placement=pl)
                    if env.router_env_b:
                        bench(env, phase=phase, shape=shape, target=g.addr["r2b"],
                              setup=f"2 GPUs data parallel, router B{tag} #{k}",
                              concurrency=2 * c1, poll=g.addr["r2b"],
                              extra={**y, "router_env_b": env.router_env_b}, placement=pl)
                    if env.workers > 1 and not env.spread_workers:
                        bench(env, phase=phase, shape=shape, target=g.addr["r2"],
                              setup=f"2 GPUs data parallel, router, spread over workers{tag} #{k}",
                              concurrency=2 * c1, poll=g.addr["r2"], extra=y, spread=True,
                              placement=pl)
                    bench(env, phase=phase,
                          setup=f"2 GPUs data parallel, direct (client splits){tag} #{k}",
                          shape=shape, target=g.addr[a], concurrency=2 * c1, poll=g.addr["r2"],
                          split=(g.addr[a], g.addr[b]), extra=y, placement=pl)
            return
        for k in range(rounds):
            x = {"round": k}
            bench(env, phase=phase, setup=f"1 GPU, direct to node #{k}", shape=shape,
                  target=g.addr[a], concurrency=c1, poll=g.addr["r1"], extra=x)
            bench(env, phase=phase, setup=f"1 GPU, through router #{k}", shape=shape,
                  target=g.addr["r1"], concurrency=c1, poll=g.addr["r1"], extra=x)
        if gpus >= 2:
            bench(env, phase=phase, setup="2 GPUs data parallel, router #0", shape=shape,
                  target=g.addr["r2"], concurrency=2 * c1, poll=g.addr["r2"])
            bench(env, phase=phase, setup="2 GPUs data parallel, direct (client splits) #0",
                  shape=shape, target=g.addr[a], concurrency=2 * c1, poll=g.addr["r2"],
                  split=(g.addr[a], g.addr[b]))


def phase_msg(env: Env, shape: str, gpus: int, phase: str, rounds: int = 2) -> None:
    """The node's stream-message budget on and off on the same nodes, interleaved (ABAB):
    every request of B asks for the node's base interval (20 ms) itself, which the node keeps
    as asked, i.e. the fixed interval of a node without the budget. One GPU direct to the node
    at the reference's concurrency, then (two GPUs) data parallel through the router at twice
    it, ``rounds`` times each. Each record names its pair: ``base_setup``, ``round`` and
    ``leg`` ("budget" or "fixed"), which the report pairs by."""
    c1 = RAW_CONCURRENCY[shape]
    a, _, nodes, routers = _pair(env, shape, gpus)
    # the node's base interval (scaled with a slowed simulation, as node_toml scales it)
    fixed = (max(1, round(20 * env.sim_time_scale))
             if env.engine == "sim" and env.sim_scale_intervals else 20)
    with Group(env, nodes, routers) as g:
        g.start()
        env.meta.setdefault("commands", {})[phase] = g.commands
        runs = [("1 GPU, direct to node", g.addr[a], c1, g.addr["r1"])]
        if gpus >= 2:
            runs.append(("2 GPUs data parallel, router", g.addr["r2"], 2 * c1, g.addr["r2"]))
        for setup, target, c, poll in runs:
            for k in range(rounds):
                for leg, label, f in (("budget", "message budget", 0),
                                      ("fixed", f"fixed {fixed} ms", fixed)):
                    bench(env, phase=phase, setup=f"{setup}, {label} #{k}", shape=shape,
                          target=target, concurrency=c, poll=poll, flush_interval_ms=f,
                          extra={"round": k, "leg": leg, "base_setup": setup})


def phase_fe(env: Env, shape: str, gpus: int, phase: str, rounds: int = 1,
             counts: tuple[int, int] = (1, 2)) -> None:
    """Nodes with one front-end process against nodes with several (node option
    ``frontends``, node.frontends), ABAB over ``rounds`` (the option is the nodes' process
    layout, so each leg starts fresh nodes): one GPU direct to the node and through the
    router at the reference's concurrency, then (two GPUs) data parallel through the router
    at twice it. Records carry ``leg`` ("fe<N>"), ``base_setup``, ``round`` and ``frontends``;
    the report pairs them with the one-front-end bench of the same round."""
    if env.engine != "vllm" and max(counts) > 1:
        raise ValueError("several front ends per node need vLLM nodes (the simulator has one)")
    c1 = RAW_CONCURRENCY[shape]
    a, _, nodes, routers = _pair(env, shape, gpus)
    saved = dict(env.node_options)
    try:
        for k in range(rounds):
            for n in (counts if k % 2 == 0 else tuple(reversed(counts))):
                env.node_options = {**saved, "frontends": n}
                with Group(env, nodes, routers) as g:
                    g.start()
                    env.meta.setdefault("commands", {})[f"{phase} frontends={n}"] = g.commands
                    runs = [("1 GPU, direct to node", g.addr[a], c1, g.addr["r1"]),
                            ("1 GPU, through router", g.addr["r1"], c1, g.addr["r1"])]
                    if gpus >= 2:
                        runs.append(("2 GPUs data parallel, router", g.addr["r2"], 2 * c1,
                                     g.addr["r2"]))
                    for setup, target, c, poll in runs:
                        bench(env, phase=phase, setup=f"{setup}, {n} front ends #{k}",
                              shape=shape, target=target, concurrency=c, poll=poll,
                              extra={"round": k, "leg": f"fe{n}", "base_setup": setup,
                                     "frontends": n})
    finally:
        env.node_options = saved


VSRAW_GPU_MEM = 0.42   # the node's and the raw engine's share of GPU 0 (as phase share)
# With --vs-variant: three engines on a GPU (node, variant node, raw), 0.84 in all. KV at 0.28
# of an H200 still holds C x (32 + 256) tokens many times over (0.5B and 7B).
VSRAW_GPU_MEM_VARIANT = 0.28
VSRAW_LEGS = ("raw", "eng", "router", "router-x", "direct", "direct-x")
# A round's legs (s). Raw: the raw tool's engine start (warm compile cache), its window and
# exit; a node bench: the load generator's start, warm-up and window. Measured on warm H200
# machines: phase raw 55.5 s (0.5B, engine start 15.8-18.6 s), raw7 with data parallel
# 155.5 s; a 0.5B bench ~23 s; vsraw05's 3 rounds of raw + 2 benches ~100 s each (ninth
# session). A machine's first raw run also compiles (~+50 s).
VSRAW_RAW_S = {"0.5b": 55, "7b": 80}
VSRAW_BENCH_S = {"0.5b": 28, "7b": 36}
VSRAW_ENG_S = {"0.5b": 60, "7b": 80}   # --vs-eng: an engine loop's start, window and exit
# The nodes' start (s), before the first round (a phase needs that and one round to begin);
# twice that with --vs-variant (a second set of nodes)
VSRAW_START_S = {"vsraw05": 100, "vsraw7": 150, "vsrawdp05": 140, "vsrawdp7": 200}


def vsraw_round_s(shape: str, env: Env) -> float:
    """Seconds one vsraw round of ``shape`` needs (its legs)."""
    legs = vsraw_legs(env)
    return (VSRAW_RAW_S[shape] * ("raw" in legs) + VSRAW_ENG_S[shape] * ("eng" in legs)
            + VSRAW_BENCH_S[shape] * len([x for x in legs if x not in ("raw", "eng")]))


def vsraw_need(phase: str, env: Env) -> float:
    """Seconds a vsraw phase needs for its nodes' start and one round."""
    shape = "7b" if phase.endswith("7") else "0.5b"
    return VSRAW_START_S[phase] * (2 if env.vs_variant else 1) + vsraw_round_s(shape, env)


def vsraw_legs(env: Env) -> tuple[str, ...]:
    """The legs of a vsraw round in their first-round order (``--vs-eng``, ``--vs-variant``,
    ``--vs-legs``)."""
    legs = [x for x in VSRAW_LEGS
            if (x != "eng" or env.vs_eng) and (not x.endswith("-x") or env.vs_variant)]
    if env.vs_legs:
        legs = [x for x in legs if x in env.vs_legs]
    return tuple(legs)


def phase_vsraw(env: Env, shape: str, phase: str, rounds: int = 3, dp: bool = False) -> None:
    """The mesh against raw vLLM on the same GPUs, interleaved: the nodes (``env.node_options``
    included, e.g. frontends=2) and their router stay up at ``VSRAW_GPU_MEM`` of their GPU's
    memory while, in each round, the raw reference tool (unmodified, its own engines at the
    same share, started and stopped per run), the nodes through the router and the nodes
    direct are benched in turn at the reference's concurrency C; the order reverses every
    round (raw, router, direct; direct, router, raw; ...) so drift within a call weighs on
    both sides. Only one engine per GPU has requests at a time (an idle vLLM engine core
    waits on its input queue).

    One GPU: node A on GPU 0 behind r1; raw = one engine at C. ``dp`` (two GPUs): nodes A and
    B on GPUs 0 and 1 behind r2; raw = two engines at once, C/2 each (the reference's data
    parallel method); "direct" = the client splitting its C streams over A and B.

    ``env.vs_eng`` (``--vs-eng``): every round also runs the node's own engine without gRPC
    (``run_eng``: an engine loop per GPU at the same share, started per run) next to raw,
    so raw vs engine loop (the node's engine configuration) and engine loop vs direct (its
    serving path) come from the same rounds.

    ``env.vs_variant`` (``--vs-variant``): nodes X (and Y) with those engine arguments on top
    of the bench's, behind their own router, on the same GPUs; legs "router-x" and "direct-x"
    bench them in the same rounds, so raw, the nodes and the variant nodes pair round by round
    (every engine at ``VSRAW_GPU_MEM_VARIANT``, three to a GPU). ``env.vs_legs`` keeps some.

    Records carry ``round``, ``leg`` ("raw", "eng", "router", "direct", "router-x",
    "direct-x"), ``base_setup`` and, for the variant's legs, ``variant``;
    the report gives each bench's QPS over its round's raw run and the median over rounds:
    issue 7's ratio with the host's run-to-run spread (1.5x between raw runs of one machine)
    paired out. Without a raw tool (``--engine sim``) the raw legs are skipped and said so."""
    c = RAW_CONCURRENCY[shape]
    tag = shape.replace(".", "")
    a, b, xa, xb = f"v{tag}", f"w{tag}", f"x{tag}", f"y{tag}"
    variant = dict(env.vs_variant)
    mem = VSRAW_GPU_MEM_VARIANT if variant else VSRAW_GPU_MEM
    r = "r2" if dp else "r1"
    xr = f"{r}x"
    sets = [(a, b, r, {})] + ([(xa, xb, xr, variant)] if variant else [])
    nodes: list[NodeSpec] = []
    routers: list[RouterSpec] = []
    for first, second, router, args in sets:
        after = nodes[-1].name if nodes else ""   # one start at a time (profiling per process)
        mine = [NodeSpec(first, shape, "0", mem, routers=(router,), after=after,
                         engine_args=args)]
        if dp:
            mine.append(NodeSpec(second, shape, "1", mem, routers=(router,), after=first,
                                 engine_args=args))
        nodes += mine
        routers.append(RouterSpec(router, policy=env.policy,
                                  members=tuple(n.name for n in mine)))
    if dp:
        base, raw_parts = "2 GPUs data parallel", [("0", c // 2), ("1", c // 2)]
    else:
        base, raw_parts = "1 GPU", [("0", c)]
    with Group(env, nodes, routers) as g:
        g.start()
        env.meta.setdefault("commands", {})[phase] = g.commands
        env.meta.setdefault("kv_tokens", {}).update(g.kv_tokens)
        raw_ok = env.engine == "vllm" and bool(env.raw_tool)
        if not raw_ok:
            print(f"[gpu-bench] {phase}: raw legs skipped (need --engine vllm and --raw-tool)",
                  flush=True)
        legs = vsraw_legs(env)
        per_round = vsraw_round_s(shape, env)
        for k in range(rounds):
            left = env.budget_end - time.monotonic()
            if k and left < per_round:
                print(f"[gpu-bench] {phase}: stopped after {k} of {rounds} rounds ({left:.0f}s "
                      f"of the budget left, a round needs ~{per_round}s)", flush=True)
                env.meta.setdefault("cut", []).append(f"{phase}: {k} of {rounds} rounds")
                break
            for leg in (legs if k % 2 == 0 else tuple(reversed(legs))):
                x = {"round": k, "leg": leg, "base_setup": base, "gpu_mem": mem}
                if leg.endswith("-x"):
                    x["variant"] = variant
                n1, n2, rt = (xa, xb, xr) if leg.endswith("-x") else (a, b, r)
                sfx = ", variant" if leg.endswith("-x") else ""
                if leg == "raw":
                    if raw_ok and run_raw(
                            env, shape, f"raw vLLM, same GPU{'s' if dp else ''} #{k}",
                            [(gpu, conc, 2 * k + n) for n, (gpu, conc) in enumerate(raw_parts)],
                            f"{phase}-{k}", phase=phase, gpu_mem=mem,
                            extra=x) is None:   # its log's tail is printed; the rest still run
                        env.meta.setdefault("failed", []).append(f"{phase} raw #{k}: no result")
                elif leg == "eng":
                    try:
                        run_eng(env, shape, f"engine loop, same GPU{'s' if dp else ''} #{k}",
                                raw_parts, f"{tag}-{phase}-{k}", phase=phase,
                                gpu_mem=mem, extra=x)
                    except RuntimeError as e:   # the other legs and rounds still run
                        print(f"[gpu-bench] {phase}: {e}"[:3000], flush=True)
                        env.meta.setdefault("failed", []).append(f"{phase} eng #{k}: {e}"[:500])
                elif leg.startswith("router"):
                    via = "router" if dp else "through router"
                    bench(env, phase=phase, setup=f"{base}, {via}{sfx} #{k}", shape=shape,
                          target=g.addr[rt], concurrency=c, poll=g.addr[rt],
                          extra={**x, "kv_tokens": g.kv_tokens[n1]})
                else:
                    bench(env, phase=phase, shape=shape, target=g.addr[n1], concurrency=c,
                          setup=(f"{base}, direct (client splits){sfx} #{k}" if dp
                                 else f"{base}, direct to node{sfx} #{k}"),
                          split=(g.addr[n1], g.addr[n2]) if dp else (), poll=g.addr[rt],
                          extra={**x, "kv_tokens": g.kv_tokens[n1]})


def phase_p05q(env: Env, gpus: int) -> None:
    """``p05`` without the sweep (its records are ``p05``'s): a rerun of the main table."""
    _pair_phase(env, "0.5b", gpus, "p05", sweep=False)


def phase_p7(env: Env, gpus: int) -> None:
    _pair_phase(env, "7b", gpus, "p7", sweep=False)


def phase_share(env: Env) -> None:
    nodes = [NodeSpec("s1", "0.5b", "0", 0.42, routers=("rs",)),
             NodeSpec("s2", "0.5b", "0", 0.42, routers=("rs",), after="s1")]
    with Group(env, nodes, [RouterSpec("rs", members=("s1", "s2"))]) as g:
        g.start()
        env.meta.setdefault("commands", {})["share"] = g.commands
        env.meta.setdefault("kv_tokens", {}).update(g.kv_tokens)
        bench(env, phase="share", setup="2 nodes share 1 GPU, router", shape="0.5b",
              target=g.addr["rs"], concurrency=128, poll=g.addr["rs"], status=True)


def phase_unequal(env: Env, gpus: int = 1, phase: str = "unequal") -> None:
    """Two 0.5B nodes, ``small`` with its KV cache cut; one router per policy, each benched.
    On one GPU both share GPU 0 (0.42 of memory each); with ``gpus`` >= 2 each has its own."""
    routers = [RouterSpec(f"q-{p.replace('_', '-')}", p, ("big", "small")) for p in POLICIES]
    names = tuple(r.name for r in routers)
    two = gpus >= 2
    mem = 0.85 if two else 0.42
    nodes = [NodeSpec("big", "0.5b", "0", mem, routers=names),
             NodeSpec("small", "0.5b", "1" if two else "0", mem, blocks=env.small_kv_blocks,
                      routers=names, after="big")]
    with Group(env, nodes, routers) as g:
        g.start()
        env.meta.setdefault("commands", {})[phase] = g.commands
        env.meta.setdefault("kv_tokens", {}).update(g.kv_tokens)
        for r in routers:
            bench(env, phase=phase, setup=f"policy {r.policy}", shape="0.5b",
                  target=g.addr[r.name], concurrency=128, prompt="fixed:512",
                  output="uniform:128:256", poll=g.addr[r.name], extra={"policy": r.policy},
                  warmup_s=3.0, window_s=12.0)


def _tp_phase(env: Env, shape: str, phase: str) -> None:
    nodes = [NodeSpec(f"t{shape.replace('.', '')}", shape, "0,1", 0.85, tp=2, routers=("rt",))]
    with Group(env, nodes, [RouterSpec("rt", members=(nodes[0].name,))]) as g:
        g.start()
        env.meta.setdefault("commands", {})[phase] = g.commands
        env.meta.setdefault("kv_tokens", {}).update(g.kv_tokens)
        bench(env, phase=phase, setup="2 GPUs tensor parallel, router", shape=shape,
              target=g.addr["rt"], concurrency=RAW_CONCURRENCY[shape], poll=g.addr["rt"],
              status=True)


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
    from gpumesh_bench.dummy_model import build_dummy_model

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
    budget_end = env.budget_end = time.monotonic() + a.budget
    # Rough worst cases (s) of each phase, so a call stops before its limit, not in a phase.
    # eng05/eng7: one engine start, then two at once (raw7, a phase of that shape, took 155 s).
    need = {"raw": 90, "raw7": 200, "rawdp05": 150, "p05": 290, "p05q": 170, "share": 100, "unequal": 150, "unequal2": 150,
            "tp05": 120, "p7": 260, "tp7": 150, "ab7": 230, "ab05": 200, "dp05": 120,
            "dp7": 330, "eng05": 160, "eng7": 200, "msg05": 300, "msg7": 400,
            "fe05": 300, "fe7": 420,
            # the node's start and one round (the phase stops before a round that won't fit)
            **{ph: vsraw_need(ph, env) for ph in VSRAW_START_S}}
    failed = []
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
        print(f"[gpu-bench] === phase {ph} ({left:.0f}s of budget left)", flush=True)
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
    md = report_markdown(env.records, env.meta)
    (out / "summary.md").write_text(md)
    with contextlib.suppress(Exception):
        plot(env.records, out / "plots.png")
    print(md)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpumesh_bench.gpu", description=__doc__,
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
                        "(17500 = the H200 host of the second GPU session); 0 = none")
    r.add_argument("--sim-max-num-seqs", type=int, default=0,
                   help="--engine sim: max_num_seqs of each node (128 = vLLM's bare-engine "
                        "default the GPU runs had); 0 = the simulator's default")
    r.add_argument("--sim-scale-intervals", action="store_true",
                   help="--engine sim: scale the nodes' flush and heartbeat intervals and the "
                        "router's freshness window and lease by --sim-time-scale (the GPU "
                        "system's heartbeats per request and tokens per message)")
    r.add_argument("--policy", default="weighted_least_load", choices=POLICIES,
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
                        "GPUMESH_ROUTER_PREFILL_FROM_CAPACITY=0")
    r.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                   help="extra vLLM engine argument of every vLLM node (the node TOML's "
                        "[engine_args]; VALUE is JSON, else a string), e.g. stream_interval=4; "
                        "repeats")
    r.add_argument("--node-option", action="append", default=[], metavar="NAME=VALUE",
                   help="a top-level key of every node's TOML (node.config.NodeConfig; VALUE "
                        "is JSON, else a string), e.g. stream_messages_per_s=0; repeats")
    r.add_argument("--spread-workers", action="store_true",
                   help="load processes round-robin over the router's workers' own ports "
                        "(gpumesh.client.spread_target) instead of one hashed connection each")
    r.add_argument("--pin", choices=["off", "on", "both"], default="off",
                   help="dp05/dp7: node process trees on physical cores of their own near their "
                        "GPUs, routers and load on the rest (gpumesh_bench.affinity); both: each "
                        "setup unpinned then pinned")
    r.add_argument("--prompt", default=str(REFERENCE_PROMPT),
                   help="prompt tokens of the main benches (gpumesh bench's length syntax)")
    r.add_argument("--output", default=str(REFERENCE_OUTPUT),
                   help="output tokens of the main benches; the reference's fixed:256 makes a "
                        "closed loop's streams finish in lock-step waves, uniform:128:384 does not")
    r.add_argument("--raw-tool", default="")
    r.add_argument("--budget", type=float, default=560.0, help="seconds for all phases")
    r.set_defaults(func=cmd_run)
    rep = sub.add_parser("report")
    rep.add_argument("files", nargs="+")
    rep.add_argument("--md", default="")
    rep.add_argument("--png", default="")
    rep.set_defaults(func=cmd_report)
    a = p.parse_args(argv)
    return int(a.func(a))


if __name__ == "__main__":
    sys.exit(main())
