"""A live fleet of REAL vLLM engines behind real gpumesh routers (the simulator's fidelity
check, ``gpumesh sim validate``).

``LiveFleet`` starts, as child processes of this one:

1. one ``gpumesh router --policy P`` per policy under test, each on its own loopback port;
   every router sees every node (each node heartbeats and streams its KV events to all of
   them), only the one under load gets requests;
2. ``engines`` ``gpumesh node --engine vllm`` processes on the same model folder, each with
   the same engine arguments (``[engine.engine_args]`` of a generated node TOML). On vLLM CPU,
   engine i is pinned to core ``cores[i]``: ``VLLM_CPU_OMP_THREADS_BIND=<core>`` and
   ``taskset -c <core>`` for the whole node process (its front end too). On CUDA ``cores``
   is empty and the engines share the visible GPU(s): give each its memory share with the
   ``gpu_memory_utilization`` engine argument;

then waits until every router lists every node HEALTHY. ``stop()`` (also on ``with`` exit)
terminates every process group; each child dies with this process even on SIGKILL.

``run_trace`` replays prebuilt ``GenerateRequest`` messages (token-id prompts) at their
trace arrival times through one router and measures each stream (``loadgen.send_message``:
TTFT to the first token, end-to-end to the stream's end, the node from the trailing
metadata), while it samples every node's ``LoadReport`` through the router each second (the
engines' own prefix-cache hit rate, a window over their last requests).
"""

from __future__ import annotations

import asyncio
import re
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpumesh.launcher import ChildProcess, free_port, stop_all, wait_until_async
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc
from gpumesh_bench.fleet import bench_child
from gpumesh_bench.loadgen import BenchRequest, LoadConfig, RequestResult, drive, send_message

HEALTHY = cpb.NodeState.Value("NODE_STATE_HEALTHY")
_READY = re.compile(r"max_num_seqs=(\d+) max_num_batched_tokens=(\d+)")


@dataclass(frozen=True)
class LiveSpec:
    """What the live fleet runs. ``engine_args``: extra ``vllm.AsyncEngineArgs`` fields for
    every engine; ``engine_env``: environment of every node (e.g. ``VLLM_CPU_KVCACHE_SPACE``);
    ``cores``: one CPU core per engine on vLLM CPU (pinning), empty on CUDA; ``router_cpus``:
    ``taskset`` list for the routers ("" = unpinned)."""

    model: str
    policies: tuple[str, ...]
    engines: int = 2
    cores: tuple[str, ...] = ("0", "1")
    served_name: str = "tiny"
    max_model_len: int = 2048
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    engine_env: Mapping[str, str] = field(default_factory=dict)
    router_cpus: str = ""
    router_flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.engines < 1 or not self.policies:
            raise ValueError("a live fleet needs >= 1 engine and >= 1 policy")
        if self.cores and len(self.cores) != self.engines:
            raise ValueError(f"{self.engines} engines need {self.engines} cores, "
                             f"got {list(self.cores)}")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


