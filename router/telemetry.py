"""Router request spans and fleet metrics (on top of ``gpumesh.telemetry``).

Spans, per Generate / GenerateStream / Pick call:

``gpumesh.router.generate`` (SERVER; ``gpumesh.router.pick`` for lookaside Pick) continues the
client's W3C context. Attributes:

- ``rpc.system`` / ``rpc.service`` / ``rpc.method`` / ``rpc.grpc.status_code``,
  ``gpumesh.router.id``, ``gen_ai.request.model`` (as asked), ``gen_ai.response.model``
  (resolved), ``gen_ai.request.max_tokens``, ``gen_ai.request.temperature``,
  ``gpumesh.routing.prompt_tokens_estimate``.
- The routing decision that served the request (the last attempt's):
  ``gpumesh.routing.policy``, ``gpumesh.routing.candidates`` (count after filters),
  ``gpumesh.routing.chosen_node``, ``gpumesh.routing.tie_size``,
  ``gpumesh.routing.report_age_s`` (age of the chosen node's load report; -1 if it never
  reported), ``gpumesh.routing.queue_wait_s``, ``gpumesh.routing.filtered``
  (``["node: reason", ...]``), ``gpumesh.routing.sampled_from`` (the fleet size when the
  decision scored a random sample of it; absent otherwise), and for the top ``TOP_N``
  candidates by total score
  ``gpumesh.routing.candidate.<i>.node_id`` / ``.total`` / ``.score.<scorer>`` /
  ``.expected_wait_s`` (i = 0 is the best).
- The decision's prediction for the chosen node and what happened
  (``router.telemetry_predictions``).
- ``gpumesh.routing.attempts`` (dispatch attempts), ``gpumesh.node.id`` (the serving node),
  ``gpumesh.chunks`` (stream messages forwarded), ``gpumesh.ttft_s`` (router receipt ->
  first chunk forwarded).
- Events: ``gpumesh.first_chunk``; ``gpumesh.request.cancelled`` (client went away).
- Errors: status ERROR, ``CODE: message``, ``error.type`` = the code name.

``gpumesh.router.attempt`` (CLIENT, child of the request span), one per dispatch attempt: the
same decision attributes for that attempt, ``gpumesh.attempt`` (1-based), ``gpumesh.node.id``,
``server.address``; its context is what the node receives, so the node's
``gpumesh.node.generate`` span is its child. A failed attempt ends with status ERROR and the
node's gRPC code; a retried request therefore shows both attempts side by side.

Metrics (``register_gauges`` + ``on_sweep``): per-node gauges ``gpumesh.router.node.*``
(num_running, num_waiting, kv_cache_usage, in_flight as the node reported; router_in_flight;
state 0 healthy / 1 stale / 2 draining), ``gpumesh.router.heartbeat_age`` (s),
``gpumesh.router.queue_length`` per model; the scaling signal per model
(``register_saturation``: ``gpumesh.router.model.{saturation, slot_utilization,
kv_utilization, prefill_backlog, at_limit_fraction, nodes, nodes_wanted}``); counters ``gpumesh.router.lease_expiries``,
``gpumesh.router.stale_transitions``, ``gpumesh.heartbeat.reconnects`` (a node id registering
again with a new stream); ``gpumesh.requests`` / ``gpumesh.request.duration`` /
``gpumesh.request.time_to_first_token`` with ``model``, ``node``, ``status``; the prediction
error histogram (``router.telemetry_predictions``).

Who calls it: ``router.api`` (``RouterTelemetry.start`` per request, then the
``RouterRequestTrace`` hooks) and ``router.dispatch`` (``attempt`` via its ``on_attempt``
hook, which returns the metadata carrying the attempt's context); ``router.app`` builds it
and calls ``on_sweep`` from its lease sweeper. Telemetry off: ``start`` returns a shared no-op.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import trace

from gpumesh import metadata as md
from gpumesh import telemetry as gt
from gpumesh.router.auth.interceptor import current_key_name
from gpumesh.router.fleet.saturation import SATURATION_GAUGES
from gpumesh.router.telemetry_predictions import (
    PredictionErrorMetric,
    observed_attributes,
    predicted_attributes,
)

if TYPE_CHECKING:
    from gpumesh.router.fleet.saturation import ModelSaturation
    from gpumesh.router.dispatch import Assignment, DispatchRecord
    from gpumesh.router.fleet import Registry
    from gpumesh.router.scheduling.types import Decision

REQUEST_SPAN = "gpumesh.router.generate"
PICK_SPAN = "gpumesh.router.pick"
ATTEMPT_SPAN = "gpumesh.router.attempt"
TOP_N = 3                # candidates recorded per decision (large fleets: the best few)
MAX_FILTERED = 8         # filtered-out nodes listed per decision

_STATE_VALUE = {"healthy": 0, "stale": 1, "draining": 2}


def decision_attributes(decision: Decision, report_age_s: float, queue_wait_s: float,
                        top_n: int = TOP_N) -> dict[str, Any]:
    """Span attributes for one routing decision (pure; table-tested)."""
    attrs: dict[str, Any] = {
        "gpumesh.routing.policy": decision.policy,
        "gpumesh.routing.candidates": decision.candidates,
        "gpumesh.routing.chosen_node": decision.node_id,
        "gpumesh.routing.tie_size": decision.tie_size,
        "gpumesh.routing.report_age_s": report_age_s if math.isfinite(report_age_s) else -1.0,
        "gpumesh.routing.queue_wait_s": queue_wait_s,
    }
    if decision.sampled_from:
        attrs["gpumesh.routing.sampled_from"] = decision.sampled_from
    attrs.update(predicted_attributes(decision))
    if decision.filtered:
        attrs["gpumesh.routing.filtered"] = [
            f"{n}: {r}" for n, r in sorted(decision.filtered.items())[:MAX_FILTERED]]
    ranked = sorted(decision.considered, key=lambda s: (-s.total, s.node_id))[:top_n]
    for i, cs in enumerate(ranked):
        p = f"gpumesh.routing.candidate.{i}."
        attrs[p + "node_id"] = cs.node_id
        attrs[p + "total"] = cs.total
        for name, value in cs.scores.items():
            attrs[p + "score." + name] = value
        if cs.expected_wait_s is not None and math.isfinite(cs.expected_wait_s):
            attrs[p + "expected_wait_s"] = cs.expected_wait_s
    return attrs


class _NoopRouterTrace:
    __slots__ = ()
    on_attempt = None   # dispatch skips the hook entirely

    def routed(self, request: Any, model: str, prompt_tokens: int) -> None: ...

    def chunk(self) -> None: ...

    def fail(self, exc: BaseException) -> None: ...

    def cancelled(self) -> None: ...

    def finish(self, record: DispatchRecord) -> None: ...

    def trailing(self) -> tuple[tuple[str, str], ...]:
        return ()


NOOP = _NoopRouterTrace()


class RouterRequestTrace:
    """Span(s) + timings of one routed request. One per handler task."""

    def __init__(self, tel: RouterTelemetry, span: trace.Span | None, method: str,
                 record: DispatchRecord | None) -> None:
        self._tel = tel
        self._record = record
        self._span = span
        self._method = method
        self._t0 = time.perf_counter()
        self._t_first: float | None = None
        self._t_sent: float | None = None   # the last attempt's dispatch (its node call)
        self._attempt_span: trace.Span | None = None
        self._attempts = 0
        self._model = ""
        self._status = "OK"
        self._error: tuple[Any, str] | None = None
        self._ended = False
        self.trace_id = gt.span_trace_id(span) if span is not None else ""
        # The dispatcher calls this per attempt; None when there is no span to parent to.
        self.on_attempt: Callable[[Assignment], Sequence[tuple[str, str]]] | None = (
            self.attempt if span is not None else None)

    def routed(self, request: Any, model: str, prompt_tokens: int) -> None:
        """After parsing: ``request`` is the GenerateRequest, ``model`` the resolved name."""
        self._model = model
        span = self._span
        if span is None or not span.is_recording():
            return
        s = request.sampling
        attrs: dict[str, Any] = {"gen_ai.request.model": request.model or model,
                                 "gen_ai.response.model": model,
                                 "gpumesh.routing.prompt_tokens_estimate": prompt_tokens}
        if s.HasField("max_tokens"):
            attrs["gen_ai.request.max_tokens"] = s.max_tokens
        if s.HasField("temperature"):
            attrs["gen_ai.request.temperature"] = s.temperature
        if request.routing_key:
            attrs["gpumesh.routing.has_key"] = True
        span.set_attributes(attrs)

    # --- attempts (called by the dispatcher) ---------------------------------------------
    def _report_age(self, node_id: str) -> float:
        reg = self._tel.registry
        entry = reg.entry(node_id) if reg is not None else None
        if entry is None or entry.report is None:
            return math.inf
        return reg.clock() - entry.report.received_at

    def attempt(self, slot: Assignment) -> tuple[tuple[str, str], ...]:
        """Starts the span of a new dispatch attempt (ending the previous one as failed) and
        returns the metadata that carries its context to the node."""
        prev = self._record.attempts[-2] if self._record and len(self._record.attempts) > 1 else None
        code = getattr(grpc.StatusCode, prev.error, None) if prev is not None and prev.error else None
        self._end_attempt(True, code, "attempt failed; retried on another node")
        self._attempts += 1
        self._t_sent = time.perf_counter()
        assert self._span is not None
        attrs = decision_attributes(slot.decision, self._report_age(slot.node_id),
                                    slot.queued_s)
        attrs.update({"gpumesh.attempt": self._attempts, "gpumesh.node.id": slot.node_id,
                      "server.address": slot.address, "rpc.system": "grpc",
                      "rpc.service": "gpumesh.v1.Inference", "rpc.method": self._method})
        self._attempt_span = self._tel.tel.tracer.start_span(
            ATTEMPT_SPAN, context=trace.set_span_in_context(self._span),
            kind=trace.SpanKind.CLIENT, attributes=attrs)
        return tuple(gt.inject([], trace.set_span_in_context(self._attempt_span)))

    def _end_attempt(self, failed: bool, code: Any = None, message: str = "") -> None:
        span, self._attempt_span = self._attempt_span, None
        if span is None:
            return
        if failed:
            gt.set_error(span, code or grpc.StatusCode.UNAVAILABLE,
                         message or "attempt failed; retried on another node")
        elif code is not None:
            span.set_attribute("rpc.grpc.status_code", gt.grpc_code_value(code))
        span.end()

    # --- request outcome -----------------------------------------------------------------
    def chunk(self) -> None:
        if self._t_first is None:
            self._t_first = time.perf_counter()
            if self._span is not None:
                self._span.add_event("gpumesh.first_chunk")

    def fail(self, exc: BaseException) -> None:
        from gpumesh.router import errors

        code, message = errors.status_for(exc)
        self._status = gt.status_name(code)
        self._error = (code, message)

    def cancelled(self) -> None:
        self._status = "CANCELLED"
        if self._span is not None:
            self._span.add_event("gpumesh.request.cancelled", {"reason": "client"})

    def finish(self, record: DispatchRecord) -> None:
        """Ends the spans (last attempt and request) and records metrics. Idempotent."""
        if self._ended:
            return
        self._ended = True
        duration = time.perf_counter() - self._t0
        ttft = self._t_first - self._t0 if self._t_first is not None else None
        span = self._span
        last = record.attempts[-1] if record.attempts else None
        if span is not None:
            # Per-attempt errors the dispatcher recorded (a node status) beat our guess.
            if self._attempt_span is not None:
                code = self._error[0] if self._error else None
                if last is not None and last.error and self._status != "CANCELLED":
                    code = getattr(grpc.StatusCode, last.error, code)
                    self._end_attempt(True, code, self._error[1] if self._error else "")
                elif self._status == "CANCELLED":
                    self._attempt_span.add_event("gpumesh.request.cancelled")
                    self._end_attempt(False, grpc.StatusCode.CANCELLED)
                else:
                    self._end_attempt(False, grpc.StatusCode.OK)
            attrs: dict[str, Any] = {"gpumesh.routing.attempts": len(record.attempts),
                                     "gpumesh.chunks": record.chunks}
            if last is not None:
                attrs.update(decision_attributes(last.decision, self._report_age(last.node_id),
                                                 last.queued_s))
                attrs["gpumesh.node.id"] = last.node_id
            if ttft is not None:
                attrs["gpumesh.ttft_s"] = ttft
            attrs.update(observed_attributes(self._t_sent, self._t_first, self._t0 + duration,
                                             self._error is None and self._status == "OK"))
            if self._error is not None:
                gt.set_error(span, *self._error)
            elif self._status == "CANCELLED":
                attrs["rpc.grpc.status_code"] = gt.grpc_code_value(grpc.StatusCode.CANCELLED)
            else:
                attrs["rpc.grpc.status_code"] = 0
            span.set_attributes(attrs)
            span.end()
        if self._method != "Pick":   # lookaside: the node counts the request itself
            self._tel.metrics.request_done(self._model or record.model, record.node_id,
                                           self._status, duration, ttft)

    def trailing(self) -> tuple[tuple[str, str], ...]:
        return ((md.TRACE_ID, self.trace_id),) if self.trace_id else ()


Trace = RouterRequestTrace | _NoopRouterTrace


class RouterTelemetry:
    """Per-router span factory and fleet metrics. Disabled telemetry -> no-op traces."""

    def __init__(self, tel: gt.Telemetry, router_id: str,
                 registry: Registry | None = None) -> None:
        self.tel = tel
        self.router_id = router_id
        self.registry = registry
        self.metrics = tel.metrics
        self._active = tel.tracing or tel.metrics.enabled
        self._fleet: list[tuple[str, dict[str, float]]] = []
        self._queues: list[tuple[str, int]] = []
        self._seen: dict[str, tuple[int, str]] = {}   # node id -> (stream id, state)
        self.prediction_errors = PredictionErrorMetric(self.metrics)
        if registry is not None and self.metrics.enabled:
            self.prediction_errors.attach(registry.predictions)

    @classmethod
    def disabled(cls) -> RouterTelemetry:
        return cls(gt.Telemetry.disabled(), "")

    def start(self, method: str, context: grpc.aio.ServicerContext,
              record: DispatchRecord | None = None) -> Trace:
        """First thing in a handler; ``method`` is the RPC name, ``record`` the request's
        DispatchRecord (the dispatcher fills it; attempt spans read failed attempts' codes)."""
        if not self._active:
            return NOOP
        span = None
        if self.tel.tracing:
            span = self.tel.tracer.start_span(
                PICK_SPAN if method == "Pick" else REQUEST_SPAN,
                context=gt.extract(context.invocation_metadata()),
                kind=trace.SpanKind.SERVER,
                attributes={"rpc.system": "grpc",
                            "rpc.service": ("gpumesh.v1.Router" if method == "Pick"
                                            else "gpumesh.v1.Inference"),
                            "rpc.method": method, "gpumesh.router.id": self.router_id,
                            "gpumesh.streaming": method == "GenerateStream"})
            if key := current_key_name.get():   # the API key's name (router.auth), never the key
                span.set_attribute("gpumesh.api_key", key)
        return RouterRequestTrace(self, span, method, record)

    # --- fleet metrics -------------------------------------------------------------------
    def on_sweep(self, expired: Sequence[str], queue_length: Callable[[str], int]) -> None:
        """Called by the router's lease sweeper on the event loop (every <= 0.5 s): counts
        expiries, stale transitions and re-registrations, and caches the fleet for gauges
        (their callbacks run on the exporter's thread and only read the cache)."""
        m = self.metrics
        if not m.enabled or self.registry is None:
            return
        for node_id in expired:
            m.lease_expired(node_id)
        fleet: list[tuple[str, dict[str, float]]] = []
        seen: dict[str, tuple[int, str]] = {}
        for v in self.registry.fleet():
            node_id = v.entry.node_id
            state = v.state.value
            prev = self._seen.get(node_id)
            if prev is not None:
                if prev[0] != v.entry.stream_id:
                    m.reconnected(node_id)
                if state == "stale" and prev[1] != "stale":
                    m.node_stale(node_id)
            seen[node_id] = (v.entry.stream_id, state)
            load = v.entry.report.load if v.entry.report is not None else None
            fleet.append((node_id, {
                "num_running": load.num_running if load else 0.0,
                "num_waiting": load.num_waiting if load else 0.0,
                "kv_cache_usage": load.kv_cache_usage if load else 0.0,
                "in_flight": load.in_flight if load else 0.0,
                "router_in_flight": v.router_in_flight,
                "state": _STATE_VALUE.get(state, -1),
                "heartbeat_age": v.report_age_s if math.isfinite(v.report_age_s) else -1.0,
            }))
        self._seen = seen
        self._fleet = fleet
        self._queues = [(s.name, queue_length(s.name)) for s in self.registry.models()]

    def register_gauges(self) -> None:
        m = self.metrics
        if not m.enabled:
            return
        for key, name, unit in (
                ("num_running", "gpumesh.router.node.num_running", "{request}"),
                ("num_waiting", "gpumesh.router.node.num_waiting", "{request}"),
                ("kv_cache_usage", "gpumesh.router.node.kv_cache_usage", "1"),
                ("in_flight", "gpumesh.router.node.in_flight", "{request}"),
                ("router_in_flight", "gpumesh.router.node.router_in_flight", "{request}"),
                ("state", "gpumesh.router.node.state", "1"),
                ("heartbeat_age", "gpumesh.router.heartbeat_age", "s")):
            m.gauge(name, lambda k=key: [(vals[k], {"node": n}) for n, vals in self._fleet],
                    unit=unit, description=f"Per node, as this router sees it: {key}")
        m.gauge("gpumesh.router.queue_length",
                lambda: [(float(q), {"model": model}) for model, q in self._queues],
                unit="{request}", description="Requests waiting for a node slot, per model")

    def register_saturation(self, latest: Callable[[], Mapping[str, ModelSaturation]]) -> None:
        """The scaling signal's gauges, per model (router.fleet.saturation; ``latest()`` is the
        tracker's last sample, replaced wholesale by the sweeper, so reading it from the
        exporter's thread is safe)."""
        m = self.metrics
        if not m.enabled:
            return
        for name, unit, attr, text in SATURATION_GAUGES:
            m.gauge(name, lambda a=attr: [
                (float(getattr(s, a)) if math.isfinite(getattr(s, a)) else 1e9,
                 {"model": model}) for model, s in latest().items()],
                unit=unit, description=text)

