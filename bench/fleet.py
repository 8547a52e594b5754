"""A local benchmark fleet: simulated nodes, routers and an nginx baseline, as child processes.

``Fleet`` starts, in this order:

1. routers (``gpumesh router --policy X``), each on its own port; several policies can run at
   once against the same fleet (every node heartbeats to every router, only the one under
   load sees traffic);
2. simulated nodes, ``nodes_per_proc`` of them per *fleet host* process (``python -m
   gpumesh_bench.fleet_host SPEC``: several :class:`node.app.NodeServer` in one event loop,
   each its own gRPC server, engine and heartbeat client; nothing in ``node/`` changes);
3. optionally nginx (``least_conn`` + ``grpc_pass`` over HTTP/2 keepalive connections, its
   config written into a temp dir);

then waits until every router lists every node HEALTHY and nginx answers. ``stop()`` (also on
``with`` exit, Ctrl-C, SIGTERM and interpreter exit) terminates every process group and kills
what is left after a grace period. Each child runs in its own session with
``PR_SET_PDEATHSIG = SIGKILL``, so even a SIGKILLed parent leaves no orphans.

Time scaling: ``time_scale`` slows every simulated engine (``SimEngineConfig.time_scale``); so
that the fleet is the same system, only slower, the node's coalescing flush interval and the
router's time constants (expected-wait reference throughput, per-request decode term, KV
penalty, wait scale) are scaled by the same factor (``scaled_router_flags``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpumesh.launcher import ChildProcess, free_port, stop_all, wait_until_async
from gpumesh.node.streaming.settings import StreamingSettings
from gpumesh_bench import REPO_ROOT

log = logging.getLogger(__name__)

NGINX = "/usr/sbin/nginx"
_LIVE: set[Fleet] = set()


# --- specs -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class SimNodeSpec:
    """One simulated node. ``weight`` is the capacity weight it declares (default = speed:
    the operator knows its GPU types); ``sim`` holds extra SimEngineConfig fields."""

    node_id: str
    speed: float = 1.0
    kv_capacity_tokens: int = 10_200_000
    weight: float | None = None
    sim: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RouterSpec:
    name: str                      # key for Fleet.address(name)
    policy: str = "predicted_latency"
    workers: int = 1
    cpus: str = ""                 # taskset -c CPUS ("" = unpinned)
    flags: tuple[str, ...] = ()    # extra `gpumesh router` flags
    env: dict[str, str] = field(default_factory=dict)


def scaled_router_flags(time_scale: float) -> list[str]:
    """Router time constants for a fleet slowed ``time_scale`` times (see module docstring)."""
    from gpumesh.router.config import RouterConfig

    if time_scale <= 0 or time_scale == 1:
        return []
    d = RouterConfig(serving={"router_id": "x"})
    # the routing prediction needs no scaling: simulated nodes report their step model in
    # wall-clock time; only the scaling signal's prefill-rate floor is a constant
    return ["--scaling.reference-prompt-tokens-per-s",
            f"{d.scaling.reference_prompt_tokens_per_s / time_scale:g}"]


def hetero_nodes(speeds: Sequence[float], kv_tokens: int, kv_grows: bool,
                 sim: dict[str, Any] | None = None, prefix: str = "n") -> list[SimNodeSpec]:
    return [SimNodeSpec(f"{prefix}{i:02d}-x{s:g}".replace(".", "p"), s,
                        int(kv_tokens * s) // 16 * 16 if kv_grows else kv_tokens,
                        sim=dict(sim or {})) for i, s in enumerate(speeds)]


# --- processes -------------------------------------------------------------------------------

def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", encoding="ascii", errors="replace") as f:
                parts = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(parts[2]) == pgid:  # fields after "comm": state ppid pgrp ...
            total += int(parts[11]) + int(parts[12])  # utime stime
    return total / tick


def group_pids(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", encoding="ascii", errors="replace") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[2]) == pgid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                continue
    return out


def bench_child(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None,
                cpus: str = "", term_signal: int = signal.SIGTERM) -> ChildProcess:
    """A benchmark's child (gpumesh.launcher): ``<log_dir>/<name>.log``, signalled as a whole
    process group, and killed with this process even when it dies by SIGKILL."""
    return ChildProcess(name, argv, log_dir / f"{name}.log", env=env, cpus=cpus,
                        die_with_parent=True, term_signal=term_signal, term_group=True)


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


# --- nginx ------------------------------------------------------------------------------------

NGINX_TEMPLATE = REPO_ROOT / "deploy" / "nginx" / "grpc-least-conn.conf.template"


def nginx_config(port: int, upstreams: Sequence[tuple[str, int]], prefix: Path,
                 template: Path = NGINX_TEMPLATE) -> str:
    """The nginx config: ``least_conn`` over ``upstreams`` (address, integer weight)."""
    servers = "\n".join(f"        server {a} weight={w} max_fails=0;" for a, w in upstreams)
    text = template.read_text(encoding="utf-8")
    return (text.replace("@PREFIX@", str(prefix)).replace("@PORT@", str(port))
            .replace("@SERVERS@", servers).replace("@KEEPALIVE@", str(max(16, 8 * len(upstreams)))))


# --- the fleet --------------------------------------------------------------------------------

class Fleet:
    """Routers + simulated nodes (+ nginx). Use as a context manager."""

    def __init__(self, nodes: Sequence[SimNodeSpec], *, routers: Sequence[RouterSpec] = (),
                 nginx: bool = False, time_scale: float = 1.0, model: str = "sim",
                 nodes_per_proc: int = 1, flush_interval_ms: int | None = None,
                 node_cpus: str = "", nginx_cpus: str = "", log_dir: str | Path | None = None,
                 scale_router: bool = True, log_level: str = "warning") -> None:
        self.nodes = list(nodes)
        self.router_specs = list(routers)
        self.use_nginx = nginx
        self.time_scale = time_scale
        self.model = model
        self.nodes_per_proc = max(1, nodes_per_proc)
        self.flush_interval_ms = (flush_interval_ms if flush_interval_ms is not None
                                  else max(1, round(20 * max(time_scale, 1.0))))
        self.node_cpus, self.nginx_cpus = node_cpus, nginx_cpus
        self.scale_router = scale_router
        self.log_level = log_level
        self._tmp = Path(tempfile.mkdtemp(prefix="gpumesh-fleet-"))
        self.log_dir = Path(log_dir) if log_dir else self._tmp / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.routers: dict[str, ChildProcess] = {}
        self.router_ports: dict[str, int] = {}
        self.hosts: list[ChildProcess] = []
        self.node_ports: dict[str, int] = {}
        self.nginx: ChildProcess | None = None
        self.nginx_port = 0
        self._stopped = False

    # addresses
    def address(self, name: str) -> str:
        if name == "nginx":
            return f"127.0.0.1:{self.nginx_port}"
        return f"127.0.0.1:{self.router_ports[name]}"

    def node_address(self, node_id: str) -> str:
        return f"127.0.0.1:{self.node_ports[node_id]}"

    def component(self, name: str) -> ChildProcess:
        return self.nginx if name == "nginx" and self.nginx else self.routers[name]  # type: ignore[return-value]

    def children(self) -> list[ChildProcess]:
        return [*self.routers.values(), *self.hosts, *([self.nginx] if self.nginx else [])]

    def pids(self) -> list[int]:
        return [p for c in self.children() for p in group_pids(c.pid)]

    # lifecycle
    def __enter__(self) -> Fleet:  # noqa: PYI034
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 120.0) -> Fleet:
        _LIVE.add(self)
        _install_handlers()
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout_s: float) -> None:
        env = {"GPUMESH_LOG_LEVEL": self.log_level, "PYTHONUNBUFFERED": "1"}
        scaled = scaled_router_flags(self.time_scale) if self.scale_router else []
        for r in self.router_specs:
            port = self.router_ports[r.name] = free_port()
            argv = _py("-m", "gpumesh.cli", "--log-level", self.log_level, "router",
                       "--host", "127.0.0.1", "--port", str(port), "--policy", r.policy,
                       "--router-id", f"bench-{r.name}".replace(".", "-").replace("_", "-"),
                       *(["--workers", str(r.workers)] if r.workers > 1 else []), *scaled, *r.flags)
            self.routers[r.name] = bench_child(f"router-{r.name}", argv, self.log_dir,
                                               {**env, **r.env}, r.cpus)
        for n in self.nodes:
            self.node_ports[n.node_id] = free_port()
        routers = [f"127.0.0.1:{p}" for p in self.router_ports.values()]
        for k in range(0, len(self.nodes), self.nodes_per_proc):
            group = self.nodes[k:k + self.nodes_per_proc]
            spec = {"routers": routers, "model": self.model, "time_scale": self.time_scale,
                    "flush_interval_ms": self.flush_interval_ms,
                    # the message budget slowed with the simulation, as the interval is
                    "stream_messages_per_s": (StreamingSettings().stream_messages_per_s
                                              / max(self.time_scale, 1.0)),
                    "log_level": self.log_level,
                    "nodes": [{**asdict(n), "port": self.node_ports[n.node_id]} for n in group]}
            path = self._tmp / f"host{k}.json"
            path.write_text(json.dumps(spec), encoding="utf-8")
            self.hosts.append(bench_child(f"host{k // self.nodes_per_proc}",
                                          _py("-m", "gpumesh_bench.fleet_host", str(path)),
                                          self.log_dir, env, self.node_cpus))
        if self.use_nginx:
            self._start_nginx()
        _run_sync(self._wait_ready(timeout_s))

    def _start_nginx(self) -> None:
        if not os.path.exists(NGINX):
            raise RuntimeError(f"nginx not found at {NGINX}")
        prefix = self._tmp / "nginx"
        (prefix / "logs").mkdir(parents=True, exist_ok=True)
        self.nginx_port = free_port()
        ups = [(self.node_address(n.node_id), max(1, round(2 * (n.weight or n.speed))))
               for n in self.nodes]
        conf = prefix / "nginx.conf"
        conf.write_text(nginx_config(self.nginx_port, ups, prefix), encoding="utf-8")
        # nginx stops gracefully on SIGQUIT (SIGTERM is its fast shutdown)
        self.nginx = bench_child("nginx", [NGINX, "-p", str(prefix), "-c", str(conf),
                                           "-g", "daemon off;"], self.log_dir, None,
                                 self.nginx_cpus, term_signal=signal.SIGQUIT)

    async def _wait_ready(self, timeout_s: float) -> None:
        from gpumesh.v1 import control_pb2 as cpb
        from gpumesh.v1 import control_pb2_grpc as cpb_grpc
        from gpumesh.v1 import inference_pb2 as pb
        from gpumesh.v1 import inference_pb2_grpc as pb_grpc

        deadline = time.monotonic() + timeout_s
        want = {n.node_id for n in self.nodes}
        kids = self.children()

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        for name in self.router_ports:
            async with grpc.aio.insecure_channel(self.address(name)) as ch:
                stub = cpb_grpc.RouterStub(ch)

                async def healthy() -> bool:
                    fleet = await stub.GetFleet(cpb.GetFleetRequest(), timeout=2)
                    return want <= {n.node_id for n in fleet.nodes
                                    if n.state == cpb.NodeState.Value("NODE_STATE_HEALTHY")}

                await wait_until_async(healthy, left(), watch=kids, poll_s=0.2,
                                       what=f"router {name}: fleet healthy")
        if not self.router_ports or self.use_nginx:  # no router to tell us: ask each node
            targets = [self.node_address(n) for n in want]
            targets += [self.address("nginx")] if self.use_nginx else []
            for t in targets:
                async with grpc.aio.insecure_channel(t) as ch:
                    stub = pb_grpc.InferenceStub(ch)

                    async def answers() -> bool:
                        await stub.ListModels(pb.ListModelsRequest(), timeout=2)
                        return True

                    await wait_until_async(answers, left(), watch=kids, poll_s=0.2,
                                           what=f"{t} answering")

    def stop(self, grace_s: float = 5.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        _LIVE.discard(self)
        # nginx and routers first (no new work), then the nodes.
        stop_all(self.children(), grace_s)
        shutil.rmtree(self._tmp / "nginx", ignore_errors=True)

    async def wait_idle(self, router: str, timeout_s: float = 60.0) -> bool:
        """Until the router sees no request in flight on any node (True) or timeout."""
        from gpumesh.v1 import control_pb2 as cpb
        from gpumesh.v1 import control_pb2_grpc as cpb_grpc

        deadline = time.monotonic() + timeout_s
        async with grpc.aio.insecure_channel(self.address(router)) as ch:
            stub = cpb_grpc.RouterStub(ch)
            while time.monotonic() < deadline:
                fleet = await stub.GetFleet(cpb.GetFleetRequest(), timeout=5)
                if all(n.load.in_flight == 0 and n.load.num_running == 0
                       and n.load.num_waiting == 0 for n in fleet.nodes):
                    return True
                await asyncio.sleep(0.25)
        return False


def _run_sync(coro: Any) -> Any:
    """asyncio.run, also from inside a running loop (then in a helper thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result()


_HANDLERS = False


def _stop_all() -> None:
    for f in list(_LIVE):
        f.stop(grace_s=2.0)


def _install_handlers() -> None:
    """Ctrl-C raises KeyboardInterrupt (then ``with`` exits stop the fleet); SIGTERM does the
    same; atexit catches the rest."""
    global _HANDLERS
    if _HANDLERS:
        return
    _HANDLERS = True
    atexit.register(_stop_all)
    if threading.current_thread() is threading.main_thread():
        prev = signal.getsignal(signal.SIGTERM)

        def on_term(signum: int, frame: Any) -> None:
            _stop_all()
            if callable(prev):
                prev(signum, frame)
            raise SystemExit(128 + signum)

        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, on_term)
