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

``--ttft-rate R`` adds the client's view: R requests per second (Poisson; each a warmed
tenant's prompt plus a new ~60-word turn, streamed, ``wait_for_ready`` so that a request sent
while the router is down waits for the new one) run through every repeat; the router is
restarted ``--ttft-before`` seconds into each and the stream continues ``--ttft-after``
seconds. The level is the p90 TTFT of the requests sent in the ``--ttft-before`` seconds
before the stop (and the worst p90 of its 1 s bins, by send time); TTFT is back when every
later 1 s bin has its p90 within that worst pre-stop bin's: ``ttft_recovered_s`` is that bin's
start after the stop. Also: the p90 over as many seconds from 1 s after the stop.
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
from gpumesh_bench.locality.live import SHAPE_7B
from gpumesh_bench.tenants import words


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench/locality/results/restart")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--tenants-per-node", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ttft-rate", type=float, default=0.0,
                   help="requests/s through each restart (0: index timing only)")
    p.add_argument("--ttft-before", type=float, default=10.0)
    p.add_argument("--ttft-after", type=float, default=15.0)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Stream:
    """The ``--ttft-rate`` client: streamed requests sent open loop until stopped; records
    (send time, TTFT or None, status) with times from ``t0``."""

    def __init__(self, address: str, prompts: list[str], rate: float, seed: int) -> None:
        self.address, self.prompts, self.rate = address, prompts, rate
        self.rng = random.Random(seed)
        self.t0 = time.perf_counter()
        self.records: list[tuple[float, float | None, str]] = []
        self.stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    async def _one(self, stub: Any, text: str) -> None:
        sent = time.perf_counter()
        req = inference_pb2.GenerateRequest(model="sim", text=text)
        req.sampling.max_tokens = 8
        req.sampling.ignore_eos = True
        ttft: float | None = None
        status = "OK"
        try:
            async for msg in stub.GenerateStream(req, timeout=60, wait_for_ready=True):
                if ttft is None and msg.token_ids:
                    ttft = time.perf_counter() - sent
        except grpc.aio.AioRpcError as e:
            status = e.code().name
        self.records.append((sent - self.t0, ttft, status))

    async def run(self) -> None:
        opts = [("grpc.initial_reconnect_backoff_ms", 20), ("grpc.max_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 20)]
        async with grpc.aio.insecure_channel(self.address, options=opts) as ch:
            stub = inference_pb2_grpc.InferenceStub(ch)
            while not self.stop.is_set():
                text = self.rng.choice(self.prompts) + " user: " + words(self.rng, 60)
                t = asyncio.ensure_future(self._one(stub, text))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
                await asyncio.sleep(self.rng.expovariate(self.rate))
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=60)


def _p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else float("nan")


def _bins(records: list[tuple[float, float | None, str]], start: float, n: int
          ) -> list[dict[str, Any]]:
    out = []
    for k in range(n):
        xs = [t for s, t, _ in records if start + k <= s < start + k + 1 and t is not None]
        out.append({"from_s": round(start + k, 3), "n": len(xs), "p90_s": _p90(xs)})
    return out


def ttft_recovery(records: list[tuple[float, float | None, str]], stop_s: float,
                  before_s: float) -> dict[str, Any]:
    """The level before the stop (p90 over the window, and the worst 1 s bin's p90 there),
    1 s bins after it, and when TTFT was back: the first bin after the stop from which every
    bin's p90 is within the worst pre-stop bin's (module doc)."""
    pre = [t for s, t, _ in records if stop_s - before_s <= s < stop_s and t is not None]
    level = _p90(pre)
    pre_bins = _bins(records, stop_s - before_s, int(before_s))
    bound = max([b["p90_s"] for b in pre_bins if b["n"]] + [level])
    end = max((s for s, _, _ in records), default=stop_s)
    bins = _bins(records, stop_s, int(end - stop_s) + 1)
    bins = [dict(b, from_s=round(b["from_s"] - stop_s, 3)) for b in bins]
    back = None
    for i in range(len(bins)):
        if all(b["n"] == 0 or b["p90_s"] <= bound for b in bins[i:]):
            back = bins[i]["from_s"]
            break
    post = [t for s, t, _ in records if stop_s + 1 <= s < stop_s + 1 + before_s
            and t is not None]
    return {"level_p90_s": level, "worst_pre_bin_p90_s": bound, "pre_bins": pre_bins,
            "bins": bins, "ttft_recovered_s": back,
            "p90_from_1s_after_s": _p90(post),
            "failed": sum(1 for s, _, st in records if s >= stop_s - before_s and st != "OK"),
            "records": [(round(s - stop_s, 4), None if t is None else round(t, 5), st)
                        for s, t, st in records]}


async def run(a: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    cfg = RouterConfig(serving={"host": "127.0.0.1", "port": port, "router_id": "probe",
                                "shutdown_grace_s": 0.2})
    router = RouterServer(cfg)
    await router.start()
    nodes = []
    for i in range(a.nodes):
        engine = SimEngine(SimEngineConfig(model_name="sim", seed=i, **SHAPE_7B))
        node = NodeServer(NodeConfig(engine={"kind": "sim"},
                                     serving={"port": 0, "node_id": f"n{i:02d}"},
                                     membership={"routers": (router.address,)}), engine)
        await node.start()
        nodes.append(node)
    beats = nodes[0].cfg.membership
    doc: dict[str, Any] = {"nodes": a.nodes,
                           "heartbeat_busy_interval_s": beats.heartbeat_busy_interval_s,
                           "heartbeat_idle_interval_s": beats.heartbeat_idle_interval_s,
                           "reconnect_max_backoff_s": beats.reconnect_max_backoff_s,
                           "repeats": []}
    try:
        while len(router.registry) < a.nodes:
            await asyncio.sleep(0.01)
        prompts: list[str] = []
        async with grpc.aio.insecure_channel(router.address) as ch:
            stub = inference_pb2_grpc.InferenceStub(ch)
            rng = random.Random(1)
            for k in range(a.nodes * a.tenants_per_node):
                text = f"tenant {k}. " + words(rng, 4000)
                prompts.append(text)
                req = inference_pb2.GenerateRequest(model="sim", text=text)
                req.sampling.max_tokens = 2
                await stub.Generate(req, timeout=60)
        await asyncio.sleep(1.0)
        for rep_i in range(a.repeats):
            stream = task = None
            if a.ttft_rate > 0:
                stream = _Stream(router.address, prompts, a.ttft_rate, rep_i)
                task = asyncio.ensure_future(stream.run())
                await asyncio.sleep(a.ttft_before)
            stop_s = time.perf_counter() - stream.t0 if stream else 0.0
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
            if stream is not None and task is not None:
                await asyncio.sleep(max(0.0, a.ttft_after - (time.perf_counter() - t0)))
                stream.stop.set()
                await task
                rep["ttft"] = ttft_recovery(stream.records, stop_s, a.ttft_before)
                rep["ttft"]["rate_req_per_s"] = a.ttft_rate
                tt = rep["ttft"]
                print(f"TTFT p90 before {tt['level_p90_s'] * 1000:.1f} ms (worst 1 s bin "
                      f"{tt['worst_pre_bin_p90_s'] * 1000:.1f} ms); from 1 s after the stop "
                      f"{tt['p90_from_1s_after_s'] * 1000:.1f} ms; every bin within the worst "
                      f"from {tt['ttft_recovered_s']} s after the stop; {tt['failed']} failed",
                      flush=True)
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
