"""`gpumesh router --workers N`: N full router processes sharing one public port.

Each worker is a complete router (its own registry, scheduler and dispatch accounting) with its
own ``router_id``. They share the public port through SO_REUSEPORT (the kernel spreads client
connections across them), and each also listens on a private control port. A node connecting
to the public port lands on one worker, whose RouterHello lists every worker's control address;
the node then keeps one heartbeat stream to each worker (node.heartbeat), so every worker sees
the whole fleet. Accounting stays exact across workers because nodes report admissions per
``router_id`` (RouterAccount): each worker clears exactly its own credits — the same mechanism
multiple router replicas use.

Why processes and not threads: the GIL. Why not one shared registry: it would need cross-process
state on the request path; per-worker registries fed by the same heartbeats need none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket

from gpumesh.router.config import RouterConfig

log = logging.getLogger(__name__)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("", "0.0.0.0", "::") else "0.0.0.0", 0))
        return s.getsockname()[1]


def worker_configs(cfg: RouterConfig, n: int) -> list[RouterConfig]:
    """Per-worker configs: ids ``<router_id>-w<i>``, private control ports, the peer list."""
    if cfg.serving.port == 0:
        raise ValueError("--workers needs a fixed --port (workers share it)")
    host = cfg.serving.host
    advertise = host if host not in ("", "0.0.0.0", "::") else socket.gethostname()
    ports = [_free_port(host) for _ in range(n)]
    peers = tuple(f"{advertise}:{p}" for p in ports)
    return [cfg.replace(serving={"router_id": f"{cfg.serving.router_id}-w{i}", "control_port": p,
                                 "peer_addresses": peers}) for i, p in enumerate(ports)]


def _picklable(cfg: RouterConfig) -> dict[str, object]:
    return cfg.model_dump()


def _run_worker(values: dict[str, object], log_level: int) -> None:
    from gpumesh.router.app import serve

    cfg = RouterConfig.model_validate(values)

    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(cfg))


def serve_workers(cfg: RouterConfig, n: int) -> int:
    """Runs N worker processes until SIGINT/SIGTERM, forwarded to every worker."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_run_worker, args=(_picklable(c), logging.getLogger().level),
                         name=c.serving.router_id, daemon=False) for c in worker_configs(cfg, n)]
    for p in procs:
        p.start()
    log.info("router %s: %d workers on port %d", cfg.serving.router_id, n, cfg.serving.port)

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.is_alive() and p.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for p in procs:
        p.join()
    return max((p.exitcode or 0) for p in procs)
