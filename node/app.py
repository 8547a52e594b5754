"""Wiring for one node process: engine + servicer + health + reflection + heartbeats.

Shutdown order (CONVENTIONS rule 5): health NOT_SERVING and draining heartbeat -> refuse new
work (UNAVAILABLE) -> wait for in-flight requests (bounded by drain_timeout_s) -> deregister ->
``server.stop(grace)`` -> engine shutdown.
"""

from __future__ import annotations

import asyncio
import dataclasses
import contextlib
import logging
import signal
import socket
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gpumesh import telemetry
from gpumesh.node.adapters import AdapterCatalog
from gpumesh.node.api.inference import NodeInferenceServicer
from gpumesh.node.api.vllm_grpc import VLLM_ENGINE_SERVICE, add_vllm_engine_service
from gpumesh.node.cache import KvPublisher
from gpumesh.node.config import NodeConfig, new_incarnation
from gpumesh.node.discovery import RouterDiscovery
from gpumesh.node.engines.base import Engine
from gpumesh.node.engines.prompts import PromptEncoder
from gpumesh.node.frontends import FrontendGroup
from gpumesh.node.heartbeat import HeartbeatClient
from gpumesh.node.report import build_load_report, merge_reports
from gpumesh.node.state import ServingState
from gpumesh.node.streaming.budget import CoalescePolicy
from gpumesh.node.telemetry import NodeTelemetry
from gpumesh.node.access import RouterOnly
from gpumesh.security.guard import GuardedServer
from gpumesh.security.tls import (
    JOIN_TOKEN_HEADER,
    TlsFiles,
    channel_credentials,
    check_bind,
    server_credentials,
)
from gpumesh.types import LoadReport, Registration
from gpumesh.v1 import inference_pb2, inference_pb2_grpc
from gpumesh.wire import load_report_to_proto, registration_to_proto

if TYPE_CHECKING:
    from gpumesh.node.engines.vllm import FrontendSlot

log = logging.getLogger(__name__)

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
# grpc.health.v1 name that answers SERVING from bind to exit, also while starting or draining
# (liveness probes); the empty name and the services answer SERVING only while ready.
LIVENESS_SERVICE = "liveness"


def build_engine(cfg: NodeConfig, frontend: FrontendSlot | None = None) -> Engine:
    """The one place that picks an engine implementation from config. ``frontend``: the
    engine of one of the node's other front-end processes (gpumesh.node.frontends)."""
    if cfg.engine.kind == "sim":
        from gpumesh.node.engines.sim import SimEngine, SimEngineConfig

        sim = dict(cfg.engine.sim)
        sim.setdefault("model_name", cfg.resolved_served_name())
        sim.setdefault("aliases", cfg.engine.aliases)
        sim.setdefault("capacity_weight", cfg.serving.weight)
        sim.setdefault("max_loras", cfg.lora.max_loras)
        if cfg.engine.max_model_len:
            sim.setdefault("max_context_length", cfg.engine.max_model_len)
        return SimEngine(SimEngineConfig(**sim))
    if cfg.engine.kind == "vllm":
        from gpumesh.node.engines.vllm import VllmEngine, VllmEngineConfig
        from gpumesh.node.gpu import GpuSampler

        eng, lora = cfg.engine, cfg.lora
        return VllmEngine(VllmEngineConfig(
            model=eng.model, served_name=cfg.resolved_served_name(), aliases=eng.aliases,
            tokenizer=eng.tokenizer or None, dtype=eng.dtype,
            max_model_len=eng.max_model_len or None,
            tensor_parallel_size=eng.tensor_parallel_size,
            gpu_memory_utilization=eng.gpu_memory_utilization, load_format=eng.load_format,
            enforce_eager=eng.enforce_eager,
            num_gpu_blocks_override=eng.num_gpu_blocks_override or None,
            stream_interval=eng.stream_interval, capacity_weight=cfg.serving.weight,
            enable_lora=bool(lora.adapters or lora.adapter_dir), max_loras=lora.max_loras,
            max_lora_rank=lora.max_lora_rank, max_cpu_loras=lora.max_cpu_loras,
            kv_events=cfg.membership.kv_events, role=cfg.serving.role,
            kv_side_channel_host=cfg.serving.advertised_host(),
            kv_side_channel_port=cfg.serving.kv_port,
            extra=dict(eng.engine_args)),
            # GPU samples: the main process's (the node's report carries them)
            gpu_sampler=GpuSampler() if frontend is None else None,
            frontends=cfg.serving.frontends if frontend is None else 1, frontend=frontend)
    raise ValueError(f"unknown engine {cfg.engine.kind!r} (expected 'vllm' or 'sim')")


