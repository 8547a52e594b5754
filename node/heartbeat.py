"""Heartbeats: the node's long-lived Connect stream to every router process.

One task per router address keeps a stream open: Registration first, then a Heartbeat every
``busy_interval_s`` while the node has work (in flight, running or waiting), one at the first
check after it went idle, and every ``idle_interval_s`` otherwise. A broken stream is retried
with jittered exponential backoff; the node keeps serving direct clients meanwhile. Nothing
follows the Registration until the router's hello: a router that refuses the node ends the
stream first, and its status and reason are logged at WARNING (``REFUSALS``). A
router's RouterHello may list peer processes (multi-worker routers): the node opens a stream
to each of them too. A DrainOrder from any router starts the node's drain, an UndrainOrder
ends an operator's drain. ``wake()`` sends the next heartbeat at once (used when draining
starts). Each heartbeat lists the router ids of the node's live streams, and carries the
engine epoch of its prefix-cache publishers (``LoadReport.engine_epoch``; ``gpumesh.node.cache``):
a router that sees it move forgets the node's indexed blocks even before the cleared update.

Router discovery (``gpumesh.node.discovery``) calls ``set_discovered`` with the addresses a
DNS name resolves to: streams to new addresses start, streams to addresses no longer listed
deregister and end; ``on_stream_lost`` tells discovery a stream broke (re-resolve now).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from pydantic import BaseModel, Field

from gpumesh.config import SECTION, StrList
from gpumesh.node.cache import KvPublisher, KvSubscription
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc

log = logging.getLogger(__name__)

# A router's answers that refuse this node (logged at WARNING with the router's reason).
REFUSALS = frozenset({
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
})
REFUSAL_LOG_S = 30.0


class NodeMembershipSettings(BaseModel):
    """The node's ``[membership]`` section: which routers it joins and how it heartbeats."""

    model_config = SECTION

    routers: StrList = Field(
        (), description="Router control-plane addresses, host:port, or dns:///NAME:PORT "
                        "(every address the name resolves to; gpumesh.node.discovery).")
    router_resolve_interval_s: float = Field(
        10.0, gt=0, allow_inf_nan=False,
        description="dns:/// router targets are re-resolved this often, and soon after a "
                    "heartbeat stream breaks.")
    heartbeat_busy_interval_s: float = Field(
        0.25, gt=0, allow_inf_nan=False,
        description="Heartbeat interval while the node has work.")
    heartbeat_idle_interval_s: float = Field(
        0.25, gt=0, allow_inf_nan=False,
        description="Heartbeat interval while idle (= busy: a hung idle node is STALE in 0.5 s).")
    reconnect_max_backoff_s: float = Field(
        1.0, gt=0, allow_inf_nan=False,
        description="Longest wait between reconnects to a router (jittered exponential "
                    "backoff): a restarted router has its fleet back within about this long.")
    kv_events: bool = Field(
        True, description="Stream the engine's prefix-cache block events to routers for "
                          "precise prefix locality; off: routers approximate this node's cache.")


