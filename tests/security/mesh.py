"""Real router and simulated-node processes for the security tests, and a hand-written
control-plane client playing the part of a hostile node (it speaks the real protocol; it is
the attacker, not a stand-in for the system under test)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gpumesh.client import MeshClient, build_request
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc
from tests.integration.procs import Proc, free_port, node_proc

NODE_TOML = ('[membership]\nheartbeat_busy_interval_s = 0.1\nheartbeat_idle_interval_s = 0.3\n'
             'reconnect_max_backoff_s = 0.5\n[engine.sim]\ntime_scale = 1.0\n')


async def wait_for(predicate: Callable[[], Awaitable[object]], timeout_s: float = 60.0,
                   what: str = "condition") -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


@dataclass
class Mesh:
    router: Proc
    router_address: str
    nodes: dict[str, tuple[Proc, str]] = field(default_factory=dict)
    node_router: str = ""   # the address nodes register at (the control port, if any)

    def alive(self) -> bool:
        return self.router.alive() and all(p.alive() for p, _ in self.nodes.values())


def router_proc(port: int, extra: Sequence[str] = (), env: dict[str, str] | None = None) -> Proc:
    args = ["router", "--host", "127.0.0.1", "--port", str(port), "--membership.lease-ttl-s", "3",
            "--membership.freshness-s", "1.5", "--serving.shutdown-grace-s", "0.5", *extra]
    return Proc("router", args, {"GPUMESH_LOG_LEVEL": "info", **(env or {})})


async def healthy(client: MeshClient) -> set[str]:
    fleet = await client.fleet(timeout=30)
    return {n.node_id for n in fleet.nodes if n.state == cpb.NODE_STATE_HEALTHY}


@asynccontextmanager
async def mesh(tmp: Path, node_names: Sequence[str] = ("good",), router_args: Sequence[str] = (),
               node_args: Sequence[str] = (), router_env: dict[str, str] | None = None,
               client_kwargs: dict | None = None, node_toml: str = "",
               wait_nodes: bool = True,
               node_args_for: Callable[[str], Sequence[str]] | None = None,
               router_host: str = "127.0.0.1", control_port: int = 0) -> AsyncIterator[Mesh]:
    """A router process and sim node processes registered with it (healthy in its fleet).
    ``control_port``: the router also serves one, and the nodes register there."""
    port = free_port()
    extra_router = ["--serving.control-port", str(control_port)] if control_port else []
    r = router_proc(port, [*router_args, *extra_router], router_env)
    m = Mesh(r, f"{router_host}:{port}")
    m.node_router = f"127.0.0.1:{control_port}" if control_port else m.router_address
    cfg = tmp / "node.toml"
    cfg.write_text(node_toml + NODE_TOML)   # node_toml: its own tables ([security])
    try:
        for name in node_names:
            nport = free_port()
            m.nodes[name] = (node_proc(name, nport, [m.node_router], engine="sim",
                                       model="sim", config=cfg,
                                       extra=[*node_args, *(node_args_for(name)
                                                            if node_args_for else ())]),
                             f"127.0.0.1:{nport}")
        if wait_nodes:
            for proc, addr in m.nodes.values():
                await wait_running(proc, m.router)
            async with MeshClient(m.router_address, **(client_kwargs or {})) as c:
                await wait_for(lambda: _has(c, set(node_names)),
                               what=f"nodes {node_names} healthy")
        yield m
    finally:
        for proc, _ in m.nodes.values():
            proc.close()
        r.close()


def restart(proc: Proc) -> Proc:
    """The same command started again (after ``proc.close()``), logging to a new file."""
    from gpumesh.launcher import ChildProcess
    from tests.integration.procs import log_path

    again = Proc.__new__(Proc)
    ChildProcess.__init__(again, proc.name, proc.argv, log_path(proc.name), env=proc.env)
    return again


async def wait_running(proc: Proc, router: Proc, timeout_s: float = 90.0) -> None:
    """Until the node's log says it listens (works whatever the node's TLS settings)."""
    await wait_for(lambda: _logged(proc, router, "listening on"), timeout_s, f"{proc.name} up")


async def _logged(proc: Proc, router: Proc, text: str) -> bool:
    for p in (proc, router):
        if not p.alive():
            raise AssertionError(f"{p.name} exited:\n{p.log()}")
    return text in proc.tail(20000)


async def _has(c: MeshClient, ids: set[str]) -> bool:
    try:
        return ids <= await healthy(c)
    except grpc.aio.AioRpcError:
        return False   # the router not up yet


def registration(node_id: str, address: str, models: Sequence[cpb.ServedModel] | None = None,
                 **kw: object) -> cpb.NodeMessage:
    return cpb.NodeMessage(registration=cpb.Registration(
        node_id=node_id, address=address, incarnation="hostile", engine="sim",
        models=list(models) if models is not None else [cpb.ServedModel(name="sim")], **kw))


def heartbeat(seq: int, **load: object) -> cpb.NodeMessage:
    return cpb.NodeMessage(heartbeat=cpb.Heartbeat(seq=seq, sent_unix_ms=int(time.time() * 1000),
                                                   load=cpb.LoadReport(**load)))


class HostileNode:
    """A Connect stream driven message by message: ``send`` then read what comes back."""

    def __init__(self, channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]] = ()):
        self._q: asyncio.Queue[cpb.NodeMessage | None] = asyncio.Queue()
        self.call = cpb_grpc.ControlPlaneStub(channel).Connect(self._gen(), metadata=metadata)

    async def _gen(self) -> AsyncIterator[cpb.NodeMessage]:
        while True:
            msg = await self._q.get()
            if msg is None:
                return
            yield msg

    async def send(self, msg: cpb.NodeMessage) -> None:
        await self._q.put(msg)

    async def read(self, timeout_s: float = 30.0) -> cpb.RouterMessage | None:
        """The next router message; None when the stream ended (see ``code()``)."""
        try:
            msg = await asyncio.wait_for(self.call.read(), timeout_s)
        except grpc.aio.AioRpcError:
            return None
        return None if msg is grpc.aio.EOF else msg

    async def code(self, timeout_s: float = 30.0) -> grpc.StatusCode:
        return await asyncio.wait_for(self.call.code(), timeout_s)

    def close(self) -> None:
        self._q.put_nowait(None)
        self.call.cancel()


async def served_by(client: MeshClient, n: int, model: str = "sim") -> dict[str, int]:
    """Sends ``n`` requests concurrently; how many each node served."""
    from gpumesh.client import StreamResult

    async def one(i: int) -> str:
        r = StreamResult()
        async for _ in client.stream(build_request(f"req {i}", model=model, max_tokens=4),
                                     timeout=60, result=r):
            pass
        return r.node_id

    counts: dict[str, int] = {}
    for node in await asyncio.gather(*(one(i) for i in range(n))):
        counts[node] = counts.get(node, 0) + 1
    return counts
