"""Steady streamed load over every router replica, for deploy/docker/smoke.sh.

One gRPC channel to all the given router addresses (round-robin, the channel's retry policy
from gpumesh.client), ``--concurrency`` workers each sending one streamed request after
another for ``--duration`` seconds. A request counts as served when its stream ends with
FINISH_REASON_LENGTH after exactly ``--max-tokens`` tokens of output; anything else (an error
status, a short stream) counts as lost. When ``--mark`` names a file, requests started after
that file appears are counted apart, to show the mesh kept serving after the event the caller
marks (smoke.sh: one router replica stopped). Prints one JSON object; exits 1 if any request
was lost or none was served after the mark.

    python smoke_load.py --targets 127.0.0.1:50050,127.0.0.1:50051 --tls-dir certs \\
        --duration 20 --mark /tmp/stopped
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from gpumesh.client import SPREAD_OPTIONS, MeshClient, build_request
from gpumesh.security.client import ClientTls
from gpumesh.v1 import inference_pb2 as pb


@dataclass
class Tally:
    served: int = 0
    lost: int = 0
    served_after_mark: int = 0
    started_after_mark: int = 0
    errors: Counter[str] = field(default_factory=Counter)


async def _one(client: MeshClient, n: int, max_tokens: int, tally: Tally, after_mark: bool,
               timeout_s: float) -> None:
    req = build_request(f"smoke request {n}: tell me about the mesh", max_tokens=max_tokens,
                        ignore_eos=True)
    tokens = 0
    finish = pb.FINISH_REASON_UNSPECIFIED
    try:
        async for chunk in client.stream(req, timeout=timeout_s):
            tokens += len(chunk.token_ids)
            finish = chunk.finish_reason or finish
    except grpc.aio.AioRpcError as e:
        tally.lost += 1
        tally.errors[f"{e.code().name}: {e.details()}"] += 1
        return
    if finish == pb.FINISH_REASON_LENGTH and tokens == max_tokens:
        tally.served += 1
        tally.served_after_mark += after_mark
    else:
        tally.lost += 1
        tally.errors[f"stream ended early: finish={finish} tokens={tokens}"] += 1


async def _worker(client: MeshClient, wid: int, args: argparse.Namespace, tally: Tally,
                  deadline: float) -> None:
    n = 0
    while time.monotonic() < deadline:
        after_mark = bool(args.mark) and os.path.exists(args.mark)
        tally.started_after_mark += after_mark
        await _one(client, wid * 1_000_000 + n, args.max_tokens, tally, after_mark,
                   args.timeout)
        n += 1


async def run(args: argparse.Namespace) -> Tally:
    target = "ipv4:" + ",".join(args.targets.split(","))
    tls = None
    if args.tls_dir:
        d = args.tls_dir
        # one channel to several addresses has no single host name to verify: the mesh's
        # certificates all carry "localhost" (gpumesh certs)
        tls = ClientTls(ca=f"{d}/ca.pem", cert=f"{d}/client.pem", key=f"{d}/client.key",
                        server_name="localhost")
    tally = Tally()
    async with MeshClient(target, channel_options=SPREAD_OPTIONS, tls=tls) as client:
        deadline = time.monotonic() + args.duration
        await asyncio.gather(*(_worker(client, w, args, tally, deadline)
                               for w in range(args.concurrency)))
    return tally


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", required=True, help="router addresses, comma-separated ip:port")
    p.add_argument("--tls-dir", default="", help="folder of `gpumesh certs` output (TLS on)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--timeout", type=float, default=60.0, help="per-request deadline, s")
    p.add_argument("--mark", default="", help="file whose appearance marks the event")
    args = p.parse_args()
    tally = asyncio.run(run(args))
    out = {"served": tally.served, "lost": tally.lost,
           "started_after_mark": tally.started_after_mark,
           "served_after_mark": tally.served_after_mark, "errors": dict(tally.errors)}
    print(json.dumps(out))
    ok = tally.lost == 0 and tally.served > 0 and (not args.mark or tally.served_after_mark > 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
