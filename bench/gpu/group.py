"""One phase's processes: routers and vLLM (or simulated) nodes, started in order and
stopped together, and the GPU bookkeeping around them (nvidia-smi, freeing GPU memory)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import grpc

from gpumesh.launcher import ChildProcess, free_port, wait_serving, wait_until
from gpumesh_bench.gpu.env import Env, GpuNodeSpec, GpuRouterSpec, node_toml

if TYPE_CHECKING:
    from gpumesh_bench.gpu.affinity import Placement


class Group:
    """Routers and nodes of one phase; ``with`` stops them all and waits for the GPUs."""

    def __init__(self, env: Env, nodes: Sequence[GpuNodeSpec], routers: Sequence[GpuRouterSpec]) -> None:
        self.env = env
        self.node_specs = list(nodes)
        self.router_specs = list(routers)
        self.children: list[ChildProcess] = []
        self.addr: dict[str, str] = {}
        self.commands: list[str] = []
        self.kv_tokens: dict[str, int] = {}

    def placement(self) -> Placement:
        """Each node's process tree on physical cores of its own (near its GPUs), routers
        and the load generator on the rest (gpumesh_bench.gpu.affinity)."""
        from gpumesh_bench.gpu.affinity import Placement

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
        routers: dict[str, ChildProcess] = {}
        for r in self.router_specs:
            port = free_port()
            self.addr[r.name] = f"127.0.0.1:{port}"
            args = ["router", "--host", "127.0.0.1", "--port", str(port), "--policy", r.policy,
                    "--workers", str(r.workers or env.workers), "--router-id", r.name.replace(".", "-")]
            renv = {"GPUMESH_LOG_LEVEL": "warning"}
            if env.engine == "sim" and env.sim_scale_intervals and env.sim_time_scale > 0:
                t = env.sim_time_scale   # RouterConfig defaults 1.5 s / 3 s, scaled
                renv.update(GPUMESH_ROUTER_MEMBERSHIP__FRESHNESS_S=str(1.5 * t),
                            GPUMESH_ROUTER_MEMBERSHIP__LEASE_TTL_S=str(3.0 * t))
            renv.update(env.router_env)
            renv.update(r.env)
            c = _child(r.name, args, env, renv)
            self.children.append(c)
            self.commands.append(c.command())
            routers[r.name] = c
        started: dict[str, ChildProcess] = {}

        def launch(spec: GpuNodeSpec) -> None:
            port = free_port()
            self.addr[spec.name] = f"127.0.0.1:{port}"
            cfg = env.logs / f"{spec.name}.toml"
            cfg.write_text(node_toml(env, spec))
            args = ["node", "--config", str(cfg), "--port", str(port), "--node-id", spec.name]
            for r in spec.routers:
                args += ["--router", self.addr[r]]
            child_env = {"CUDA_VISIBLE_DEVICES": spec.gpus} if env.engine == "vllm" else {}
            c = _child(spec.name, args, env, child_env)
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
                    wait_serving(self.addr[s.after], _left(deadline), watch=[started[s.after]])
                launch(s)
                pending.remove(s)
        for s in self.node_specs:
            wait_serving(self.addr[s.name], _left(deadline), watch=[started[s.name]])
            self.kv_tokens[s.name] = kv_capacity(started[s.name].log_path)
        for r in self.router_specs:
            wait_fleet(self.addr[r.name], set(r.members), deadline, routers[r.name])


def _child(name: str, args: list[str], env: Env, child_env: dict[str, str]) -> ChildProcess:
    """A ``gpumesh ARGS`` child logging to ``<out>/logs/<name>.log`` (appended: successive
    calls on one out dir keep every start's output)."""
    return ChildProcess.gpumesh(name, args, env.logs / f"{name}.log", env=child_env,
                                append=True)


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def fleet_once(router: str, timeout: float = 3.0) -> Any:
    from gpumesh.v1 import control_pb2 as cpb
    from gpumesh.v1 import control_pb2_grpc as cpb_grpc

    with grpc.insecure_channel(router) as ch:
        return cpb_grpc.RouterStub(ch).GetFleet(cpb.GetFleetRequest(), timeout=timeout)


def wait_fleet(router: str, members: set[str], deadline: float,
               child: ChildProcess | None = None) -> None:
    """Until ``router`` reports every member healthy; fails at once if its process exits."""
    from gpumesh.v1 import control_pb2 as cpb

    last = "no answer yet"

    def healthy() -> bool:
        nonlocal last
        try:
            f = fleet_once(router)
        except grpc.RpcError as e:
            last = f"GetFleet: {e.code().name} {e.details()}"
            return False
        if members <= {n.node_id for n in f.nodes if n.state == cpb.NODE_STATE_HEALTHY}:
            return True
        last = "fleet: " + ", ".join(f"{n.node_id} {cpb.NodeState.Name(n.state)}"
                                     for n in f.nodes)
        return False

    wait_until(healthy, _left(deadline), watch=[child] if child is not None else (),
               what=lambda: f"router {router}: {sorted(members)} healthy ({last})")
    time.sleep(1.5)  # every router worker has the whole fleet by now


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
