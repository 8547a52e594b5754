"""A real OTLP/gRPC receiver on loopback, for tests: TraceService + MetricsService servicers
built from opentelemetry-proto's generated classes. It stores what real router and node
processes export and rebuilds trace trees from it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as msvc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2_grpc as msvc_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tsvc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tsvc_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class Span:
    """One received span, flattened (ids in hex)."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status_code: int          # trace_pb2.Status.STATUS_CODE_*
    status_message: str
    resource: dict[str, Any]
    children: list[Span] = field(default_factory=list)

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", ""))

    @property
    def is_error(self) -> bool:
        return self.status_code == trace_pb2.Status.STATUS_CODE_ERROR

    def event_names(self) -> list[str]:
        return [n for n, _ in self.events]

    def walk(self) -> list[Span]:
        out = [self]
        for c in sorted(self.children, key=lambda s: s.start_ns):
            out.extend(c.walk())
        return out

    def render(self, depth: int = 0) -> str:
        lines = [(f"{'  ' * depth}{self.service}:{self.name} {self.span_id} "
                  f"status={self.status_code} events={self.event_names()}")]
        for c in sorted(self.children, key=lambda s: s.start_ns):
            lines.append(c.render(depth + 1))
        return "\n".join(lines)


class _Traces(tsvc_grpc.TraceServiceServicer):
    def __init__(self, sink: Receiver) -> None:
        self._sink = sink

    def Export(self, request: tsvc.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> tsvc.ExportTraceServiceResponse:
        self._sink._add_traces(request)
        return tsvc.ExportTraceServiceResponse()


class _Metrics(msvc_grpc.MetricsServiceServicer):
    def __init__(self, sink: Receiver) -> None:
        self._sink = sink

    def Export(self, request: msvc.ExportMetricsServiceRequest,
               context: grpc.ServicerContext) -> msvc.ExportMetricsServiceResponse:
        self._sink._add_metrics(request)
        return msvc.ExportMetricsServiceResponse()


class Receiver:
    """Thread-based gRPC server (independent of the tests' event loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: list[Span] = []
        self.metric_requests: list[msvc.ExportMetricsServiceRequest] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        tsvc_grpc.add_TraceServiceServicer_to_server(_Traces(self), self._server)
        msvc_grpc.add_MetricsServiceServicer_to_server(_Metrics(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Receiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(0)

    def _add_traces(self, req: tsvc.ExportTraceServiceRequest) -> None:
        got = []
        for rs in req.resource_spans:
            res = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(), name=s.name, kind=s.kind,
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes),
                        events=[(e.name, _attrs(e.attributes)) for e in s.events],
                        status_code=s.status.code, status_message=s.status.message,
                        resource=res))
        with self._lock:
            self.spans.extend(got)

    def _add_metrics(self, req: msvc.ExportMetricsServiceRequest) -> None:
        with self._lock:
            self.metric_requests.append(req)

    # --- queries -------------------------------------------------------------------------
    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    async def wait_for(self, trace_id: str, ready: Callable[[list[Span]], bool],
                       timeout_s: float = 15.0) -> list[Span]:
        """Polls until ``ready(spans of the trace)``; returns them (asserts on timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if ready(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"trace {trace_id} incomplete after {timeout_s}s:\n"
                                     + "\n".join(f"{s.service}:{s.name}" for s in spans))
            await asyncio.sleep(0.05)

    def metric_names(self, service: str = "") -> set[str]:
        """Names of metrics received (from ``service`` only, when given)."""
        with self._lock:
            reqs = list(self.metric_requests)
        return {m.name for r in reqs for rm in r.resource_metrics
                if not service or _attrs(rm.resource.attributes).get("service.name") == service
                for sm in rm.scope_metrics for m in sm.metrics}


def build_tree(spans: list[Span]) -> list[Span]:
    """Links spans into trees by parent id; returns the roots (spans whose parent is absent,
    e.g. a client's random remote parent)."""
    by_id = {s.span_id: s for s in spans}
    for s in spans:
        s.children = []
    roots = []
    for s in spans:
        parent = by_id.get(s.parent_id)
        if parent is None:
            roots.append(s)
        else:
            parent.children.append(s)
    return roots


def by_name(spans: list[Span], name: str) -> list[Span]:
    return [s for s in spans if s.name == name]
