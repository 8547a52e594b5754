"""OpenTelemetry for gpumesh: the ONE place that builds tracer and meter providers.

Configuration comes only from the standard OpenTelemetry environment variables:

- ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), e.g.
  ``http://jaeger:4317``: OTLP/gRPC export of spans (and of metrics, unless
  ``OTEL_METRICS_EXPORTER=none``). Unset -> tracing is OFF: no provider is installed, the
  ``Telemetry.tracing`` flag is False and request paths skip every tracing call.
- ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` override the defaults below.
- ``OTEL_TRACES_SAMPLER`` (+ ``_ARG``): the SDK's sampler; default ``parentbased_always_on``,
  so a caller's sampled ``traceparent`` is always honoured.
- ``OTEL_BSP_*`` (batch span processor), ``OTEL_METRIC_EXPORT_INTERVAL``, ``OTEL_PROPAGATORS``
  (default W3C ``tracecontext,baggage``), ``OTEL_SDK_DISABLED=true`` (everything off).

One gpumesh-specific knob: ``GPUMESH_PROMETHEUS_PORT`` starts a Prometheus scrape endpoint
(``/metrics``) on that port, backed by the same MeterProvider.

Resource attributes: ``service.name`` (``gpumesh-router`` / ``gpumesh-node``),
``service.instance.id`` (the router id / node id), ``host.name``, ``gpumesh.gpu.model`` and
``gpumesh.engine`` when known. The environment variables win over these defaults.

Propagation: W3C trace context rides gRPC metadata (``traceparent``/``tracestate`` keys).
Servers call :func:`extract` on ``context.invocation_metadata()``; clients call
:func:`inject` to add the current span's context to outbound metadata.

Who calls it: ``node.app`` and ``router.app`` call :func:`init` once per process (after any
fork) and :meth:`Telemetry.shutdown` on exit; ``node.telemetry`` and ``router.telemetry``
build spans on the returned object; ``gpumesh.cli`` calls :func:`client_trace_metadata`.
Providers are NOT installed globally: each process owns its ``Telemetry`` object.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import get_global_textmap

log = logging.getLogger(__name__)

ROUTER_SERVICE = "gpumesh-router"
NODE_SERVICE = "gpumesh-node"
CLIENT_SERVICE = "gpumesh-client"
PROMETHEUS_PORT_ENV = "GPUMESH_PROMETHEUS_PORT"

# Seconds. TTFT spans ~ms (idle GPU) to minutes (deep queue); latency a bit further.
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def _env_off(environ: Mapping[str, str], key: str) -> bool:
    return environ.get(key, "").strip().lower() == "none"


def tracing_configured(environ: Mapping[str, str] | None = None) -> bool:
    """True when the environment asks for span export (an OTLP endpoint is set)."""
    return _otlp_configured(os.environ if environ is None else environ, "TRACES")


def _otlp_configured(env: Mapping[str, str], signal: str) -> bool:
    """Whether ``signal`` (TRACES, METRICS) is exported over OTLP: an endpoint set for it or
    for all, the SDK not disabled and its exporter not "none"."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if _env_off(env, f"OTEL_{signal}_EXPORTER"):
        return False
    return bool(env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT") or
                env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


# --- propagation ------------------------------------------------------------------------

class _MetadataGetter:
    """Reads a text map from gRPC invocation metadata (a sequence of (key, value) pairs)."""

    def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
        v = carrier.get(key)
        return [v] if isinstance(v, str) else None

    def keys(self, carrier: Mapping[str, Any]) -> list[str]:
        return list(carrier)


_GETTER = _MetadataGetter()


def extract(metadata: Iterable[tuple[str, Any]] | None) -> otel_context.Context | None:
    """The caller's context from gRPC metadata, or None when it sent no ``traceparent``.

    Cheap when there is nothing to extract (one dict build and a key lookup).
    """
    if not metadata:
        return None
    carrier = {k: v for k, v in metadata}
    if "traceparent" not in carrier:
        return None
    return get_global_textmap().extract(carrier, getter=_GETTER)


def inject(metadata: list[tuple[str, str]],
           ctx: otel_context.Context | None = None) -> list[tuple[str, str]]:
    """Appends W3C trace context of ``ctx`` (default: the current context) to ``metadata``
    (a list of gRPC (key, value) pairs) and returns it. No-op when there is no valid span."""
    carrier: dict[str, str] = {}
    get_global_textmap().inject(carrier, context=ctx)
    metadata.extend(carrier.items())
    return metadata


def span_trace_id(span: trace.Span) -> str:
    """Hex trace id of a sampled span ("" when not sampled: it would not be in the backend)."""
    sc = span.get_span_context()
    if not sc.is_valid or not sc.trace_flags.sampled:
        return ""
    return trace.format_trace_id(sc.trace_id)


# --- metrics ----------------------------------------------------------------------------

Gauges = Callable[[], Iterable[tuple[float, Mapping[str, str]]]]


class Metrics:
    """gpumesh's instruments. Every method is a no-op (one attribute check) when disabled.

    Attribute keys are short so Prometheus labels read well: ``model``, ``node``, ``status``
    (gRPC status code name, "OK" on success).
    """

    def __init__(self, meter: Any | None) -> None:
        self.enabled = meter is not None
        self._meter = meter
        if meter is None:
            return
        self._requests = meter.create_counter(
            "gpumesh.requests", unit="{request}",
            description="Generate/GenerateStream requests finished, by model, node and status")
        self._ttft = meter.create_histogram(
            "gpumesh.request.time_to_first_token", unit="s",
            description="Admission to the first output token",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS_S)
        self._latency = meter.create_histogram(
            "gpumesh.request.duration", unit="s", description="Whole request, server side",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S)
        self._lease_expiries = meter.create_counter(
            "gpumesh.router.lease_expiries", unit="{lease}",
            description="Node leases the router expired (no heartbeat within the TTL)")
        self._stale = meter.create_counter(
            "gpumesh.router.stale_transitions", unit="{transition}",
            description="Nodes whose load report went stale (older than the freshness window)")
        self._reconnects = meter.create_counter(
            "gpumesh.heartbeat.reconnects", unit="{reconnect}",
            description="Heartbeat streams re-opened (node side) or re-registered (router side)")

    def request_done(self, model: str, node: str, status: str, duration_s: float,
                     ttft_s: float | None = None) -> None:
        if not self.enabled:
            return
        attrs = {"model": model, "node": node, "status": status}
        self._requests.add(1, attrs)
        self._latency.record(duration_s, attrs)
        if ttft_s is not None:
            self._ttft.record(ttft_s, {"model": model, "node": node})

    def lease_expired(self, node: str) -> None:
        if self.enabled:
            self._lease_expiries.add(1, {"node": node})

    def node_stale(self, node: str) -> None:
        if self.enabled:
            self._stale.add(1, {"node": node})

    def reconnected(self, node: str, peer: str = "") -> None:
        if self.enabled:
            self._reconnects.add(1, {"node": node, "peer": peer})

    def histogram(self, name: str, unit: str = "", description: str = "",
                  buckets: Sequence[float] | None = None
                  ) -> Callable[[float, Mapping[str, str]], None]:
        """Creates a histogram; returns its ``record(value, attributes)`` (a no-op when
        disabled)."""
        if not self.enabled:
            return lambda _v, _a: None
        h = self._meter.create_histogram(name, unit=unit, description=description,
                                         explicit_bucket_boundaries_advisory=buckets)
        return lambda v, a: h.record(v, dict(a))

    def gauge(self, name: str, callback: Gauges, unit: str = "", description: str = "") -> None:
        """Registers an observable gauge. ``callback()`` returns (value, attributes) pairs; it
        runs on the exporter's thread at each collection, so it must only read plain state."""
        if not self.enabled:
            return
        self._meter.create_observable_gauge(name, callbacks=[_observe(name, callback)],
                                            unit=unit, description=description)

    def counter_from(self, name: str, callback: Gauges, unit: str = "",
                     description: str = "") -> None:
        """Registers an observable (cumulative) counter read from ``callback()``."""
        if not self.enabled:
            return
        self._meter.create_observable_counter(name, callbacks=[_observe(name, callback)],
                                              unit=unit, description=description)


def _observe(name: str, callback: Gauges) -> Callable[[Any], list[Any]]:
    """An observable instrument's callback over ``callback()``'s (value, attributes) pairs."""
    from opentelemetry.metrics import Observation

    def observations(_options: Any) -> list[Observation]:
        try:
            return [Observation(v, dict(a)) for v, a in callback()]
        except Exception:
            # A broken instrument must not break the whole export.
            log.debug("instrument %s callback failed", name, exc_info=True)
            return []
    return observations


# --- the per-process handle -------------------------------------------------------------

@dataclass
class Telemetry:
    """One process's telemetry. ``tracing`` is the cheap flag hot paths check first."""

    service_name: str = ""
    instance_id: str = ""
    tracing: bool = False
    tracer: trace.Tracer = field(default_factory=lambda: trace.NoOpTracer())
    metrics: Metrics = field(default_factory=lambda: Metrics(None))
    _shutdowns: list[Callable[[], None]] = field(default_factory=list)

    @classmethod
    def disabled(cls) -> Telemetry:
        return cls()

    def shutdown(self, timeout_s: float = 3.0) -> None:
        """Flushes and stops exporters (blocking: call via ``asyncio.to_thread``). Idempotent."""
        fns, self._shutdowns = self._shutdowns, []
        for fn in fns:
            try:
                fn()
            except Exception:  # shutdown is best effort
                log.debug("telemetry shutdown step failed", exc_info=True)
        self.tracing = False


def _resource(service_name: str, instance_id: str, extra: Mapping[str, str]) -> Any:
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    ours: dict[str, Any] = {"service.name": service_name, "service.instance.id": instance_id,
                            "host.name": socket.gethostname()}
    ours.update({k: v for k, v in extra.items() if v})
    # Resource.create reads the env too, but lets our attributes win; the env must win.
    return Resource.create(ours).merge(OTELResourceDetector().detect())


def init(service_name: str, instance_id: str, *, gpu_model: str = "",
         attributes: Mapping[str, str] | None = None,
         environ: Mapping[str, str] | None = None) -> Telemetry:
    """Builds this process's providers from the OTEL_* environment.

    Returns a disabled ``Telemetry`` (no SDK objects at all) when neither an OTLP endpoint
    nor ``GPUMESH_PROMETHEUS_PORT`` is set.
    """
    env = os.environ if environ is None else environ
    want_traces = tracing_configured(env)
    want_otlp_metrics = _otlp_configured(env, "METRICS")
    prom_port = env.get(PROMETHEUS_PORT_ENV, "").strip()
    if not (want_traces or want_otlp_metrics or prom_port):
        return Telemetry.disabled()

    extra = {"gpumesh.gpu.model": gpu_model, **(attributes or {})}
    resource = _resource(service_name, instance_id, extra)
    tel = Telemetry(service_name=service_name, instance_id=instance_id)

    if want_traces:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter,
        )
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # TracerProvider() reads OTEL_TRACES_SAMPLER(_ARG); the processor OTEL_BSP_*; the
        # exporter OTEL_EXPORTER_OTLP_* (endpoint, headers, insecure, timeout).
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        tel.tracer = provider.get_tracer("gpumesh")
        tel.tracing = True

        def _stop_traces() -> None:
            provider.force_flush(3000)
            provider.shutdown()

        tel._shutdowns.append(_stop_traces)

    readers: list[Any] = []
    if want_otlp_metrics:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter,
        )
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if prom_port:
        reader = _prometheus_reader(int(prom_port))
        if reader is not None:
            readers.append(reader)
    if readers:
        from opentelemetry.sdk.metrics import MeterProvider

        meter_provider = MeterProvider(metric_readers=readers, resource=resource)
        tel.metrics = Metrics(meter_provider.get_meter("gpumesh"))
        tel._shutdowns.append(lambda: meter_provider.shutdown(timeout_millis=3000))
    log.info("telemetry on: service=%s instance=%s traces=%s otlp_metrics=%s prometheus=%s",
             resource.attributes.get("service.name"), instance_id, want_traces,
             want_otlp_metrics, prom_port or "off")
    return tel


