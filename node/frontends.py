"""A node with several front-end processes over its one vLLM engine (``frontends = N``).

Why: a node's process does vLLM's per-token front-end work (output processing, detokenizing)
and serves gRPC on one core, and with a small model on a fast GPU that core, not the GPU,
limits the node. vLLM's own answer is ``vllm serve
--api-server-count N``: one engine core, N front-end processes, each an ``AsyncLLM`` client
that gets only its own requests' outputs. This is that, for the node:

- The main process is front end 0. It binds the port (SO_REUSEPORT), starts the engine core
  and its own client (``VllmEngine(frontends=N)`` launches a ``SharedEngineCore``), then
  ``FrontendGroup.start`` spawns front ends 1..N-1 and waits until each serves. Only then is
  the node SERVING and only the main process heartbeats.
- Each other front end (``_frontend_main``, a spawned process) joins the engine core with its
  ``FrontendSlot``, then serves the node's services on the same port (the kernel spreads
  client connections over the processes), and sends its ``LoadReport`` (the protobuf's
  bytes) to the main process every ``REPORT_INTERVAL_S``. It drains and stops when the main
  process says so, and stops if the main process goes away.
- The node's one report is ``gpumesh.node.report.merge_reports`` of the main process's and
  the latest of each other front end's: engine-wide figures from the freshest scheduler
  snapshot (vLLM returns each step's scheduler stats to one front end only), what each front
  end counts of its own requests summed.

A front end that dies takes its connections' streams with it, and its requests keep running
in the engine core to their end (nobody aborts them): the node then stops, as ``vllm serve``
does when one of its API servers dies, draining the others first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from gpumesh.types import LoadReport
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.wire import load_report_from_proto, load_report_to_proto

if TYPE_CHECKING:
    from gpumesh.node.app import NodeServer
    from gpumesh.node.config import NodeConfig
    from gpumesh.node.engines.vllm import FrontendSlot

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 0.1      # each front end's report to the main process
PROCESS_TITLE = "gpumesh-frontend"  # + "-<index>": what ps and the GPU bench's CPU sampler see
READY_TIMEOUT_S = 600.0      # a front end's start (imports, tokenizer, joining the core)


class FrontendGroup:
    """The main process's view of the node's other front-end processes."""

    def __init__(self, cfg: NodeConfig, on_lost: Callable[[str], None]) -> None:
        self._cfg = cfg
        self._on_lost = on_lost
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._reports: dict[int, tuple[float, LoadReport]] = {}
        self._ready: dict[int, str] = {}  # index -> the front end's own address
        self._stopping = False
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, node: NodeServer) -> None:
        """Spawn one process per slot in ``node.engine.peer_slots`` on ``node.port``; return
        once every one serves. Raises RuntimeError if one exits or times out first."""
        from gpumesh.node.engines.vllm import SharedEngineCore

        self._loop = asyncio.get_running_loop()
        slots = list(getattr(node.engine, "peer_slots", ()))
        cfg = self._cfg.replace(serving={"port": node.port}, membership={"routers": ()})
        ctx = mp.get_context("spawn")
        for slot in slots:
            mine, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_frontend_main, name=f"{PROCESS_TITLE}-{slot.index}",
                               args=(cfg, slot, theirs, logging.getLogger().level))
            await asyncio.to_thread(proc.start)  # spawns an interpreter: off the loop
            theirs.close()
            self._procs.append(proc)
            self._conns.append(mine)
        SharedEngineCore.handed_over(slots)
        self._reader = threading.Thread(target=self._read, name="frontend-reports",
                                        daemon=True)
        self._reader.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(self._ready) < len(self._procs):
            dead = [p.name for p in self._procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"front end(s) exited while starting: {dead}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"front ends not serving after {READY_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.1)
        assert node.state is not None
        node.state.frontend_addresses = (node.own_address,
                                         *(self._ready[i] for i in range(len(self._procs))))
        self._send("addresses", node.state.frontend_addresses)
        log.info("node %s: %d front-end processes serving on port %d",
                 node.address, len(self._procs) + 1, node.port)

    def _read(self) -> None:
        """Reader thread: the front ends' messages, and their exits."""
        index = {c: i for i, c in enumerate(self._conns)}
        open_conns = list(self._conns)
        while open_conns:
            try:
                ready = wait(open_conns)
            except (OSError, ValueError):  # closed by stop()
                return
            for conn in ready:
                i = index[conn]  # type: ignore[index]
                try:
                    msg = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    open_conns.remove(conn)  # type: ignore[arg-type]
                    with self._lock:
                        self._reports.pop(i, None)
                    self._lost(i)
                    continue
                if msg[0] == "report":
                    report = load_report_from_proto(cpb.LoadReport.FromString(msg[2]))
                    with self._lock:
                        self._reports[i] = (msg[1], report)
                elif msg[0] == "ready":
                    self._ready[i] = msg[1]

    def _lost(self, i: int) -> None:
        if self._stopping or self._loop is None:
            return
        proc = self._procs[i]
        proc.join(timeout=1.0)
        reason = f"front-end process {proc.name} exited (code {proc.exitcode})"
        log.error("%s: stopping the node", reason)
        self._loop.call_soon_threadsafe(self._on_lost, reason)

    def reports(self) -> list[tuple[float, LoadReport]]:
        with self._lock:
            return list(self._reports.values())

    def drain(self) -> None:
        self._send("drain")

    def _send(self, *msg: Any) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(msg)

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every front end (each drains what it still holds, bounded by its
        drain_timeout_s, then stops); kill those still running after ``timeout_s``."""
        self._stopping = True
        self._send("stop")
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            await asyncio.to_thread(p.join, max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.warning("front end %s did not stop in time: killing it", p.name)
                p.kill()
                await asyncio.to_thread(p.join, 5.0)
        for conn in self._conns:
            conn.close()
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, 5.0)


def _frontend_main(cfg: NodeConfig, slot: FrontendSlot, conn: Connection,
                   log_level: int) -> None:
    """Entry point of a spawned front-end process."""
    with contextlib.suppress(ImportError):  # a vLLM dependency
        import setproctitle

        setproctitle.setproctitle(f"{PROCESS_TITLE}-{slot.index}")
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The main process decides when front ends stop (Ctrl-C reaches the whole group).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    asyncio.run(_serve_frontend(cfg, slot, conn))


async def _serve_frontend(cfg: NodeConfig, slot: FrontendSlot, conn: Connection) -> None:
    from gpumesh.node.app import NodeServer, build_engine

    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()

    def read_commands() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the main process is gone
                loop.call_soon_threadsafe(commands.put_nowait, ("stop",))
                return
            loop.call_soon_threadsafe(commands.put_nowait, msg)

    engine = build_engine(cfg, frontend=slot)
    node = NodeServer(cfg, engine, frontend_index=slot.index)
    try:
        # The engine first: connections the kernel hands this process are served at once.
        await engine.start()
        await node.start()
        conn.send(("ready", node.own_address))
        threading.Thread(target=read_commands, name="frontend-commands", daemon=True).start()

        async def report() -> None:
            while True:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(("report", engine.load().stats_at,
                               load_report_to_proto(node.load_report()).SerializeToString()))
                await asyncio.sleep(REPORT_INTERVAL_S)

        reporter = asyncio.create_task(report())
        drains: set[asyncio.Task[None]] = set()
        while (cmd := await commands.get())[0] != "stop":
            if cmd[0] == "drain":
                drains.add(task := loop.create_task(node.drain()))
                task.add_done_callback(drains.discard)
            elif cmd[0] == "addresses":
                assert node.state is not None
                node.state.frontend_addresses = tuple(cmd[1])
        await node.drain()
        reporter.cancel()
    finally:
        await node.stop()
        conn.close()