class LiveFleet:
    """Routers (one per policy) + real vLLM nodes. Use as a context manager."""

    def __init__(self, spec: LiveSpec, log_dir: str | Path | None = None) -> None:
        self.spec = spec
        self._tmp = Path(tempfile.mkdtemp(prefix="gpumesh-live-"))
        self.log_dir = Path(log_dir) if log_dir else self._tmp / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.router_ports: dict[str, int] = {}
        self.node_ports: dict[str, int] = {}
        self.children: list[ChildProcess] = []
        self.node_ids = tuple(f"e{i}" for i in range(spec.engines))

    def __enter__(self) -> LiveFleet:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def address(self, policy: str) -> str:
        return f"127.0.0.1:{self.router_ports[policy]}"

    def node_address(self, node_id: str) -> str:
        return f"127.0.0.1:{self.node_ports[node_id]}"

    async def start(self, timeout_s: float = 300.0) -> None:
        s = self.spec
        env = {"GPUMESH_LOG_LEVEL": "warning", "PYTHONUNBUFFERED": "1"}
        for p in s.policies:
            port = self.router_ports[p] = free_port()
            argv = [sys.executable, "-m", "gpumesh.cli", "router", "--host", "127.0.0.1",
                    "--port", str(port), "--policy", p,
                    "--router-id", f"live-{p}".replace("_", "-"), *s.router_flags]
            self.children.append(bench_child(f"router-{p}", argv, self.log_dir, env,
                                              s.router_cpus))
        routers = [f"127.0.0.1:{p}" for p in self.router_ports.values()]
        for i, node_id in enumerate(self.node_ids):
            port = self.node_ports[node_id] = free_port()
            conf = self._tmp / f"{node_id}.toml"
            lines = ["[engine.engine_args]"]
            lines += [f"{k} = {_toml_value(v)}" for k, v in s.engine_args.items()]
            conf.write_text("\n".join(lines) + "\n", encoding="utf-8")
            argv = [sys.executable, "-m", "gpumesh.cli", "--log-level", "info", "node",
                    "--config", str(conf), "--engine", "vllm", "--model", s.model,
                    "--served-name", s.served_name, "--max-model-len", str(s.max_model_len),
                    "--host", "127.0.0.1", "--port", str(port), "--node-id", node_id]
            for r in routers:
                argv += ["--router", r]
            nenv = {**env, "GPUMESH_LOG_LEVEL": "info", **s.engine_env}
            core = s.cores[i] if s.cores else ""
            if core:
                nenv["VLLM_CPU_OMP_THREADS_BIND"] = core
            self.children.append(bench_child(f"node-{node_id}", argv, self.log_dir, nenv,
                                              core))
        try:
            await self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    async def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        want = set(self.node_ids)
        for p in self.router_ports:
            async with grpc.aio.insecure_channel(self.address(p)) as ch:
                stub = cpb_grpc.RouterStub(ch)

                async def healthy() -> bool:
                    fl = await stub.GetFleet(cpb.GetFleetRequest(), timeout=2)
                    return want <= {n.node_id for n in fl.nodes if n.state == HEALTHY}

                await wait_until_async(healthy, max(1.0, deadline - time.monotonic()),
                                       watch=self.children, poll_s=0.5,
                                       what=f"router {p}: every vLLM node healthy")

    def stop(self, grace_s: float = 20.0) -> None:
        stop_all(self.children, grace_s)
        self.children = []

    def scheduler_limits(self) -> dict[str, int]:
        """max_num_seqs and max_num_batched_tokens the engines started with (their logs)."""
        for c in self.children:
            if c.name.startswith("node-"):
                m = _READY.search(c.tail(200_000))
                if m:
                    return {"max_num_seqs": int(m.group(1)),
                            "max_num_batched_tokens": int(m.group(2))}
        return {}

    async def loads(self, policy: str) -> dict[str, cpb.LoadReport]:
        """Every node's last LoadReport as router ``policy`` holds it."""
        return {n.node_id: n.load for n in (await self._fleet(policy)).nodes}

    async def predictions(self, policy: str) -> dict[str, dict[str, float]]:
        """Every node's prediction feedback as router ``policy`` keeps it (``GetFleet``):
        ``scale`` (observed / predicted TTFT; 0 = no sample yet) and ``ttft_error_p50`` (the
        median |predicted - observed| / observed TTFT of its last predictions)."""
        return {n.node_id: {"scale": n.prediction_scale, "ttft_error_p50": n.ttft_error_p50}
                for n in (await self._fleet(policy)).nodes}

    async def engines(self, policy: str) -> dict[str, str]:
        """Every node's engine kind ("vllm", "sim", ...) as router ``policy`` lists it."""
        return {n.node_id: n.engine for n in (await self._fleet(policy)).nodes}

    async def _fleet(self, policy: str) -> cpb.GetFleetResponse:
        """Router ``policy``'s ``GetFleet`` answer."""
        async with grpc.aio.insecure_channel(self.address(policy)) as ch:
            return await cpb_grpc.RouterStub(ch).GetFleet(cpb.GetFleetRequest(), timeout=5)

    async def wait_idle(self, policy: str, timeout_s: float = 120.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            loads = await self.loads(policy)
            if all(x.in_flight == 0 and x.num_running == 0 and x.num_waiting == 0
                   for x in loads.values()):
                return True
            await asyncio.sleep(0.5)
        return False


async def run_trace(fleet: LiveFleet, policy: str, msgs: Sequence[pb.GenerateRequest],
                    arrivals_s: Sequence[float], timeout_s: float = 300.0,
                    sample_s: float = 1.0) -> tuple[list[RequestResult], list[dict[str, Any]]]:
    """Sends ``msgs[i]`` at ``arrivals_s[i]`` (seconds from the start) through router
    ``policy``; returns every request's result and the per-second samples of the nodes'
    prefix-cache hit rate and queue ([{"t": s, "e0": {"hit": .., "running": ..}, ...}])."""
    bench = [BenchRequest(i, float(t), int(len(m.token_ids.ids)), int(m.sampling.max_tokens),
                          "", m.model) for i, (m, t) in enumerate(zip(msgs, arrivals_s,
                                                                      strict=True))]
    cfg = LoadConfig(target=fleet.address(policy), rate=1.0, num_requests=len(bench),
                     timeout_s=timeout_s, progress_s=0, label=policy)
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()

    async def sample() -> None:
        while True:
            await asyncio.sleep(sample_s)
            try:
                loads = await fleet.loads(policy)
            except grpc.aio.AioRpcError:
                continue
            samples.append({"t": time.monotonic() - t0, **{
                k: {"hit": v.prefix_cache_hit_rate, "running": v.num_running,
                    "waiting": v.num_waiting,
                    "prefill_capacity": v.prefill_capacity_tokens_per_s,
                    "decode_step_s": v.decode_step_s} for k, v in loads.items()}})

    sampler = asyncio.ensure_future(sample())
    try:
        async with grpc.aio.insecure_channel(fleet.address(policy)) as ch:
            stub = pb_grpc.InferenceStub(ch)
            await asyncio.wait_for(ch.channel_ready(), timeout=30)
            run = await drive(cfg, bench, lambda b, t: send_message(stub, msgs[b.index], b,
                                                                    cfg, t))
    finally:
        sampler.cancel()
    return sorted(run.results, key=lambda r: r.index), samples


async def direct(address: str, msgs: Sequence[pb.GenerateRequest],
                 timeout_s: float = 120.0) -> list[RequestResult]:
    """``msgs`` sent at once, straight to one node (no router): for calibration."""
    bench = [BenchRequest(i, 0.0, len(m.token_ids.ids), int(m.sampling.max_tokens), "",
                          m.model) for i, m in enumerate(msgs)]
    cfg = LoadConfig(target=address, concurrency=max(1, len(msgs)), num_requests=len(msgs),
                     timeout_s=timeout_s, progress_s=0)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        run = await drive(cfg, bench, lambda b, t: send_message(stub, msgs[b.index], b, cfg, t))
    return run.results


def token_request(model: str, ids: Sequence[int], max_tokens: int,
                  request_id: str) -> pb.GenerateRequest:
    """A greedy token-id request that generates exactly ``max_tokens`` tokens."""
    m = pb.GenerateRequest(model=model, request_id=request_id)
    m.token_ids.ids.extend(ids)
    m.sampling.max_tokens = max_tokens
    m.sampling.ignore_eos = True
    m.sampling.temperature = 0.0
    return m
