"""``gpumesh bench prefix-restart``: how fast a restarted router's prefix index is whole again.

In one process: a router and ``--nodes`` simulated nodes (the 7B shape, real time), each node
warmed with ``--tenants-per-node`` distinct ~4,000-token prompts through the router so its
engine holds them and streams them as KV events. The router is then stopped and a new one
started on the same port; every 2 ms the probe reads, per node, when it registered again and
when the new router's index held as many of its blocks as the old one did. Nodes reconnect
with their own jittered backoff (``reconnect_max_backoff_s``), so the index's own delay is
what follows each node's registration: its snapshot, sent at once on the new stream.

Prints and writes OUT/restart.json: per node the seconds from the new router's start to its
registration and from registration to its index entries, with the heartbeat intervals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import grpc

from gpumesh.node.app import NodeServer
from gpumesh.node.config import NodeConfig
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig
from gpumesh.router.app import RouterServer
from gpumesh.router.config import RouterConfig
from gpumesh.v1 import inference_pb2, inference_pb2_grpc
from gpumesh_bench.prefix_bench import SHAPE_7B
from gpumesh_bench.tenants import _words


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench/results/prefix/restart")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--tenants-per-node", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def run(a: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    cfg = RouterConfig(host="127.0.0.1", port=port, router_id="probe", shutdown_grace_s=0.2)
    router = RouterServer(cfg)
    await router.start()
    nodes = []
    for i in range(a.nodes):
        engine = SimEngine(SimEngineConfig(model_name="sim", seed=i, **SHAPE_7B))
        node = NodeServer(NodeConfig(engine="sim", port=0, node_id=f"n{i:02d}",
                                     routers=(router.address,)), engine)
        await node.start()
        nodes.append(node)
    doc: dict[str, Any] = {"nodes": a.nodes, "heartbeat_busy_interval_s":
                           nodes[0].cfg.heartbeat_busy_interval_s,
                           "heartbeat_idle_interval_s": nodes[0].cfg.heartbeat_idle_interval_s,
                           "reconnect_max_backoff_s": nodes[0].cfg.reconnect_max_backoff_s,
                           "repeats": []}
    try:
        while len(router.registry) < a.nodes:
            await asyncio.sleep(0.01)
        async with grpc.aio.insecure_channel(router.address) as ch:
            stub = inference_pb2_grpc.InferenceStub(ch)
            rng = random.Random(1)
            for k in range(a.nodes * a.tenants_per_node):
                text = f"tenant {k}. " + _words(rng, 4000)
                req = inference_pb2.GenerateRequest(model="sim", text=text)
                req.sampling.max_tokens = 2
                await stub.Generate(req, timeout=60)
        await asyncio.sleep(1.0)
        for _ in range(a.repeats):
            before = dict(router.locality.indexes.model("sim").nodes())
            await router.stop(0.2)
            router = RouterServer(cfg)
            t0 = time.perf_counter()
            await router.start()
            reg: dict[str, float] = {}
            full: dict[str, float] = {}
            while len(full) < len(before) and time.perf_counter() - t0 < 30:
                now = time.perf_counter() - t0
                ix = router.locality.indexes.get("sim")
                for n, blocks in before.items():
                    if n not in reg and router.registry.entry(n) is not None:
                        reg[n] = now
                    if n not in full and ix is not None and ix.node_blocks(n) >= blocks:
                        full[n] = now
                await asyncio.sleep(0.002)
            gaps = [full[n] - reg[n] for n in full if n in reg]
            rep = {"registered_s": reg, "indexed_s": full,
                   "index_after_registration_s": {"max": max(gaps), "median":
                                                  statistics.median(gaps)},
                   "all_indexed_after_start_s": max(full.values()),
                   "blocks": sum(before.values())}
            doc["repeats"].append(rep)
            print(f"all nodes' blocks back {rep['all_indexed_after_start_s']:.3f} s after the "
                  f"router started; after each node's registration: median "
                  f"{statistics.median(gaps) * 1000:.1f} ms, max {max(gaps) * 1000:.1f} ms "
                  f"({rep['blocks']} blocks)", flush=True)
    finally:
        for node in nodes:
            await node.stop()
        await router.stop(0.2)
    return doc


def main(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = asyncio.run(run(a))
    (out / "restart.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    return 0