class NodeServer:
    """One running node. ``start()`` binds and begins heartbeating; ``drain()`` and ``stop()``
    follow the shutdown order above. Usable in-process from tests with any Engine.

    With ``cfg.serving.frontends`` > 1 this is front end ``frontend_index`` of the node; front end 0
    (the main process) starts the others (``peers``), heartbeats for all of them and reports
    their merged load; ``failed`` is set, with ``failure``, if one of them dies."""

    def __init__(self, cfg: NodeConfig, engine: Engine, frontend_index: int = 0) -> None:
        self.cfg = cfg
        self.engine = engine
        self.peers = (FrontendGroup(cfg, self._frontend_lost)
                      if cfg.serving.frontends > 1 and frontend_index == 0 else None)
        self.failed = asyncio.Event()
        self.failure = ""
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.own_address = ""  # this front end's own host:port (several front ends only)
        self.state: ServingState | None = None
        self.heartbeats: HeartbeatClient | None = None
        self.telemetry = NodeTelemetry.disabled()
        # Both services tokenize through it: one thread for the engine's tokenizer.
        self.prompts = PromptEncoder(engine)
        self._drained = asyncio.Event()
        self.incarnation = new_incarnation()
        # LoRA adapters served by name (fixed for the process; the registration lists them)
        self.adapters = AdapterCatalog.from_config(cfg.lora.adapters, cfg.lora.adapter_dir,
                                                   cfg.lora.max_lora_rank)
        self.discovery: RouterDiscovery | None = None
        self.stopping = False   # shutting down: an UndrainOrder no longer applies

    @property
    def address(self) -> str:
        return self.cfg.serving.advertise_address or f"{self.cfg.serving.host}:{self.port}"

    # --- load report and registration (what heartbeats carry) ------------------------
    def load_report(self) -> LoadReport:
        """This node's load now: all its front ends' when it has several."""
        assert self.state is not None
        eng = self.engine.load()
        report = build_load_report(eng, self.state.ledger, self.state.draining)
        if self.peers is None:
            return report
        return merge_reports([(eng.stats_at, report), *self.peers.reports()])

    def registration(self) -> Registration:
        assert self.state is not None
        model = dataclasses.replace(self.engine.model, adapters=self.adapters.names)
        return Registration(
            node_id=self.state.node_id, address=self.address, models=(model,),
            incarnation=self.incarnation, engine=self.engine.kind,
            gpu_model=getattr(self.engine, "gpu_model", "") or "",
            max_concurrency=self.cfg.serving.max_concurrency,
            frontend_addresses=self.state.frontend_addresses, role=self.cfg.serving.role)

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        security, streaming = self.cfg.security, self.cfg.streaming
        self.tls = TlsFiles(security.tls_cert_file, security.tls_key_file, security.tls_ca_file)
        self.tls.check("node")
        check_bind("node", self.cfg.serving.host, self.tls.enabled, self.cfg.security.insecure)
        self.access = RouterOnly() if self.cfg.security.router_only else None
        self.server = grpc.aio.server(interceptors=[self.access] if self.access else [], options=[
            # several front-end processes share the port (gpumesh.node.frontends)
            ("grpc.so_reuseport", 1 if self.cfg.serving.frontends > 1 else 0),
            ("grpc.max_concurrent_streams", 4096),
            # Routers ping their node channels (keepalive) during long prefills.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ])
        self.port = self._bind(f"{self.cfg.serving.host}:{self.cfg.serving.port}")
        if self.port == 0:
            raise OSError(f"could not bind {self.cfg.serving.host}:{self.cfg.serving.port}")
        if self.cfg.serving.frontends > 1:
            # a port of this process's own too, so callers can spread calls over the front
            # ends deterministically (the shared port spreads connections by hash)
            own = self._bind(f"{self.cfg.serving.host}:0")
            host = self.address.rpartition(":")[0]
            if host.strip("[]") in ("", "0.0.0.0", "::"):
                host = socket.gethostname()
            self.own_address = f"{host}:{own}"
        self.state = ServingState(self.cfg.serving.resolved_node_id(self.port))
        self.telemetry = self._init_telemetry()
        self._health = health.aio.HealthServicer()
        guarded = GuardedServer(self.server)   # unparseable requests: INVALID_ARGUMENT
        health_pb2_grpc.add_HealthServicer_to_server(self._health, guarded)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        inference_pb2_grpc.add_InferenceServicer_to_server(NodeInferenceServicer(
            self.engine, self.state,
            # the budget is the node's (what its routers and clients receive): each of its
            # front ends sends its share over the streams it holds
            CoalescePolicy(streaming.flush_interval_ms / 1000, streaming.max_tokens_per_chunk,
                           streaming.stream_messages_per_s / self.cfg.serving.frontends),
            security.ticket_secret.encode(), security.require_ticket, self.telemetry,
            self.prompts, adapters=self.adapters),
            guarded)
        # vLLM's native gRPC (what SMG and vLLM clients speak) on the same port and ledger.
        self.vllm_service = add_vllm_engine_service(guarded, self.engine, self.state,
                                model_path=self.cfg.engine.model,
                                require_ticket=security.require_ticket,
                                prompts=self.prompts)
        reflection.enable_server_reflection(
            (INFERENCE_SERVICE, VLLM_ENGINE_SERVICE,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        await self.server.start()
        log.info("node %s listening on %s (engine %s, model %s)", self.state.node_id,
                 self.address, self.engine.kind, self.engine.model.name)
        await self.engine.start()
        if self.peers is not None:
            await self.peers.start(self)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.discovery = RouterDiscovery(
            self.cfg.membership.routers,
            lambda addrs: self.heartbeats and self.heartbeats.set_discovered(
                addrs, self.discovery.hosts if self.discovery else None),
            self.cfg.membership.router_resolve_interval_s)
        beats = self.cfg.membership
        self.heartbeats = HeartbeatClient(
            self.discovery.static, lambda: registration_to_proto(self.registration()),
            lambda: load_report_to_proto(self.load_report()),
            beats.heartbeat_busy_interval_s, beats.heartbeat_idle_interval_s,
            beats.reconnect_max_backoff_s, on_drain=self._drain_ordered,
            on_undrain=self._undrain_ordered, on_stream_lost=self.discovery.poke,
            kv_publishers=self._kv_publishers())
        if self.tls.ca:   # mutual TLS to routers: the router binds our id to the certificate
            self.heartbeats.credentials = lambda: channel_credentials(
                self.tls.ca, self.tls.cert, self.tls.key)
        if self.cfg.security.join_token:
            self.heartbeats.metadata = ((JOIN_TOKEN_HEADER, self.cfg.security.join_token),)
        self.heartbeats.start()
        await self.discovery.start()   # dns: router targets (gpumesh.node.discovery)

    def _kv_publishers(self) -> tuple[KvPublisher, ...]:
        """The engine's prefix-cache block events for routers, where it emits them."""
        attach = getattr(self.engine, "set_kv_event_sink", None)
        if not self.cfg.membership.kv_events or attach is None:
            return ()
        pub = KvPublisher(self.engine.model.name)
        if not attach(pub):
            return ()
        if self.state is not None:
            self.state.cached_prefix_tokens = pub.cached_prefix_tokens
        if getattr(self, "vllm_service", None) is not None:   # SMG's exact mode
            self.vllm_service.attach_kv_events(pub)
        return (pub,)

    def _bind(self, address: str) -> int:
        """Adds a listening port: TLS (files re-read on change) when configured."""
        assert self.server is not None
        if not self.tls.enabled:
            return self.server.add_insecure_port(address)
        return self.server.add_secure_port(
            address, server_credentials(self.tls, self.cfg.security.tls_require_client_cert))

    def _init_telemetry(self) -> NodeTelemetry:
        """OpenTelemetry from the OTEL_* environment (off, at no cost, when unset)."""
        assert self.state is not None
        gpu_model = getattr(self.engine, "gpu_model", "") or ""
        tel = telemetry.init(telemetry.NODE_SERVICE, self.state.node_id, gpu_model=gpu_model,
                             attributes={"gpumesh.engine": self.engine.kind})
        nt = NodeTelemetry(tel, self.state.node_id, self.engine.kind, self.engine.model.name)

        def load() -> dict[str, float]:
            r = self.load_report()
            return {"num_running": r.num_running, "num_waiting": r.num_waiting,
                    "in_flight": r.in_flight, "kv_cache_usage": r.kv_cache_usage,
                    "pending_prefill_tokens": r.pending_prefill_tokens}

        def reconnects() -> list[tuple[str, int]]:
            hb = self.heartbeats
            return [("all", hb.reconnects)] if hb is not None else []

        nt.register_gauges(load, reconnects)
        return nt

    async def _set_health(self, status: int) -> None:
        for svc in ("", INFERENCE_SERVICE, VLLM_ENGINE_SERVICE):
            await self._health.set(svc, status)

    def _drain_ordered(self, reason: str) -> None:
        log.warning("drain ordered: %s", reason)
        asyncio.get_running_loop().create_task(self.drain())

    def _undrain_ordered(self, reason: str) -> None:
        if self.undrain():
            log.warning("undrain ordered: %s", reason)

    def undrain(self) -> bool:
        """Leaves an operator-ordered drain: ready again (health SERVING, heartbeats say not
        draining). False, and nothing changes, while shutting down or with several front
        ends (their drain is final)."""
        assert self.state is not None
        if not self.state.draining or self.stopping or self.peers is not None:
            return False
        self.state.draining = False
        self._drained = asyncio.Event()
        asyncio.get_running_loop().create_task(
            self._set_health(health_pb2.HealthCheckResponse.SERVING))
        if self.heartbeats is not None:
            self.heartbeats.wake()
        return True

    async def drain(self, timeout_s: float | None = None) -> None:
        """Refuse new work, report draining, wait for in-flight requests (bounded)."""
        assert self.state is not None
        if self.state.draining:
            await self._drained.wait()
            return
        self.state.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.peers is not None:
            self.peers.drain()
        if self.heartbeats is not None:
            self.heartbeats.wake()
        deadline = asyncio.get_running_loop().time() + (
            self.cfg.serving.drain_timeout_s if timeout_s is None else timeout_s)
        while self._in_flight() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if n := self._in_flight():
            log.warning("drain timeout: %d requests still in flight", n)
        self._drained.set()

    def _in_flight(self) -> int:
        """Requests the node holds: all front ends' (their latest reports) with peers."""
        assert self.state is not None
        return self.load_report().in_flight if self.peers else self.state.ledger.in_flight

    def _frontend_lost(self, reason: str) -> None:
        self.failure = reason
        self.failed.set()

    async def stop(self, grace_s: float = 1.0) -> None:
        self.stopping = True
        if self.discovery is not None:
            await self.discovery.close()
        if self.state is not None and not self.state.draining:
            await self.drain(timeout_s=0)
        if self.heartbeats is not None:
            await self.heartbeats.close()
        if self.server is not None:
            await self.server.stop(grace_s)
        self.prompts.close()
        if self.peers is not None:  # before the engine: front end 0 owns the engine core
            await self.peers.stop(self.cfg.serving.drain_timeout_s + 10.0)
        await self.engine.shutdown()
        await asyncio.to_thread(self.telemetry.tel.shutdown)

    async def wait(self) -> None:
        assert self.server is not None
        await self.server.wait_for_termination()


async def serve(cfg: NodeConfig) -> int:
    """`gpumesh node`: run until SIGTERM/SIGINT, then drain and exit (status 0); status 1
    if one of the node's front-end processes died (the others drained first)."""
    node = NodeServer(cfg, build_engine(cfg))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await node.start()
        waits = [asyncio.ensure_future(e.wait()) for e in (stop, node.failed)]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        log.info("%s: draining", node.failure or "signal received")
        node.stopping = True
        await node.drain()
    finally:
        await node.stop()
    return 1 if node.failure else 0