@dataclass(slots=True, eq=False)
class HeartbeatClient:
    """The node's Connect streams to its ``routers`` (module docstring): ``registration``
    and ``load`` build the messages each stream sends; ``on_drain`` / ``on_undrain`` take a
    router's orders; ``on_stream_lost`` hears of every broken stream. Set by ``node.app``
    before ``start()``: ``credentials`` (TLS to routers, called per stream, so rotated files
    are read) and ``metadata`` (the Connect metadata: the join token); None / () = plaintext,
    no metadata."""

    routers: tuple[str, ...]
    registration: Callable[[], cpb.Registration]
    load: Callable[[], cpb.LoadReport]
    busy_interval_s: float = 0.25
    idle_interval_s: float = 2.0
    max_backoff_s: float = 5.0
    on_drain: Callable[[str], None] | None = None
    on_undrain: Callable[[str], None] | None = None
    on_stream_lost: Callable[[str], None] | None = None
    rng: random.Random = field(default_factory=random.Random)
    # prefix-cache block events, one subscription per stream (gpumesh.node.cache)
    kv_publishers: Sequence[KvPublisher] = ()
    credentials: Callable[[], grpc.ChannelCredentials] | None = field(init=False, default=None)
    metadata: tuple[tuple[str, str], ...] = field(init=False, default=())
    connected: dict[str, str] = field(init=False, default_factory=dict)  # address -> router_id
    reconnects: int = field(init=False, default=0)
    _seq: int = field(init=False, default=0)
    _tasks: dict[str, asyncio.Task[None]] = field(init=False, default_factory=dict)
    _wake: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _closing: bool = field(init=False, default=False)
    _stops: dict[str, asyncio.Event] = field(init=False, default_factory=dict)
    # addresses from discovery (set_discovered); those discovered before, no longer listed
    # (their streams end); discovered address -> its DNS name
    _discovered: set[str] = field(init=False, default_factory=set)
    _retired: set[str] = field(init=False, default_factory=set)
    _server_names: dict[str, str] = field(init=False, default_factory=dict)
    # the last refusal per router: (code, reason, when)
    _refused: dict[str, tuple[grpc.StatusCode, str, float]] = field(
        init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.kv_publishers = tuple(self.kv_publishers)

    def start(self) -> None:
        for addr in self.routers:
            self._ensure(addr)

    def _ensure(self, addr: str) -> None:
        if (addr not in self._tasks or self._tasks[addr].done()) and not self._closing:
            self._tasks[addr] = asyncio.create_task(self._keep(addr), name=f"heartbeat:{addr}")

    def set_discovered(self, addresses: Iterable[str],
                       hosts: Mapping[str, str] | None = None) -> None:
        """The router addresses discovery resolved now: streams start to new ones; streams to
        discovered addresses no longer listed deregister and end. ``hosts``: the DNS name
        each address came from (TLS verifies the router's certificate against it)."""
        self._server_names = dict(hosts or {})
        new = set(addresses)
        for addr in self._discovered - new:
            self._retired.add(addr)
            if (stop := self._stops.get(addr)) is not None:
                stop.set()
        for addr in sorted(new):
            self._retired.discard(addr)
            self._ensure(addr)
        self._discovered = new

    def channel_options(self, addr: str) -> list[tuple[str, str]]:
        """Channel options for a stream to ``addr``: a discovered address (an IP) verifies
        the router's TLS certificate against the DNS name it came from."""
        name = self._server_names.get(addr)
        return [("grpc.ssl_target_name_override", name)] if name else []

    def router_ids(self) -> list[str]:
        """The router ids of the node's live streams (what heartbeats report)."""
        return sorted(set(self.connected.values()))

    def wake(self) -> None:
        self._wake.set()

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _report(self) -> cpb.LoadReport:
        """The node's load now, stamped with its engine epoch (the newest of its KV
        publishers'; left as the node set it without publishers)."""
        load = self.load()
        if self.kv_publishers:
            load.engine_epoch = max(p.epoch for p in self.kv_publishers)
        return load

    def _heartbeat(self) -> cpb.NodeMessage:
        return cpb.NodeMessage(heartbeat=cpb.Heartbeat(
            seq=self._next_seq(), sent_unix_ms=int(time.time() * 1000), load=self._report(),
            router_ids=self.router_ids()))

    async def _messages(self, stop: asyncio.Event, kv: Sequence[KvSubscription] = (),
                        hello: asyncio.Event | None = None) -> AsyncIterator[cpb.NodeMessage]:
        yield cpb.NodeMessage(registration=self.registration())
        if hello is not None:
            # Nothing more until the router accepted the registration (its hello): a router
            # that refuses ends the stream meanwhile, and the node sees the router's status
            # (gRPC's client reports INTERNAL for a call ended while it was still writing).
            waits = {asyncio.ensure_future(hello.wait()), asyncio.ensure_future(stop.wait())}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for t in waits:
                t.cancel()
            if not hello.is_set():
                return
        last_sent = -1e9
        was_busy = False
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            # Check every busy interval; send when busy, on the first check after the node
            # went idle, when the idle interval has passed, or when woken (drain). A node that
            # turns busy or idle is reported within one busy interval (an idle node's last
            # busy report would otherwise stand for up to the idle interval, and routers that
            # did not see its requests end would count them until then).
            load = self._report()
            busy = bool(load.in_flight or load.num_running or load.num_waiting)
            now = loop.time()
            went_idle, was_busy = was_busy and not busy, busy
            # (a busy node's heartbeat waits half an interval: prefix-cache updates wake the
            # loop more often than that)
            if ((busy and now - last_sent >= self.busy_interval_s / 2) or went_idle
                    or self._wake.is_set() or now - last_sent >= self.idle_interval_s):
                self._wake.clear()
                last_sent = now
                yield cpb.NodeMessage(heartbeat=cpb.Heartbeat(
                    seq=self._next_seq(), sent_unix_ms=int(time.time() * 1000), load=load,
                    router_ids=self.router_ids()))
            timeout = self.busy_interval_s
            for sub in kv:   # prefix-cache updates, each bounded in size and rate
                for update in sub.take(loop.time()):
                    yield cpb.NodeMessage(kv_cache=update)
                if sub.ready.is_set():
                    timeout = min(timeout, max(sub.due_in(loop.time()), 0.001))
            waits = {asyncio.ensure_future(self._wake.wait()),
                     asyncio.ensure_future(stop.wait()),
                     *(asyncio.ensure_future(sub.ready.wait()) for sub in kv
                       if not sub.ready.is_set())}
            _, pending = await asyncio.wait(waits, timeout=timeout,
                                            return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
        yield cpb.NodeMessage(heartbeat=self._heartbeat().heartbeat)
        yield cpb.NodeMessage(deregistration=cpb.Deregistration(reason="node shutting down"))

    async def _keep(self, addr: str) -> None:
        backoff = 0.1
        while not self._closing and addr not in self._retired:
            parked = False
            stop = asyncio.Event()
            self._stops[addr] = stop
            subs = {p.model: p.subscribe() for p in self.kv_publishers}
            hello = asyncio.Event()
            try:
                async with (grpc.aio.secure_channel(addr, self.credentials(),
                                                    options=self.channel_options(addr))
                            if self.credentials is not None
                            else grpc.aio.insecure_channel(addr)) as channel:
                    stub = cpb_grpc.ControlPlaneStub(channel)
                    call = stub.Connect(self._messages(stop, tuple(subs.values()), hello),
                                        metadata=self.metadata)
                    async for msg in call:
                        kind = msg.WhichOneof("kind")
                        if kind == "hello":
                            if addr not in self.connected:
                                log.info("heartbeat stream to %s up (router %s)", addr,
                                         msg.hello.router_id)
                            self.connected[addr] = msg.hello.router_id
                            hello.set()
                            self._refused.pop(addr, None)
                            backoff = 0.1
                            peers = tuple(msg.hello.peer_addresses)
                            for peer in peers:
                                self._ensure(peer)
                            if peers and addr not in peers:
                                # A multi-worker router's shared port: it only told us the
                                # workers' own control addresses, which we now stream to.
                                parked = True
                                break
                        elif kind == "kv_snapshot":
                            sub = subs.get(msg.kv_snapshot.model)
                            if sub is not None:
                                sub.resnapshot()
                        elif kind == "drain" and self.on_drain is not None:
                            self.on_drain(msg.drain.reason or f"drain ordered by {addr}")
                        elif kind == "undrain" and self.on_undrain is not None:
                            self.on_undrain(msg.undrain.reason or f"undrain ordered by {addr}")
                    if self._closing:
                        return
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                self._log_end(addr, exc)
            except Exception:
                log.warning("heartbeat stream to %s failed", addr, exc_info=True)
            finally:
                self.connected.pop(addr, None)
                for p in self.kv_publishers:
                    p.unsubscribe(subs[p.model])
            if self._closing:
                return
            if addr in self._retired:
                return   # discovery no longer lists it
            if parked:
                # Come back to the shared address only when no worker stream is left (the
                # router restarted elsewhere, or on other control ports).
                await asyncio.sleep(self.max_backoff_s)
                while self.connected and not self._closing:
                    await asyncio.sleep(self.max_backoff_s)
                continue
            self.reconnects += 1
            if self.on_stream_lost is not None:
                self.on_stream_lost(addr)
            delay = backoff * (0.5 + self.rng.random())
            backoff = min(self.max_backoff_s, backoff * 2)
            await asyncio.sleep(delay)

    def _log_end(self, addr: str, exc: grpc.aio.AioRpcError) -> None:
        """A router's refusal (its status and reason) at WARNING when its status changes and
        at most every ``REFUSAL_LOG_S`` while it repeats (a reason may change each time: "…
        quarantined for 12s more"); a broken stream at DEBUG."""
        code = exc.code()
        if code not in REFUSALS:
            log.debug("heartbeat stream to %s broke: %s", addr, code)
            return
        details = (exc.details() or "")[:512]
        now = time.monotonic()
        last = self._refused.get(addr)
        if last is None or last[0] != code or now - last[2] >= REFUSAL_LOG_S:
            self._refused[addr] = (code, details, now)
            log.warning("router %s refused this node (%s): %s", addr, code.name, details)
        else:
            log.debug("router %s refused this node again (%s)", addr, code.name)

    async def close(self, timeout_s: float = 2.0) -> None:
        """Deregisters from every router (best effort, bounded), then stops."""
        self._closing = True
        for stop in self._stops.values():
            stop.set()
        tasks = list(self._tasks.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