def _prometheus_reader(port: int) -> Any | None:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import start_http_server

    try:
        start_http_server(port)
    except OSError as exc:  # e.g. a second router worker on the same port
        log.warning("Prometheus endpoint on port %d not started: %s", port, exc)
        return None
    return PrometheusMetricReader()


# --- client side ------------------------------------------------------------------------

def _random_traceparent() -> tuple[str, str]:
    trace_id = secrets.token_hex(16)
    span_id = secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id


def client_trace_metadata(enabled: bool) -> tuple[tuple[tuple[str, str], ...], str]:
    """For one-shot clients (``gpumesh generate --trace``): metadata starting a sampled trace,
    and its trace id in hex. ``((), "")`` when ``enabled`` is False.

    When the client's environment configures an OTLP endpoint, a real root span
    ``gpumesh.client.generate`` is started and ended at interpreter exit (the CLI exits right
    after its request), so the trace has a client root in Jaeger. Otherwise the context is a
    fresh random trace id with a sampled flag: the router's span becomes the visible root.
    """
    if not enabled:
        return (), ""
    if tracing_configured():
        tel = init(CLIENT_SERVICE, f"{socket.gethostname()}-{os.getpid()}")
        span = tel.tracer.start_span("gpumesh.client.generate", kind=trace.SpanKind.CLIENT,
                                     attributes={"rpc.system": "grpc",
                                                 "rpc.service": "gpumesh.v1.Inference"})
        md = inject([], trace.set_span_in_context(span))

        def _finish() -> None:
            span.end()
            tel.shutdown()

        atexit.register(_finish)
        return tuple(md), trace.format_trace_id(span.get_span_context().trace_id)
    traceparent, trace_id = _random_traceparent()
    return (("traceparent", traceparent),), trace_id


def status_name(code: Any) -> str:
    """'OK', 'NOT_FOUND', ... from a grpc.StatusCode (or anything with a ``name``)."""
    return getattr(code, "name", None) or str(code)


def grpc_code_value(code: Any) -> int:
    """The numeric gRPC status code (grpc.StatusCode.value is (int, str))."""
    value = getattr(code, "value", code)
    return int(value[0] if isinstance(value, tuple) else value)


def set_error(span: trace.Span, code: Any, message: str) -> None:
    """Marks ``span`` failed with gRPC status ``code`` (OTel rpc semconv attributes)."""
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("rpc.grpc.status_code", grpc_code_value(code))
    span.set_attribute("error.type", status_name(code))
    span.set_status(Status(StatusCode.ERROR, f"{status_name(code)}: {message}"))
