"""Wiring only: builds the router from a RouterConfig and runs its gRPC server.

``RouterServer`` is the handle (tests construct it in-process with ``port=0``)::

    server = RouterServer(RouterConfig(port=0, host="127.0.0.1"))
    await server.start()            # returns the bound port; server.address is host:port
    ...
    await server.stop()

``serve(config)`` runs one until cancelled or SIGINT/SIGTERM. Shutdown order: health
NOT_SERVING (round-robin clients of gpumesh.client stop picking this router) -> refuse new
requests with UNAVAILABLE -> drain in-flight (up to the grace) -> end node streams ->
``server.stop``. gRPC's ``server.stop`` resets a call that reached the server but no handler
yet with CANCELLED; the client's retry policy retries that, like UNAVAILABLE, elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gpumesh import telemetry as otel
from gpumesh.v1 import control_pb2_grpc
from gpumesh.router.api import (
    RouterControlPlaneServicer,
    RouterInferenceServicer,
    RouterOperatorServicer,
    inference_handler,
)
from gpumesh.router.backends import NodeChannels
from gpumesh.router.backends.vllm_grpc import ForeignFleet
from gpumesh.router.config import RouterConfig
from gpumesh.router.dispatch import Dispatcher
from gpumesh.router.fleet import Registry
from gpumesh.router.fleet.saturation import SaturationPolicy, SaturationTracker
from gpumesh.router.fleet.quarantine import Quarantine
from gpumesh.router.scheduling import build_policy, default_filters
from gpumesh.router.fleet.locality import PrefixLocality
from gpumesh.router.fleet.prefix_index import PrefixIndexes
from gpumesh.router.fleet.sessions import SessionTable
from gpumesh.router.auth import AuthCounters, KeyStore, RouterAuth
from gpumesh.router.auth.metrics import register_auth_metrics
from gpumesh.router.api.intake import estimate_prompt_tokens
from gpumesh.router.telemetry import RouterTelemetry
from gpumesh.router.tokenizers import RouterTokenizers
from gpumesh.security.tls import TlsFiles, channel_credentials, check_bind, server_credentials
from gpumesh.security.guard import GuardedServer

log = logging.getLogger(__name__)

SERVICES = ("gpumesh.v1.Inference", "gpumesh.v1.ControlPlane", "gpumesh.v1.Router")
# grpc.health.v1 name that answers SERVING until the process exits, also while it finishes
# its streams on shutdown (liveness probes); "" and SERVICES turn NOT_SERVING then (readiness).
LIVENESS_SERVICE = "liveness"


class RouterServer:
    """One router process's server. ``clock`` (monotonic seconds) and ``rng`` are injectable."""

    def __init__(self, config: RouterConfig, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 rng: random.Random | None = None,
                 telemetry: RouterTelemetry | None = None) -> None:
        self.config = config
        self.clock = clock
        serving, membership, locality = config.serving, config.membership, config.locality
        security, scaling = config.security, config.scaling
        self.registry = Registry(serving.router_id, lease_ttl_s=membership.lease_ttl_s,
                                 freshness_s=membership.freshness_s,
                                 max_concurrency_default=config.dispatch.max_concurrency_default,
                                 known_model_retention_s=membership.known_model_retention_s,
                                 peer_share_half_life_s=membership.peer_share_half_life_s,
                                 step_from_report=config.membership.step_from_report,
                                 clock=clock, fleet_rebuild_s=membership.fleet_rebuild_s)
        # TLS (gpumesh.security.tls): the public port's files; nodes are dialled over mutual
        # TLS with the same certificate when it is set
        self.tls = TlsFiles(security.tls_cert_file, security.tls_key_file, security.tls_ca_file)
        self.tls.check("router")
        self.channels = NodeChannels(
            serving.keepalive_time_ms, close_grace_s=config.dispatch.request_timeout_s,
            credentials=(lambda: channel_credentials(self.tls.ca, self.tls.cert, self.tls.key))
            if self.tls.enabled else None)
        self.registry.add_removal_listener(lambda e: self.channels.forget(e.node_id))
        # The routing policy (router.scheduling; docs/routing.md): sessions, prefixes and
        # adapters are inside its prediction.
        self.profile = build_policy(config.routing)
        self.sessions = SessionTable(locality.affinity_max_keys, locality.affinity_ttl_s, clock)
        # The router's tokenizers (router.tokenizers): each loaded once, shared by prefix
        # locality and the stock vLLM gRPC workers.
        self.tokenizers = RouterTokenizers(
            dict(t.split("=", 1) for t in locality.prefix_tokenizers), engine_of=self._engine_of)
        # Prefix-cache locality: the per-model prefix index, fed by nodes' KV events
        # (control plane) or the router's own record of what it sent where.
        self.locality = PrefixLocality(
            locality.prefix_locality,
            PrefixIndexes(locality.prefix_index_max_entries, locality.prefix_approx_ttl_s,
                          locality.prefix_pending_ttl_s), clock, self.tokenizers)
        self.registry.add_removal_listener(lambda e: self.locality.node_left(e.node_id))
        if self.locality.enabled:
            # a model's prefix tokenizer loads when the model first registers, not on a request
            self.registry.add_listener(self.tokenizers.models_changed)
        self.dispatcher = Dispatcher(config, self.registry, self.channels, self.profile,
                                     default_filters(config.membership.kv_hard_threshold),
                                     rng or random.Random(), clock, sessions=self.sessions,
                                     locality=self.locality)
        # OpenTelemetry from the OTEL_* environment; off (and free) when no endpoint is set.
        self.telemetry = telemetry or RouterTelemetry(
            otel.init(otel.ROUTER_SERVICE, serving.router_id), serving.router_id,
            self.registry)
        self.telemetry.register_gauges()
        self.dispatcher.tracer = self.telemetry.tel.tracer   # disaggregated legs' spans
        # Who may call what (router.auth): API keys and quotas, operator credentials.
        self.auth_counters = AuthCounters()
        self.auth = RouterAuth(
            KeyStore(security.api_keys_file) if security.api_keys_file else None,
            operator_open=not (security.api_keys_file or security.tls_require_client_cert),
            resolve=self.registry.resolve,
            prompt_tokens=lambda r: estimate_prompt_tokens(r, config.locality.chars_per_token),
            counters=self.auth_counters)
        register_auth_metrics(self.telemetry.metrics, self.auth_counters)
        # The scaling signal (router.fleet.saturation): sampled by the sweeper, read by
        # gauges and GetFleet.
        self.saturation = SaturationTracker(SaturationPolicy(
            scaling.saturation_slo_ttft_s, scaling.saturation_target,
            scaling.saturation_default_slots, scaling.saturation_half_life_s,
            scaling.reference_prompt_tokens_per_s, config.dispatch.max_concurrency_default),
            self.registry.fleet, self.dispatcher.queue_length)
        self.telemetry.register_saturation(lambda: self.saturation.latest)
        self.inference = RouterInferenceServicer(config, self.registry, self.dispatcher, clock,
                                                 self.telemetry)
        self.quarantine = Quarantine(config.membership.quarantine_s, clock)
        self.control = RouterControlPlaneServicer(config, self.registry, self.quarantine,
                                                  locality=self.locality)
        self.operator = RouterOperatorServicer(config, self.registry, self.dispatcher, clock,
                                               wall_clock, self.telemetry, self.quarantine,
                                               self.control.orders,
                                               lambda: self.saturation.latest)
        self.control.auth_counters = self.auth_counters   # membership rejections
        self.health = health.aio.HealthServicer()
        # Stock vLLM gRPC workers listed in config: registered and reported like nodes.
        self.foreign = ForeignFleet(config.membership.foreign_nodes, self.registry, self.channels,
                                    self.tokenizers, config.membership.foreign_poll_interval_s)
        self._server: grpc.aio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._ready: asyncio.Task[None] | None = None
        self.port = 0

    def _engine_of(self, model: str) -> str:
        """The engine kind the model's nodes registered with ("" when none is known)."""
        snap = self.registry.snapshot(model)
        return snap.nodes[0].registration.engine if snap is not None and snap.nodes else ""

    @property
    def address(self) -> str:
        host = self.config.serving.host
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    async def start(self) -> int:
        server = grpc.aio.server(interceptors=[self.auth] if self.auth.active else [], options=[
            ("grpc.so_reuseport", 1),
            # Nodes and clients may keep long-lived channels with keepalive pings.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ])
        server.add_generic_rpc_handlers((inference_handler(self.inference),))
        guarded = GuardedServer(server)   # unparseable requests: INVALID_ARGUMENT
        control_pb2_grpc.add_ControlPlaneServicer_to_server(self.control, guarded)
        control_pb2_grpc.add_RouterServicer_to_server(self.operator, guarded)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, guarded)
        names = (*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        serving, security = self.config.serving, self.config.security
        check_bind("router", serving.host, self.tls.enabled, security.insecure)
        self.port = self._bind(server, serving.port, security.tls_require_client_cert)
        if self.port == 0:
            raise RuntimeError(f"could not bind {serving.host}:{serving.port}")
        # the control port (nodes): mutual TLS whenever TLS is on and a CA is configured
        if serving.control_port and not self._bind(server, serving.control_port,
                                                   bool(self.tls.ca)):
            raise RuntimeError(f"could not bind control port {serving.control_port}")
        await server.start()
        self._server = server
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        for name in ("", *SERVICES):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        self._ready = loop.create_task(self._ready_once_rebuilt())
        self._sweeper = loop.create_task(self._sweep())
        self.foreign.start()
        log.info("router %s listening on %s (policy %s)", serving.router_id, self.address,
                 self.config.routing.policy)
        return self.port

    async def _ready_once_rebuilt(self) -> None:
        """Readiness ("" and SERVICES) turns SERVING once a node has registered or the fleet
        rebuild window (``fleet_rebuild_s``: one lease by default) has passed, whichever comes
        first. A restarted router behind health-checked round_robin clients (gpumesh.client)
        or a readiness probe then gets no request before it knows a node; a router with no
        node at all is ready after the window."""
        known = asyncio.Event()
        self.registry.add_listener(lambda _models: known.set())   # on any registration
        window = self.registry.started_at + self.registry.fleet_rebuild_s - self.registry.clock()
        if not self.registry.fleet():
            try:
                await asyncio.wait_for(known.wait(), max(0.0, window))
            except TimeoutError:
                pass
        if not self.inference.closing:
            for name in ("", *SERVICES):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def _bind(self, server: grpc.aio.Server, port: int, require_client_cert: bool) -> int:
        address = f"{self.config.serving.host}:{port}"
        if not self.tls.enabled:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, server_credentials(self.tls, require_client_cert))

    async def _sweep(self) -> None:
        period = min(self.config.membership.lease_ttl_s / 4, 0.5)
        while True:
            await asyncio.sleep(period)
            expired = self.registry.expire()
            self.locality.indexes.expire(self.clock())   # approximate prefixes past their TTL
            self.telemetry.on_sweep(expired, self.dispatcher.queue_length)
            self.saturation.sample(self.clock())

    async def stop(self, grace_s: float | None = None) -> None:
        if self._server is None:
            return
        grace = self.config.serving.shutdown_grace_s if grace_s is None else grace_s
        if self._ready is not None:
            self._ready.cancel()   # never SERVING again once stopping
        for name in ("", *SERVICES):   # not ready; "liveness" stays SERVING while it drains
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.inference.closing = True
        try:
            await asyncio.wait_for(self.inference.idle.wait(), grace)
        except TimeoutError:
            log.warning("router stopping with %d requests still in flight",
                        self.inference.in_flight)
        self.control.closing.set()
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self.dispatcher.close()
        await self._server.stop(min(grace, 1.0))
        await self.foreign.stop()
        await self.channels.aclose()
        self.tokenizers.close()
        self._server = None
        await asyncio.to_thread(self.telemetry.tel.shutdown)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


async def serve(config: RouterConfig) -> None:
    """Runs a router until cancelled or SIGINT/SIGTERM, then shuts it down in order."""
    server = RouterServer(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread / platform
            pass
    try:
        # Not server.wait_for_termination(): cancelling that waiter cancels the server's
        # shutdown future, and server.stop() below then dies with CancelledError.
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.remove_signal_handler(sig)
            except (NotImplementedError, RuntimeError):
                pass
        await server.stop()


__all__ = ["RouterServer", "serve"]
