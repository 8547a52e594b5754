"""`gpumesh demo`: a router and two CPU nodes on the tiny model, one streamed answer, the
fleet table, a clean shutdown (Ctrl-C included).

Each node is its own process pinned to its own core (VLLM_CPU_OMP_THREADS_BIND), as two CPU
engines on a 2-core machine otherwise fight for the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from gpumesh.launcher import ChildProcess, stop_all, wait_until_async
from gpumesh.security.client import ClientTls

LOG_DIR = Path(os.environ.get("GPUMESH_DEMO_LOGS", "demo-logs"))


def _spawn(name: str, *args: str, env: dict[str, str] | None = None) -> ChildProcess:
    """A child in its own session (Ctrl-C reaches only the demo, which stops children in
    order); its output goes to demo-logs/<name>.log so the terminal shows the demo alone."""
    return ChildProcess.gpumesh(name, args, LOG_DIR / f"{name}.log", env=env)


def make_certs(directory: Path) -> tuple[list[str], dict[str, list[str]], ClientTls]:
    """Certificates for the demo's mesh (``gpumesh certs``): the router's TLS flags, each
    node's, and the operator's client TLS (the demo reads the fleet)."""
    from gpumesh.security.certs import make_mesh_certs

    make_mesh_certs(directory, node_ids=["node-0", "node-1"])
    ca = str(directory / "ca.pem")

    def flags(stem: str) -> list[str]:
        return ["--tls-cert-file", str(directory / f"{stem}.pem"),
                "--tls-key-file", str(directory / f"{stem}.key"), "--tls-ca-file", ca]

    return ([*flags("router"), "--tls-require-client-cert"],
            {n: [*flags(n), "--tls-require-client-cert", "--router-only"]
             for n in ("node-0", "node-1")},
            ClientTls(ca, str(directory / "operator.pem"), str(directory / "operator.key")))


async def wait_for_fleet(router: str, nodes: int, timeout_s: float,
                         tls: ClientTls | None = None) -> None:
    from gpumesh.client import MeshClient
    from gpumesh.v1 import control_pb2 as cpb

    async with MeshClient(router, tls=tls) as client:

        async def healthy() -> bool:
            fleet = await client.fleet(timeout=2.0)
            return sum(n.state == cpb.NODE_STATE_HEALTHY for n in fleet.nodes) >= nodes

        await wait_until_async(healthy, timeout_s, poll_s=0.5,
                               what=f"fleet of {nodes} healthy nodes")


async def run_demo(args: argparse.Namespace) -> int:
    from gpumesh.client import MeshClient, StreamResult, build_request
    from gpumesh.status import fleet_table

    router = f"127.0.0.1:{args.port}"
    model_args: list[str]
    if args.engine == "vllm":
        from gpumesh.tiny_model import build_tiny_model

        model_dir = build_tiny_model(args.model_dir)
        print(f"[demo] tiny model at {model_dir}", file=sys.stderr)
        model_args = ["--engine", "vllm", "--model", str(model_dir), "--served-name", "tiny",
                      "--max-model-len", "1024"]
    else:
        model_args = ["--engine", "sim", "--model", "tiny"]
    procs: list[ChildProcess] = []
    # mutual TLS on every hop with certificates gpumesh certs made (docs/security.md)
    tls: ClientTls | None = None
    router_tls: list[str] = []
    node_tls: dict[str, list[str]] = {}
    if not getattr(args, "plaintext", False):
        router_tls, node_tls, tls = make_certs(LOG_DIR / "certs")
        print(f"[demo] mutual TLS on every hop, certificates in {LOG_DIR / 'certs'}/",
              file=sys.stderr)
    try:
        procs.append(_spawn("router", "router", "--host", "127.0.0.1",
                                  "--port", str(args.port), *router_tls))
        for i in range(2):
            procs.append(_spawn(
                f"node-{i}", "node", *model_args, "--port", "0", "--node-id", f"node-{i}",
                "--router", router,
                *node_tls.get(f"node-{i}", ()),
                env={"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1)),
                     "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}))
        kind = ("two vLLM CPU nodes starting (~20-60 s" if args.engine == "vllm"
                else "two simulated nodes starting (a few seconds")
        print(f"[demo] router on {router}, {kind}; logs in {LOG_DIR}/)...", file=sys.stderr)
        await wait_for_fleet(router, 2, timeout_s=300, tls=tls)
        async with MeshClient(router, tls=tls) as client:
            result = StreamResult()
            req = build_request([("user", args.prompt)], model="tiny", max_tokens=48,
                                temperature=0.8, seed=7)
            print(f"[demo] > {args.prompt}", file=sys.stderr)
            async for chunk in client.stream(req, timeout=120, result=result):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.HasField("usage"):
                    usage = chunk.usage
            print()
            print(f"[demo] served by {result.node_id}: {usage.prompt_tokens} prompt tokens, "
                  f"{usage.completion_tokens} completion tokens (random weights: gibberish is "
                  f"expected)", file=sys.stderr)
            # Show the fleet once a heartbeat has carried the finished request's figures: the
            # serving node's generation rate (a 3 s window) and decode step, nothing in flight.
            # A report from before the request also has nothing in flight, and a short request
            # can end between two heartbeats (1 s apart when idle), so wait for the rate.
            deadline = time.monotonic() + 5.0
            while True:
                fleet = await client.fleet()
                served = [n for n in fleet.nodes if n.node_id == result.node_id]
                if (all(n.load.in_flight == 0 for n in fleet.nodes)
                        and all(n.load.generation_tokens_per_s > 0 for n in served)):
                    break
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            print(fleet_table(fleet))
        return 0
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("\n[demo] interrupted", file=sys.stderr)
        return 130
    finally:
        print("[demo] shutting down", file=sys.stderr)
        await asyncio.to_thread(stop_all, procs, 20.0)
