"""The router's request span carries the decision's prediction and what was observed, and each
prediction the router checks lands in the ``gpumesh.router.prediction.error`` histogram
(in-memory OpenTelemetry SDK exporter and reader)."""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gpumesh import telemetry as gt
from gpumesh.router.dispatch import Assignment, AttemptRecord, DispatchRecord
from gpumesh.router.fleet import Registry
from gpumesh.router.scheduling.types import Decision
from gpumesh.router.telemetry import REQUEST_SPAN, RouterTelemetry


class Context:
    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


def setup() -> tuple[RouterTelemetry, Registry, InMemorySpanExporter, InMemoryMetricReader]:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    tel = gt.Telemetry(tracing=True, tracer=provider.get_tracer("test"),
                       metrics=gt.Metrics(meter))
    registry = Registry("rt", lease_ttl_s=5.0, freshness_s=1.0)
    return RouterTelemetry(tel, "rt", registry), registry, spans, reader


def histogram_points(reader: InMemoryMetricReader) -> dict[tuple[str, str], Any]:
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == "gpumesh.router.prediction.error":
                    for p in m.data.data_points:
                        out[(p.attributes["node"], p.attributes["kind"])] = p
    return out


def test_span_has_predicted_and_observed_times_and_errors_are_exported() -> None:
    rtel, registry, spans, reader = setup()
    d = Decision("fixture", "n1", 1, predicted_ttft_s=0.02, predicted_completion_s=0.06)
    record = DispatchRecord(model="m")
    trace = rtel.start("GenerateStream", Context(), record)   # type: ignore[arg-type]
    assert trace.on_attempt is not None
    record.attempts.append(AttemptRecord("n1", d, 0.0))
    trace.on_attempt(Assignment("n1", "h:1", d, None, 0.0))   # type: ignore[arg-type]
    time.sleep(0.01)
    trace.chunk()
    time.sleep(0.02)
    trace.finish(record)
    (span,) = [s for s in spans.get_finished_spans() if s.name == REQUEST_SPAN]
    a = span.attributes
    assert a["gpumesh.predicted_ttft_s"] == 0.02 and a["gpumesh.predicted_completion_s"] == 0.06
    assert 0.01 <= a["gpumesh.observed_ttft_s"] < a["gpumesh.observed_completion_s"]
    assert a["gpumesh.observed_completion_s"] >= 0.03

    # what the dispatcher reports reaches the histogram, per node and kind
    registry.predictions.observe("n1", d, ttft_s=0.04)
    registry.predictions.observe("n1", d, completion_s=0.06)
    points = histogram_points(reader)
    assert points[("n1", "ttft")].count == 1 and points[("n1", "ttft")].sum == 0.5
    assert points[("n1", "completion")].count == 1 and points[("n1", "completion")].sum == 0.0


def test_a_failed_request_has_no_observed_completion() -> None:
    rtel, _registry, spans, _reader = setup()
    d = Decision("fixture", "n1", 1, predicted_ttft_s=0.02)
    record = DispatchRecord(model="m")
    trace = rtel.start("GenerateStream", Context(), record)   # type: ignore[arg-type]
    record.attempts.append(AttemptRecord("n1", d, 0.0))
    assert trace.on_attempt is not None
    trace.on_attempt(Assignment("n1", "h:1", d, None, 0.0))   # type: ignore[arg-type]
    trace.chunk()
    trace.fail(RuntimeError("lost"))
    trace.finish(record)
    (span,) = [s for s in spans.get_finished_spans() if s.name == REQUEST_SPAN]
    assert "gpumesh.observed_ttft_s" in span.attributes
    assert "gpumesh.observed_completion_s" not in span.attributes
    assert "gpumesh.predicted_completion_s" not in span.attributes
