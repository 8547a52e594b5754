"""Helpers for multi-process tests: start real `gpumesh` processes, a recording control plane.

Nothing here fakes the system under test: nodes and routers are real processes speaking real
gRPC over loopback. The recording control plane is a test double of the ROUTER's control
service only, used to observe what a real node sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import grpc

from gpumesh.ports import free_port  # noqa: F401 (tests import it from here)
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc

LOG_DIR = Path(os.environ.get("GPUMESH_TEST_LOGS", "/tmp/gpumesh-test-logs"))


class Proc:
    """A `python -m gpumesh.cli ...` child in its own process group, logging to a file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.log_path = LOG_DIR / f"{name}-{os.getpid()}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "gpumesh.cli", *args], stdout=self._log,
            stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)

    def terminate(self, timeout_s: float = 30.0) -> int:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.popen.returncode

    def close(self) -> None:
        self.terminate()
        self._log.close()


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
    """Until ListModels answers (the node is up and its engine started)."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        while True:
            if proc is not None and not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.log()}")
            with contextlib.suppress(grpc.aio.AioRpcError):
                from grpc_health.v1 import health_pb2, health_pb2_grpc
                h = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=2)
                if h.status == health_pb2.HealthCheckResponse.SERVING:
                    await stub.ListModels(pb.ListModelsRequest(), timeout=2)
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not serving after {timeout_s}s:\n"
                                   + (proc.log() if proc else ""))
            await asyncio.sleep(0.3)


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
