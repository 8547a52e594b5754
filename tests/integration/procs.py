"""Helpers for multi-process tests: start real `gpumesh` processes, a recording control plane.

Nothing here fakes the system under test: nodes and routers are real processes speaking real
gRPC over loopback. The recording control plane is a test double of the ROUTER's control
service only, used to observe what a real node sends.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import defaultdict
from pathlib import Path

import grpc

from gpumesh.launcher import ChildProcess, gpumesh_argv, wait_serving_async
from gpumesh.ports import free_port  # noqa: F401 (tests import it from here)
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc

LOG_DIR = Path(os.environ.get("GPUMESH_TEST_LOGS", "/tmp/gpumesh-test-logs"))


def log_path(name: str) -> Path:
    """A log file of its own for a child named ``name``, in ``LOG_DIR``."""
    return LOG_DIR / f"{name}-{os.getpid()}-{time.monotonic_ns()}.log"


class Proc(ChildProcess):
    """A ``gpumesh ARGS`` child (gpumesh.launcher) logging into ``LOG_DIR``."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        super().__init__(name, gpumesh_argv(*args), log_path(name), env=env)

    def log(self) -> str:
        return self.tail(4000)

    def close(self, timeout_s: float = 30.0) -> int | None:
        return self.stop(timeout_s)


def node_proc(name: str, port: int, routers: list[str], engine: str = "vllm",
              model: str = "", core: int = 0, extra: list[str] | None = None,
              config: Path | None = None) -> Proc:
    args = ["node", "--engine", engine, "--port", str(port), "--node-id", name]
    if model:
        args += ["--model", model]
    for r in routers:
        args += ["--router", r]
    if config is not None:
        args += ["--config", str(config)]
    args += extra or []
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": "1",
           "GPUMESH_LOG_LEVEL": "info"}
    return Proc(name, args, env)


async def wait_serving(address: str, proc: Proc | None = None, timeout_s: float = 180) -> None:
    """Until the health check says SERVING and ListModels answers (the node is up and its
    engine started)."""

    async def list_models(ch: grpc.aio.Channel) -> None:
        await pb_grpc.InferenceStub(ch).ListModels(pb.ListModelsRequest(), timeout=2)

    await wait_serving_async(address, timeout_s, watch=[proc] if proc else (),
                             then=list_models)


class RecordingControlPlane(cpb_grpc.ControlPlaneServicer):
    """Records every NodeMessage per node; can order a drain."""

    def __init__(self, router_id: str = "test-cp") -> None:
        self.router_id = router_id
        self.messages: dict[str, list[cpb.NodeMessage]] = defaultdict(list)
        self.received: list[tuple[float, cpb.NodeMessage]] = []
        self._outboxes: dict[str, asyncio.Queue[cpb.RouterMessage]] = {}
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self, port: int = 0) -> str:
        self.server = grpc.aio.server()
        cpb_grpc.add_ControlPlaneServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)

    def heartbeats(self, node_id: str) -> list[cpb.Heartbeat]:
        return [m.heartbeat for m in self.messages[node_id] if m.WhichOneof("kind") == "heartbeat"]

    def drain(self, node_id: str, reason: str = "test") -> None:
        self._outboxes[node_id].put_nowait(cpb.RouterMessage(drain=cpb.DrainOrder(reason=reason)))

    async def Connect(self, request_iterator, context):
        outbox: asyncio.Queue[cpb.RouterMessage] = asyncio.Queue()
        node_id = ""

        async def reader() -> None:
            nonlocal node_id
            async for msg in request_iterator:
                if msg.WhichOneof("kind") == "registration":
                    node_id = msg.registration.node_id
                    self._outboxes[node_id] = outbox
                    outbox.put_nowait(cpb.RouterMessage(hello=cpb.RouterHello(
                        router_id=self.router_id)))
                self.messages[node_id].append(msg)
                self.received.append((time.monotonic(), msg))
            outbox.put_nowait(None)  # type: ignore[arg-type]

        task = asyncio.create_task(reader())
        try:
            while True:
                out = await outbox.get()
                if out is None:
                    return
                yield out
        finally:
            task.cancel()
