"""A mesh to break on purpose: routers and simulated nodes as real processes on loopback, the
faults a site sees (SIGKILL, SIGSTOP, slow nodes, a stalled control stream, router restarts),
and a closed-loop load that counts what became of every request.

Used by ``tests/chaos`` and ``gpumesh bench soak``. Children are started without a
pre-exec hook (no parent-death signal): forking a process that runs gRPC threads and then
running Python in the child before exec can crash the child; ``stop()`` ends them. Each node is its own ``gpumesh node
--engine sim`` process (killing one kills one node, by its own pid); each router a ``gpumesh
router`` process. ``ControlProxy`` is a TCP proxy a node's control stream can be routed
through and stalled (bytes held, connection kept open: a partition, not a close).

Outcome of a request (``Tally``): *succeeded* = finished with every one of its ``max_tokens``
tokens exactly once and usage agreeing; *migrated* / *retried* = succeeded after a
continuation on another node / a retry before the first token (the router's trailing
metadata); *failed* by gRPC code; *lost* = every request that did not succeed, except a
deliberate refusal (RESOURCE_EXHAUSTED: load shedding).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gpumesh import metadata as md
from gpumesh.client import CHANNEL_OPTIONS, SPREAD_OPTIONS, MeshClient, StreamResult
from gpumesh.launcher import ChildProcess, free_port, wait_until_async
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc

MODEL = "sim"
LOG_LEVEL = os.environ.get("GPUMESH_CHAOS_LOG_LEVEL", "warning")  # of the children
REFUSED = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (0 when it is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# --- processes ---------------------------------------------------------------------------------

@dataclass
class MeshSpec:
    nodes: int = 3
    routers: int = 1
    time_scale: float = 20.0        # sim engine slow-down: 20 -> ~50 ms per decode step
    node_speed: Sequence[float] = ()  # per node sim speed factor (default 1.0)
    max_concurrency: int = 0        # per node (0 = unlimited)
    prefill_ms_per_token: float = 0.0  # sim prefill cost per prompt token (0: the default shape)
    router_flags: Sequence[str] = ()
    log_dir: Path = Path(os.environ.get("GPUMESH_TEST_LOGS", "/tmp/gpumesh-test-logs"))
    proxied_control: bool = False   # node control streams through a stallable ControlProxy
    ticket_secret: str = ""         # set: lookaside clients can Pick (router and nodes share it)


class FaultMesh:
    """Start with ``await start()``, stop with ``stop()``. Node ``i`` is ``nodes[i]``, its
    address ``node_address(i)``; routers likewise."""

    def __init__(self, spec: MeshSpec) -> None:
        self.spec = spec
        self.router_ports = [free_port() for _ in range(spec.routers)]
        self.node_ports = [free_port() for _ in range(spec.nodes)]
        self.routers: list[ChildProcess | None] = [None] * spec.routers
        self.nodes: list[ChildProcess | None] = [None] * spec.nodes
        self.proxies: list[ControlProxy] = []
        self._tag = f"{os.getpid()}-{time.monotonic_ns()}"

    @property
    def router_addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.router_ports]

    def node_address(self, i: int) -> str:
        return f"127.0.0.1:{self.node_ports[i]}"

    def node_id(self, i: int) -> str:
        return f"n{i}"

    def _env(self) -> dict[str, str]:
        env = {"GPUMESH_LOG_LEVEL": LOG_LEVEL}
        if self.spec.ticket_secret:
            env["GPUMESH_TICKET_SECRET"] = self.spec.ticket_secret
        return env

    def start_router(self, i: int) -> ChildProcess:
        args = ["router", "--port", str(self.router_ports[i]), "--router-id", f"r{i}",
                *self.spec.router_flags]
        p = ChildProcess.gpumesh(f"router{i}", args,
                                 self.spec.log_dir / f"chaos-r{i}-{self._tag}.log", append=True,
                                 env=self._env())
        self.routers[i] = p
        return p

    def _node_config(self, i: int) -> Path:
        speed = self.spec.node_speed[i] if i < len(self.spec.node_speed) else 1.0
        path = self.spec.log_dir / f"chaos-n{i}-{self._tag}.toml"
        path.write_text(f'[serving]\nmax_concurrency = {self.spec.max_concurrency}\n'
                        f'[engine.sim]\nmodel_name = "{MODEL}"\ntime_scale = {self.spec.time_scale}\n'
                        f'speed = {speed}\n'
                        + (f'step_b_prefill_ms = {self.spec.prefill_ms_per_token}\n'
                           if self.spec.prefill_ms_per_token else ''))
        return path

    def start_node(self, i: int) -> ChildProcess:
        routers = ([p.address for p in self.proxies] if self.spec.proxied_control
                   else self.router_addresses)
        args = ["node", "--engine", "sim", "--port", str(self.node_ports[i]),
                "--node-id", self.node_id(i), "--config", str(self._node_config(i))]
        for r in routers:
            args += ["--router", r]
        p = ChildProcess.gpumesh(f"node{i}", args,
                                 self.spec.log_dir / f"chaos-n{i}-{self._tag}.log", append=True,
                                 env=self._env())
        self.nodes[i] = p
        return p

    async def start(self, timeout_s: float = 90.0) -> None:
        if self.spec.proxied_control:
            for addr in self.router_addresses:
                proxy = ControlProxy(addr)
                await proxy.start()
                self.proxies.append(proxy)
        for i in range(self.spec.routers):
            self.start_router(i)
        for i in range(self.spec.nodes):
            self.start_node(i)
        await self.wait_fleet(self.spec.nodes, timeout_s)

    async def fleet(self, router: int = 0) -> list[cpb.NodeView]:
        async with grpc.aio.insecure_channel(self.router_addresses[router]) as ch:
            resp = await cpb_grpc.RouterStub(ch).GetFleet(cpb.GetFleetRequest(), timeout=5)
            return list(resp.nodes)

    async def wait_fleet(self, n: int, timeout_s: float = 60.0, router: int | None = None,
                         watch: bool = True) -> None:
        """Until every router (or ``router``) lists ``n`` nodes with a fresh report.
        ``watch``: fail at once when one of the mesh's processes exits meanwhile (off while
        other faults run concurrently)."""
        which = range(self.spec.routers) if router is None else [router]

        async def ready() -> bool:
            for r in which:
                try:
                    nodes = await self.fleet(r)
                except grpc.aio.AioRpcError:
                    return False
                if sum(1 for v in nodes if v.state == cpb.NODE_STATE_HEALTHY) < n:
                    return False
            return True

        procs = [p for p in (*self.routers, *self.nodes)
                 if watch and p is not None and p.alive()]
        await wait_until_async(ready, timeout_s, watch=procs,
                               what=f"{n} healthy nodes in every router")

    # faults: the process's own pid, never its group (what the OOM killer does)
    def signal_node(self, i: int, sig: int) -> None:
        p = self.nodes[i]
        assert p is not None
        os.kill(p.pid, sig)
        if sig == signal.SIGKILL:
            p.popen.wait(10)

    def signal_router(self, i: int, sig: int) -> None:
        p = self.routers[i]
        assert p is not None
        os.kill(p.pid, sig)

    def stop(self) -> None:
        for p in (*self.nodes, *self.routers):
            if p is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                p.stop(5)
        for proxy in self.proxies:
            proxy.close()

    def pids(self) -> dict[str, int]:
        out = {f"router{i}": p.pid for i, p in enumerate(self.routers) if p and p.alive()}
        out.update({f"node{i}": p.pid for i, p in enumerate(self.nodes) if p and p.alive()})
        return out


class ControlProxy:
    """A TCP proxy to ``target``; ``stall()`` holds every byte in both directions (the
    connections stay open: a partition as a hung middlebox shows it), ``resume()`` lets
    them through again."""

    def __init__(self, target: str) -> None:
        self.target_host, _, port = target.rpartition(":")
        self.target_port = int(port)
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.server: asyncio.Server | None = None
        self.address = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{port}"

    def stall(self) -> None:
        self.flowing.clear()

    def resume(self) -> None:
        self.flowing.set()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                await self.flowing.wait()
                w.write(data)
                await w.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            w.close()
            return
        await asyncio.gather(self._pipe(r, uw), self._pipe(ur, w))

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


# --- load and outcomes -------------------------------------------------------------------------

@dataclass
class Tally:
    sent: int = 0               # requests started
    succeeded: int = 0          # every token exactly once, usage agreeing
    migrated: int = 0           # succeeded after a continuation on another node
    retried: int = 0            # succeeded after a retry before the first token
    incomplete: int = 0         # ended OK but with missing/duplicate tokens or wrong usage
    failed: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)  # a few details per code
    stalls_s: list[float] = field(default_factory=list)   # per request: longest chunk gap
    ttfts_s: list[float] = field(default_factory=list)
    first_success_at: float | None = None
    first_output_at: float | None = None   # first chunk of a request that then succeeded

    @property
    def lost(self) -> int:
        refused = sum(n for code, n in self.failed.items() if code in {c.name for c in REFUSED})
        return self.sent - self.succeeded - refused

    def p99_stall_s(self) -> float:
        return _pct(self.stalls_s, 99)

    def line(self, label: str) -> str:
        failed = ", ".join(f"{k}={v}" for k, v in sorted(self.failed.items())) or "none"
        return (f"{label}: sent={self.sent} succeeded={self.succeeded} migrated={self.migrated} "
                f"retried={self.retried} failed=[{failed}] incomplete={self.incomplete} "
                f"lost={self.lost} stall_p99={self.p99_stall_s():.3f}s "
                f"ttft_p50={_pct(self.ttfts_s, 50):.3f}s")


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def client_channel(addresses: Sequence[str]) -> grpc.aio.Channel:
    """A client channel as the client library opens it (retry of UNAVAILABLE in the service
    config); several router addresses: round-robin over them."""
    if len(addresses) == 1:
        return grpc.aio.insecure_channel(addresses[0], options=CHANNEL_OPTIONS)
    return grpc.aio.insecure_channel("ipv4:" + ",".join(a for a in addresses),
                                     options=[*CHANNEL_OPTIONS, *SPREAD_OPTIONS])


@dataclass
class InFlight:
    """Requests on the wire now, and whether each has seen output (for 'mid-stream' vs
    'before the first token' at the moment of a fault)."""

    started: dict[int, bool] = field(default_factory=dict)

    def snapshot(self) -> tuple[int, int]:
        """(with output, without output)."""
        with_output = sum(1 for v in self.started.values() if v)
        return with_output, len(self.started) - with_output


async def one_request(stub: pb_grpc.InferenceStub, tally: Tally, max_tokens: int,
                      timeout_s: float, prompt: str, inflight: InFlight, key: int) -> None:
    # the request's own number first: no two prompts share a cached prefix
    req = pb.GenerateRequest(model=MODEL, text=f"{key} {prompt}")
    req.sampling.max_tokens = max_tokens
    req.sampling.ignore_eos = True
    tally.sent += 1
    inflight.started[key] = False
    t0 = last = time.monotonic()
    ids: list[int] = []
    finish = 0
    usage = None
    gap = 0.0
    ttft = None
    call = stub.GenerateStream(req, timeout=timeout_s)
    try:
        async for chunk in call:
            now = time.monotonic()
            if ttft is None:
                ttft = now - t0
                inflight.started[key] = True
            else:
                gap = max(gap, now - last)
            last = now
            ids.extend(chunk.token_ids)
            if chunk.finish_reason:
                finish, usage = chunk.finish_reason, chunk.usage
        trailing = dict(await call.trailing_metadata() or ())
    except grpc.aio.AioRpcError as e:
        tally.failed[e.code().name] += 1
        seen = tally.examples.setdefault(e.code().name, [])
        if len(seen) < 5:
            seen.append(f"{time.monotonic() - t0:.2f}s: {e.details()}")
        return
    finally:
        inflight.started.pop(key, None)
    if (len(ids) != max_tokens or finish != pb.FINISH_REASON_LENGTH or usage is None
            or usage.completion_tokens != max_tokens):
        tally.incomplete += 1
        return
    tally.succeeded += 1
    if tally.first_success_at is None:
        tally.first_success_at = time.monotonic()
    first_at = t0 + (ttft or 0.0)
    if tally.first_output_at is None or first_at < tally.first_output_at:
        tally.first_output_at = first_at
    migrations = int(trailing.get(md.MIGRATIONS, "0") or 0)
    attempts = int(trailing.get(md.ATTEMPTS, "1") or 1)
    tally.migrated += migrations > 0
    tally.retried += attempts - 1 - migrations > 0
    tally.stalls_s.append(gap)
    if ttft is not None:
        tally.ttfts_s.append(ttft)


async def one_lookaside_request(client: MeshClient, tally: Tally, max_tokens: int,
                                timeout_s: float, prompt: str, inflight: InFlight,
                                key: int) -> None:
    """``one_request`` through ``MeshClient`` in lookaside mode (Pick, then the node)."""
    req = pb.GenerateRequest(model=MODEL, text=f"{key} {prompt}")
    req.sampling.max_tokens = max_tokens
    req.sampling.ignore_eos = True
    tally.sent += 1
    result = StreamResult()
    ids: list[int] = []
    usage = None
    try:
        async for chunk in client.stream(req, timeout=timeout_s, result=result):
            ids.extend(chunk.token_ids)
            if chunk.finish_reason:
                usage = chunk.usage
    except grpc.aio.AioRpcError as e:
        tally.failed[e.code().name] += 1
        tally.examples.setdefault(e.code().name, []).append(e.details() or "")
        return
    if len(ids) != max_tokens or usage is None or usage.completion_tokens != max_tokens:
        tally.incomplete += 1
        return
    tally.succeeded += 1
    tally.migrated += result.migrations > 0
    tally.retried += result.attempts - 1 - result.migrations > 0


async def lookaside_loop(address: str, tally: Tally, stop: asyncio.Event, *, concurrency: int,
                         max_tokens: int = 40, timeout_s: float = 30.0,
                         prompt: str = "tell me a story about a mesh",
                         stagger_s: float = 1.5) -> None:
    """``closed_loop`` with lookaside clients (``MeshClient(lookaside=True)``)."""
    counter = iter(range(1 << 62))
    inflight = InFlight()
    async with MeshClient(address, lookaside=True) as client:
        async def one(k: int) -> None:
            await asyncio.sleep(stagger_s * k / concurrency)
            while not stop.is_set():
                await one_lookaside_request(client, tally, max_tokens, timeout_s, prompt,
                                            inflight, next(counter))

        await asyncio.gather(*(one(k) for k in range(concurrency)))


async def closed_loop(addresses: Sequence[str], tally: Tally, stop: asyncio.Event, *,
                      concurrency: int, max_tokens: int = 40, timeout_s: float = 30.0,
                      prompt: str = "tell me a story about a mesh", think_s: float = 0.0,
                      inflight: InFlight | None = None, stagger_s: float = 1.5) -> None:
    """``concurrency`` clients, each sending one stream after the other until ``stop``; the
    k-th starts after ``stagger_s`` x k / concurrency."""
    inflight = inflight if inflight is not None else InFlight()
    counter = iter(range(1 << 62))
    async with client_channel(addresses) as ch:
        stub = pb_grpc.InferenceStub(ch)

        async def client(k: int) -> None:
            await asyncio.sleep(stagger_s * k / concurrency)   # clients out of step
            while not stop.is_set():
                await one_request(stub, tally, max_tokens, timeout_s, prompt, inflight,
                                  next(counter))
                if think_s:
                    await asyncio.sleep(think_s)

        await asyncio.gather(*(client(k) for k in range(concurrency)))
