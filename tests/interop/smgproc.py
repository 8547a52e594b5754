"""A real SMG gateway process over loopback, and a small stdlib HTTP/SSE client for it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpumesh.launcher import ChildProcess, wait_until
from gpumesh.node.app import NodeServer
from gpumesh.node.config import NodeConfig
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig
from tests.integration.procs import free_port, log_path


class SmgProcess:
    """``smg launch`` in front of gRPC workers, bound to 127.0.0.1 only (its metrics port too).

    The exact command line is in :attr:`argv` (reports quote it).
    """

    def __init__(self, exe: Path, worker_addresses: Sequence[str], model_dir: Path,
                 policy: str = "cache_aware", extra: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.argv = [str(exe), "launch", "--host", "127.0.0.1", "--port", str(self.port),
                     "--worker-urls", *[f"grpc://{a}" for a in worker_addresses],
                     "--policy", policy, "--model-path", str(model_dir),
                     "--prometheus-host", "127.0.0.1",
                     "--prometheus-port", str(self.metrics_port), *extra]
        self.child = ChildProcess("smg", self.argv, log_path("smg"), term_group=True)
        self.log_path = self.child.log_path
        self.base = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.child.tail(4000)

    def get_json(self, path: str, timeout_s: float = 5) -> dict:
        with urllib.request.urlopen(self.base + path, timeout=timeout_s) as r:
            return json.load(r)

    def wait_ready(self, n_workers: int, timeout_s: float = 60) -> None:
        """Until every worker is registered, healthy and ready (blocking)."""

        def ready() -> bool:
            ws = self.get_json("/workers").get("workers", [])
            return len(ws) == n_workers and all(
                w.get("is_healthy") and w.get("status") == "ready" for w in ws)

        wait_until(ready, timeout_s, watch=[self.child], what="smg", poll_s=0.2,
                   not_up=(OSError, ValueError))

    def close(self) -> None:
        self.child.stop(10)


@dataclass(frozen=True)
class Completion:
    text: str
    pieces: tuple[str, ...]      # the text of each SSE event, in order
    finish_reason: str | None
    usage: dict | None


def complete(base: str, body: dict, timeout_s: float = 60) -> Completion:
    """POST /v1/completions (blocking); streams when ``body["stream"]``."""
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        resp = urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"HTTP {exc.code}: {exc.read().decode(errors='replace')}") from exc
    with resp:
        if not body.get("stream"):
            data = json.load(resp)
            c = data["choices"][0]
            return Completion(c["text"], (c["text"],), c.get("finish_reason"), data.get("usage"))
        pieces: list[str] = []
        finish = None
        usage = None
        done = False
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                done = True
                break
            event = json.loads(payload)
            usage = event.get("usage") or usage
            for c in event.get("choices", []):
                pieces.append(c.get("text", ""))
                finish = c.get("finish_reason") or finish
        assert done, "stream ended without [DONE]"
        return Completion("".join(pieces), tuple(pieces), finish, usage)


def sim_config(model_dir: Path) -> SimEngineConfig:
    """A sim engine that emits ids inside ``model_dir``'s vocabulary (SMG detokenizes them)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return SimEngineConfig(model_name=str(model_dir), vocab_size=int(cfg["vocab_size"]),
                           eos_token_id=int(cfg["eos_token_id"]), max_context_length=2048,
                           kv_capacity_tokens=1_000_000)


@contextlib.asynccontextmanager
async def smg_over_sim_nodes(exe: Path, model_dir: Path, id_prefix: str, nodes: int = 2,
                             policy: str = "cache_aware", extra: Sequence[str] = ()
                             ) -> AsyncIterator[tuple[SmgProcess, list[NodeServer]]]:
    """``nodes`` gpumesh sim nodes on loopback (ids ``{id_prefix}0``...) and a real SMG
    gateway over their VllmEngine service, ready; both stopped on exit."""
    servers: list[NodeServer] = []
    smg: SmgProcess | None = None
    try:
        for i in range(nodes):
            node = NodeServer(NodeConfig(serving={"port": 0, "node_id": f"{id_prefix}{i}"},
                                         engine={"kind": "sim", "model": str(model_dir),
                                                 "served_name": str(model_dir)}),
                              SimEngine(sim_config(model_dir)))
            await node.start()
            servers.append(node)
        smg = SmgProcess(exe, [f"127.0.0.1:{n.port}" for n in servers], model_dir,
                         policy=policy, extra=extra)
        await asyncio.to_thread(smg.wait_ready, nodes)
        yield smg, servers
    finally:
        if smg is not None:
            smg.close()
        for n in servers:
            await n.stop(0)
