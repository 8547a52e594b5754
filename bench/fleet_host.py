"""``python -m gpumesh_bench.fleet_host SPEC.json``: one process of a benchmark fleet, serving
several simulated nodes (each a :class:`gpumesh.node.app.NodeServer` with its own gRPC server,
engine and heartbeat client) in one event loop until SIGTERM or SIGINT.

SPEC (written by :class:`gpumesh_bench.fleet.Fleet`): ``routers``, ``model``, ``time_scale``,
``flush_interval_ms``, ``stream_messages_per_s``, ``log_level`` and ``nodes``, each a
:class:`gpumesh_bench.fleet.SimNodeSpec` as a dict plus its ``port``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpumesh.node.config import NodeConfig


async def _host(spec: dict[str, Any]) -> None:
    from gpumesh.node.app import NodeServer, build_engine

    servers = []
    for n in spec["nodes"]:
        sim = {"speed": n["speed"], "kv_capacity_tokens": n["kv_capacity_tokens"],
               "time_scale": spec["time_scale"], **n.get("sim", {})}
        cfg = NodeConfig(serving={"node_id": n["node_id"], "host": "127.0.0.1",
                                  "port": n["port"],
                                  "weight": float(n["weight"] if n.get("weight") is not None
                                                  else n["speed"]),
                                  "drain_timeout_s": 1.0},
                         membership={"routers": tuple(spec["routers"])},
                         engine={"kind": "sim", "model": spec["model"], "sim": sim},
                         streaming={"flush_interval_ms": int(spec["flush_interval_ms"]),
                                    "stream_messages_per_s": float(spec["stream_messages_per_s"])},
                         security={"ticket_secret": os.environ.get("GPUMESH_TICKET_SECRET", "")})
        s = NodeServer(cfg, build_engine(cfg))
        await s.start()
        servers.append(s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await asyncio.gather(*(s.stop(grace_s=0.5) for s in servers), return_exceptions=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m gpumesh_bench.fleet_host SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    logging.basicConfig(level=getattr(logging, spec.get("log_level", "warning").upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_host(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
