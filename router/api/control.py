"""``RouterControlPlaneServicer``: the ControlPlane Connect stream, one per (node, router
process). Membership lives as long as the stream: registration, heartbeats, leave.

Who before what (docs/security.md): the caller's credential is checked when the stream opens,
before any message is read (``router.auth.membership.authenticate``); a Registration's node
id is checked against that credential, against a live holder (ALREADY_EXISTS) and against
the quarantine before anything else of it is validated or recorded. So a stranger's stream
ends with UNAUTHENTICATED or PERMISSION_DENIED whatever it says, and changes nothing.

The first message must be a Registration (node_id, address and models required), within one
lease (DEADLINE_EXCEEDED otherwise); streams yet to register are bounded per peer and in total
(``router.auth.streams``). Each heartbeat is acknowledged with its seq. Every registration and
heartbeat is validated (``router.fleet.validation``) before the registry sees it: a member
that sends garbage is removed, quarantined under its (authenticated) id with the reason
(``router.fleet.quarantine``; GetFleet lists it) and its stream ends with INVALID_ARGUMENT.
Heartbeats beyond ``node_max_heartbeats_per_s`` are dropped. When the router stops, open
streams end and nodes reconnect elsewhere or later.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import grpc

from gpumesh.router.api.orders import NodeOrders, wait_read
from gpumesh.router.config import RouterConfig
from gpumesh.router.fleet import Registry
from gpumesh.router.fleet.locality import PrefixLocality
from gpumesh.router.fleet.quarantine import HeartbeatRate, Quarantine
from gpumesh.router.fleet.validation import (
    InvalidNodeInput,
    NodeLimits,
    valid_heartbeat,
    valid_kv_update,
    valid_registration,
)
from gpumesh.router.auth.interceptor import AuthCounters
from gpumesh.router.auth.membership import Member, MembershipError, authenticate, authorize
from gpumesh.router.auth.streams import UnregisteredStreams, peer_host as _peer_host
from gpumesh.security.guard import is_unparseable
from gpumesh.security.tls import peer_identity
from gpumesh.v1 import control_pb2, control_pb2_grpc

log = logging.getLogger(__name__)


class RouterControlPlaneServicer(control_pb2_grpc.ControlPlaneServicer):
    """Set ``closing`` to end every open stream (router shutdown)."""

    def __init__(self, config: RouterConfig, registry: Registry,
                 quarantine: Quarantine | None = None,
                 locality: PrefixLocality | None = None) -> None:
        self.config = config
        self.locality = locality   # prefix-cache updates from nodes (router.fleet.locality)
        self.registry = registry
        self.quarantine = quarantine or Quarantine(config.membership.quarantine_s, registry.clock)
        self.limits = NodeLimits(
            max_models=config.membership.node_max_models,
            max_aliases=config.membership.node_max_aliases,
            max_name_length=config.membership.node_max_name_length,
            max_capacity_weight=config.membership.node_max_capacity_weight)
        self.heartbeats_dropped = 0
        self.auth_counters = AuthCounters()   # app.py shares the router's
        self.orders = NodeOrders()   # the operator API's drain/undrain orders, per stream
        self._ids = itertools.count(1)
        self._unregistered = UnregisteredStreams()   # streams yet to register, bounded
        self.closing = asyncio.Event()

    def _hello(self) -> control_pb2.RouterMessage:
        return control_pb2.RouterMessage(hello=control_pb2.RouterHello(
            router_id=self.config.serving.router_id,
            peer_addresses=self.config.serving.peer_addresses,
            heartbeat_interval_ms=self.config.membership.heartbeat_interval_ms,
            lease_ttl_ms=int(self.config.membership.lease_ttl_s * 1000)))

    async def Connect(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        # Who before what: the caller is authenticated before its first message is read, so
        # a stranger's stream ends here whatever it would have said.
        member = await self._authenticate(context)
        peer = _peer_host(context.peer())
        if not await self._unregistered.enter(peer, context, self.auth_counters):
            return
        stream_id = next(self._ids)
        node_id = ""
        unregistered = True
        closing = asyncio.ensure_future(self.closing.wait())
        outbox = self.orders.open(stream_id)
        try:
            # The first message must come within one lease (a node sends its Registration at
            # once); an idle stranger's stream does not stay open.
            read = asyncio.ensure_future(context.read())
            done, _ = await asyncio.wait({read, closing},
                                         timeout=self.config.membership.lease_ttl_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if read not in done:
                read.cancel()
                if closing in done:
                    return
                self.auth_counters.reject("node", grpc.StatusCode.DEADLINE_EXCEEDED,
                                          "no Registration within the lease", context.peer())
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"the first message (a Registration) must come within "
                                    f"{self.config.membership.lease_ttl_s:g}s")
            while True:
                msg = read.result()
                if msg is grpc.aio.EOF:
                    return
                if is_unparseable(msg):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        "NodeMessage could not be parsed")
                kind = msg.WhichOneof("kind")
                if not node_id and kind != "registration":
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                        "the first message must be a Registration")
                if kind == "registration":
                    claimed = msg.registration.node_id
                    await self._admit(member, claimed, stream_id, context)
                    try:
                        reg = valid_registration(msg.registration, self.limits)
                    except InvalidNodeInput as exc:
                        await self._reject(context, claimed, msg.registration.address,
                                           node_id, stream_id, exc)
                    rate = HeartbeatRate(self.config.membership.node_max_heartbeats_per_s)
                    if node_id and node_id != reg.node_id:
                        self.registry.stream_closed(node_id, stream_id)
                    node_id = reg.node_id
                    if unregistered:
                        unregistered = False
                        self._unregistered.leave(peer)
                    self.registry.register(reg, stream_id)
                    await context.write(self._hello())
                elif kind == "heartbeat":
                    hb = msg.heartbeat
                    if not rate.allow():
                        self.heartbeats_dropped += 1
                    else:
                        try:
                            load = valid_heartbeat(hb, self.limits)
                        except InvalidNodeInput as exc:
                            await self._reject(context, node_id, reg.address, node_id,
                                               stream_id, exc)
                        if self.registry.entry(node_id) is None:
                            # Dropped meanwhile (its other stream to this router closed, or
                            # the lease lapsed) but this stream is alive: soft state
                            # re-admits it.
                            self.registry.register(reg, stream_id)
                        self.registry.heartbeat(node_id, stream_id, hb.seq, hb.sent_unix_ms,
                                                load, tuple(r[:256] for r in hb.router_ids[:64]))
                        if self.locality is not None:   # a restarted / reset engine
                            self.locality.engine_epoch(node_id, load.engine_epoch)
                        await context.write(control_pb2.RouterMessage(
                            ack=control_pb2.HeartbeatAck(seq=hb.seq)))
                elif kind == "kv_cache":
                    await self._kv_cache(msg.kv_cache, node_id, reg, context)
                elif kind == "deregistration":
                    self.registry.deregister(node_id, stream_id,
                                             msg.deregistration.reason[:256])
                    node_id = ""
                    return
                read = asyncio.ensure_future(context.read())
                if not await wait_read(read, closing, outbox, context):
                    read.cancel()
                    return   # router shutting down: the node reconnects elsewhere/later
        finally:
            closing.cancel()
            self.orders.close(stream_id)
            if unregistered:
                self._unregistered.leave(peer)
            if node_id:
                self.registry.stream_closed(node_id, stream_id)

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> Member:
        """The caller's membership credential (router.auth.membership); a stranger's stream
        is counted, logged and ended here."""
        try:
            return authenticate(peer_identity(context), context.invocation_metadata() or (),
                                join_token=self.config.security.join_token,
                                tls=bool(self.config.security.tls_cert_file))
        except MembershipError as exc:
            self.auth_counters.reject("node", exc.code, exc.message, context.peer())
            await self._unregistered.refuse(context, exc.code, exc.message)
            raise   # unreachable: refuse aborts

    async def _kv_cache(self, update: control_pb2.KvCacheUpdate, node_id: str, reg: object,
                        context: grpc.aio.ServicerContext) -> None:
        """A node's prefix-cache update into the index; a gap asks the node for a snapshot."""
        try:
            valid_kv_update(update, self.limits)
        except InvalidNodeInput as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self.locality is None or update.model not in {
                m.name for m in getattr(reg, "models", ())}:
            return   # locality off, or a model the node does not serve: nothing to index
        gap = self.locality.apply(node_id, update)
        if gap is not None:
            await context.write(control_pb2.RouterMessage(
                kv_snapshot=control_pb2.KvSnapshotRequest(model=gap)))

    async def _admit(self, member: Member, node_id: str, stream_id: int,
                     context: grpc.aio.ServicerContext) -> None:
        """Before anything of a Registration but its node id is looked at: the caller may
        hold ``node_id`` (router.auth.membership), no other live stream holds it
        (ALREADY_EXISTS), and it is not quarantined (FAILED_PRECONDITION). Refusals are
        counted, logged and end the stream; none of them records anything."""
        try:
            authorize(member, node_id)
            holder = self.registry.entry(node_id)
            if (holder is not None and holder.stream_id != stream_id
                    and self.registry.clock() - holder.last_seen <= self.registry.lease_ttl_s):
                raise MembershipError(grpc.StatusCode.ALREADY_EXISTS,
                                      f"node id {node_id[:64]!r} is held by a live stream")
        except MembershipError as exc:
            self.auth_counters.reject("node", exc.code, f"{node_id[:64]!r}: {exc.message}",
                                      context.peer())
            await context.abort(exc.code, exc.message)
        held = self.quarantine.active(node_id)
        if held is not None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {node_id[:64]!r} is quarantined for "
                f"{held.until - self.quarantine.clock():.0f}s more: {held.reason}")

    async def _reject(self, context: grpc.aio.ServicerContext, claimed_id: str, address: str,
                      registered_id: str, stream_id: int, exc: InvalidNodeInput) -> None:
        """Ends the stream with INVALID_ARGUMENT: the node (the id this stream registered, or
        the one it claims when that id is not held by another live stream) leaves the fleet
        and is quarantined with the reason."""
        node_id = registered_id or claimed_id
        entry = self.registry.entry(node_id) if node_id else None
        owned = registered_id or entry is None or entry.stream_id == stream_id
        if node_id and owned:
            if registered_id:
                self.registry.deregister(registered_id, stream_id, f"quarantined: {exc}")
            self.quarantine.add(node_id, address, str(exc))
            log.warning("node %.64r quarantined for %.0fs: %s", node_id,
                        self.quarantine.quarantine_s, exc)
        else:
            log.warning("invalid registration refused (claimed id %.64r): %s", claimed_id, exc)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rejected: {exc}")
