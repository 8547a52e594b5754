"""Pure parts of telemetry: env gating, propagation helpers, resource precedence, the
routing-decision attributes. No processes, no exporters."""

from __future__ import annotations

import math
from types import MappingProxyType

import pytest
from opentelemetry import trace

from gpumesh import telemetry as gt
from gpumesh.node.telemetry import NOOP as NODE_NOOP
from gpumesh.node.telemetry import NodeTelemetry
from gpumesh.router.scheduling.types import CandidateScore, Decision
from gpumesh.router.telemetry import NOOP as ROUTER_NOOP
from gpumesh.router.telemetry import RouterTelemetry, decision_attributes


@pytest.mark.parametrize("env,expected", [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_SDK_DISABLED": "true"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
])
def test_tracing_configured(env, expected):
    assert gt.tracing_configured(env) is expected


def test_no_endpoint_means_no_sdk_objects():
    tel = gt.init(gt.NODE_SERVICE, "n1", environ={})
    assert not tel.tracing and not tel.metrics.enabled
    assert isinstance(tel.tracer, trace.NoOpTracer)
    tel.metrics.request_done("m", "n", "OK", 1.0, 0.1)   # no-op, no error
    tel.shutdown()
    assert NodeTelemetry(tel, "n1", "sim", "m").start("Generate", None, None) is NODE_NOOP
    assert RouterTelemetry(tel, "r1").start("Generate", None) is ROUTER_NOOP


def test_inject_extract_round_trip():
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("t")
    span = tracer.start_span("s")
    md = gt.inject([("x-other", "1")], trace.set_span_in_context(span))
    assert md[0] == ("x-other", "1")
    assert dict(md)["traceparent"].split("-")[1] == gt.span_trace_id(span)
    ctx = gt.extract(md)
    sc = trace.get_current_span(ctx).get_span_context()
    assert sc.trace_id == span.get_span_context().trace_id and sc.is_remote
    assert gt.extract([("x-other", "1")]) is None
    assert gt.extract(None) is None
    assert gt.inject([]) == []   # no current span: nothing added


def test_client_trace_metadata(monkeypatch):
    for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    assert gt.client_trace_metadata(False) == ((), "")
    md, tid = gt.client_trace_metadata(True)
    (key, value), = md
    version, trace_id, span_id, flags = value.split("-")
    assert key == "traceparent" and version == "00" and flags == "01"
    assert trace_id == tid and len(tid) == 32 and len(span_id) == 16


def test_environment_wins_over_defaults(monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "custom")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=override,team=x")
    res = gt._resource(gt.ROUTER_SERVICE, "r1", {"gpumesh.gpu.model": "NVIDIA H200"})
    assert res.attributes["service.name"] == "custom"
    assert res.attributes["service.instance.id"] == "override"
    assert res.attributes["team"] == "x"
    assert res.attributes["gpumesh.gpu.model"] == "NVIDIA H200"
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES")
    res = gt._resource(gt.ROUTER_SERVICE, "r1", {})
    assert res.attributes["service.name"] == "gpumesh-router"
    assert res.attributes["service.instance.id"] == "r1"
    assert res.attributes["host.name"]


def _cs(node, total, wait=None):
    return CandidateScore(node, total, MappingProxyType({"expected_wait": total, "kv": 1.0}), wait)


@pytest.mark.parametrize("considered,top_n,expected_nodes", [
    ((), 3, []),
    ((_cs("a", 0.2), _cs("b", 0.9), _cs("c", 0.5)), 3, ["b", "c", "a"]),
    ((_cs("a", 0.2), _cs("b", 0.9), _cs("c", 0.5), _cs("d", 0.7)), 2, ["b", "d"]),
    ((_cs("b", 0.5), _cs("a", 0.5)), 3, ["a", "b"]),   # ties: by node id
])
def test_decision_attributes_top_n(considered, top_n, expected_nodes):
    d = Decision("predicted_latency", expected_nodes[0] if expected_nodes else "a",
                 len(considered), considered)
    attrs = decision_attributes(d, 0.25, 0.0, top_n)
    got = [attrs[f"gpumesh.routing.candidate.{i}.node_id"] for i in range(len(expected_nodes))]
    assert got == expected_nodes
    assert f"gpumesh.routing.candidate.{len(expected_nodes)}.node_id" not in attrs
    for i in range(len(expected_nodes)):
        assert attrs[f"gpumesh.routing.candidate.{i}.score.kv"] == 1.0
    assert attrs["gpumesh.routing.report_age_s"] == 0.25


def test_decision_attributes_fields():
    d = Decision("round_robin", "b", 2, (_cs("b", 1.0, wait=0.125),),
                 MappingProxyType({"z": "kv_high", "y": "draining"}), tie_size=2)
    attrs = decision_attributes(d, math.inf, 1.5)
    assert attrs["gpumesh.routing.policy"] == "round_robin"
    assert attrs["gpumesh.routing.chosen_node"] == "b"
    assert attrs["gpumesh.routing.candidates"] == 2
    assert attrs["gpumesh.routing.tie_size"] == 2
    assert attrs["gpumesh.routing.report_age_s"] == -1.0   # never reported
    assert attrs["gpumesh.routing.queue_wait_s"] == 1.5
    assert attrs["gpumesh.routing.filtered"] == ["y: draining", "z: kv_high"]
    assert attrs["gpumesh.routing.candidate.0.expected_wait_s"] == 0.125


def test_decision_attributes_name_the_sampled_fleet_size():
    sampled = Decision("predicted_latency", "a", 32, (), sampled_from=4096)
    assert decision_attributes(sampled, 0.1, 0.0)["gpumesh.routing.sampled_from"] == 4096
    assert "gpumesh.routing.sampled_from" not in decision_attributes(
        Decision("predicted_latency", "a", 3, ()), 0.1, 0.0)
