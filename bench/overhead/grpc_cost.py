"""grpc.aio's own server-side CPU per stream: per request and per message, on loopback.

What a node's process pays to serve a stream, without any engine or gpumesh code: a
grpc.aio server with gpumesh's ``Inference`` service whose ``GenerateStream`` yields
``--messages`` messages of ``--tokens`` token ids (plus their text, trailing metadata on the
last, as the node sends) for every request, ``--concurrency`` streams at a time from a
client in another process. The server's process CPU over ``--requests`` requests is split
by a least-squares line over the message counts into a fixed cost per request and a cost
per message. Pin the two processes to different cores (``--server-cpu`` / ``--client-cpu``)
on a shared machine.

  gpumesh bench grpc-cost --messages 1,4,16,64 --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import grpc

from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--messages", default="1,4,16,64",
                   help="comma list: messages per stream, one measurement each")
    p.add_argument("--tokens", type=int, default=14, help="token ids per message")
    p.add_argument("--requests", type=int, default=2000, help="streams per measurement")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1, help="repeat the list; medians reported")
    p.add_argument("--server-cpu", type=int, default=0, help="core for the server; -1 = any")
    p.add_argument("--client-cpu", type=int, default=1, help="core for the client; -1 = any")
    p.add_argument("--json", default="")


class _Streamer(pb_grpc.InferenceServicer):
    def __init__(self, messages: int, tokens: int) -> None:
        self._messages = messages
        self._ids = list(range(tokens))
        self._text = "x" * (4 * tokens)

    async def GenerateStream(self, request: pb.GenerateRequest,
                             context: grpc.aio.ServicerContext) -> Any:
        for i in range(self._messages):
            msg = pb.GenerateStreamResponse(text=self._text, token_ids=self._ids)
            if i == self._messages - 1:
                msg.finish_reason = pb.FINISH_REASON_LENGTH
                context.set_trailing_metadata((("x-gpumesh-node-id", "bench"),))
            yield msg
            await asyncio.sleep(0)   # as a node does between engine outputs


def _serve(messages: int, tokens: int, cpu: int, port_q: Any, stop: Any) -> None:
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})

    async def run() -> None:
        server = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(_Streamer(messages, tokens), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_q.put(port)
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await server.stop(None)

    asyncio.run(run())


async def _load(port: int, requests: int, concurrency: int) -> float:
    sent = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def worker() -> None:
            nonlocal sent
            while sent < requests:
                sent += 1
                async for _ in stub.GenerateStream(pb.GenerateRequest(model="bench")):
                    pass

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0


def measure(messages: int, a: argparse.Namespace) -> dict[str, Any]:
    """Server CPU per request for one message count (a fresh server process)."""
    import psutil

    ctx = mp.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_serve, args=(messages, a.tokens, a.server_cpu, port_q, stop),
                       daemon=True)
    proc.start()
    try:
        port = port_q.get(timeout=60)
        server = psutil.Process(proc.pid)
        asyncio.run(_load(port, max(a.requests // 10, a.concurrency), a.concurrency))  # warm-up
        t = server.cpu_times()
        c0 = t.user + t.system
        wall = asyncio.run(_load(port, a.requests, a.concurrency))
        t = server.cpu_times()
        cpu = t.user + t.system - c0
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return {"messages": messages, "requests": a.requests, "cpu_s": round(cpu, 3),
            "us_per_request": round(1e6 * cpu / a.requests, 1),
            "us_per_message": round(1e6 * cpu / (a.requests * messages), 2),
            "messages_per_s": round(a.requests * messages / wall), "server_cores": round(cpu / wall, 2)}


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of µs per request = fixed + per_message x messages -> (fixed, per_message)."""
    xs = [float(m) for m, _ in points]
    ys = [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("need at least two different message counts")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


def main(a: argparse.Namespace) -> int:
    counts = [int(x) for x in a.messages.split(",") if x.strip()]
    if len(set(counts)) < 2 or min(counts) < 1:
        raise SystemExit("--messages wants at least two different counts >= 1, e.g. 1,4,16,64")
    if a.client_cpu >= 0:
        os.sched_setaffinity(0, {a.client_cpu})
    rows = []
    for k in range(a.rounds):
        for m in counts:
            r = {"round": k, **measure(m, a)}
            rows.append(r)
            print(json.dumps(r), flush=True)
    med = {m: statistics.median(r["us_per_request"] for r in rows if r["messages"] == m)
           for m in counts}
    fixed, per_message = fit(sorted(med.items()))
    print(f"\n| messages per stream | server µs per request (median of {a.rounds}) |")
    print("|---|---|")
    for m in counts:
        print(f"| {m} | {med[m]:.0f} |")
    print(f"\nleast squares: {fixed:.0f} µs per request + {per_message:.1f} µs per message "
          f"({a.tokens} token ids each)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows, "fixed_us": fixed,
                       "per_message_us": per_message}, f, indent=1)
    return 0
