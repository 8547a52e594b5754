"""Node request spans and metrics (on top of ``gpumesh.telemetry``).

One SERVER span per Generate/GenerateStream call, named ``gpumesh.node.generate``, continuing
the caller's W3C context from gRPC metadata (the router's attempt span, or a direct client).

Attributes (GenAI semantic conventions where they exist):

- ``gen_ai.operation.name`` (``text_completion`` | ``chat``), ``gen_ai.provider.name`` (the
  engine kind: ``vllm`` | ``sim``), ``gen_ai.request.model`` (as asked),
  ``gen_ai.response.model`` (resolved), ``gen_ai.request.max_tokens``,
  ``gen_ai.request.temperature``, ``gen_ai.request.top_p``, ``gen_ai.request.top_k``,
  ``gen_ai.request.seed``, ``gen_ai.response.id`` (the engine request id),
  ``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``,
  ``gen_ai.response.finish_reasons`` (``["stop"]`` | ``["length"]`` | ``["abort"]``).
- ``rpc.system`` / ``rpc.service`` / ``rpc.method`` / ``rpc.grpc.status_code``.
- ``gpumesh.node.id``, ``gpumesh.router.id`` (who dispatched it; "" for direct clients).
- Engine timings, seconds: ``gpumesh.engine.ttft_s`` (engine admission -> first output
  token: queueing in the engine plus prefill; the Engine seam reports no separate queue time,
  so when an engine output carries ``queued_s`` it is recorded as ``gpumesh.engine.queued_s``
  and ``gpumesh.engine.prefill_s`` = ttft - queued), ``gpumesh.engine.decode_s`` (first token
  -> last output), ``gpumesh.validate_s`` (request receipt -> engine admission).
- Events: ``gpumesh.first_token``; ``gpumesh.request.cancelled`` (the client cancelled or its
  deadline passed; attribute ``reason``); ``gpumesh.engine.abort`` (the node asked the engine
  to drop the request); ``gpumesh.engine.aborted`` (the engine finished it with ABORT).
- Errors: span status ERROR, description ``CODE: message``, ``error.type`` = the code name.
  A client cancel is not an error: status stays unset, ``rpc.grpc.status_code`` = 1.

Metrics: ``gpumesh.requests`` / ``gpumesh.request.duration`` / ``gpumesh.request.time_to_first_token``
with ``model``, ``node``, ``status``; gauges for the node's own load (see ``register_gauges``).

Who calls it: ``gpumesh.node.api.inference.NodeInferenceServicer`` (start / prepared /
admitted / output / fail / cancelled / end, in that order) and ``gpumesh.node.app``
(``NodeTelemetry`` + ``register_gauges``).
With telemetry off, ``start`` returns a shared no-op whose methods do nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpc
from opentelemetry import trace

from gpumesh import telemetry as gt
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.node.engines.base import EngineOutput, EngineRequest, Finish

SPAN_NAME = "gpumesh.node.generate"


class _NoopTrace:
    """Telemetry off: every hook is a no-op."""

    __slots__ = ()
    trace_id = ""

    def prepared(self, request: EngineRequest, router_id: str) -> None: ...

    def admitted(self) -> None: ...

    def output(self, out: EngineOutput) -> None: ...

    def engine_abort(self) -> None: ...

    def fail(self, code: grpc.StatusCode, message: str) -> None: ...

    def cancelled(self) -> None: ...

    def end(self) -> None: ...

    def trailing(self) -> tuple[tuple[str, str], ...]:
        return ()


NOOP = _NoopTrace()


class RequestTrace:
    """Span + timings of one node request. Not thread-safe (one per handler task)."""

    __slots__ = (
        "_abort_noted",
        "_context",
        "_ended",
        "_finish",
        "_input_tokens",
        "_model",
        "_output_tokens",
        "_queued_s",
        "_span",
        "_status",
        "_t0",
        "_t_admit",
        "_t_first",
        "_t_last",
        "_tel",
        "trace_id",
    )

    def __init__(self, tel: NodeTelemetry, span: trace.Span | None,
                 context: grpc.aio.ServicerContext, model: str) -> None:
        self._tel = tel
        self._span = span
        self._context = context
        self._t0 = time.perf_counter()
        self._t_admit: float | None = None
        self._t_first: float | None = None
        self._t_last: float | None = None
        self._model = model
        self._input_tokens = 0
        self._output_tokens = 0
        self._finish: Finish | None = None
        self._status = "OK"
        self._queued_s: float | None = None
        self._ended = False
        self._abort_noted = False
        self.trace_id = gt.span_trace_id(span) if span is not None else ""

    # --- hooks, in request order ---------------------------------------------------------
    def prepared(self, request: EngineRequest, router_id: str) -> None:
        self._input_tokens = len(request.prompt_token_ids)
        span = self._span
        if span is None or not span.is_recording():
            return
        s = request.sampling
        attrs: dict[str, Any] = {
            "gen_ai.response.id": request.request_id,
            "gen_ai.request.max_tokens": s.max_tokens,
            "gen_ai.request.temperature": s.temperature,
            "gen_ai.request.top_p": s.top_p,
            "gen_ai.usage.input_tokens": self._input_tokens,
            "gpumesh.router.id": router_id,
        }
        if s.top_k:
            attrs["gen_ai.request.top_k"] = s.top_k
        if s.seed is not None:
            attrs["gen_ai.request.seed"] = s.seed
        span.set_attributes(attrs)

    def admitted(self) -> None:
        self._t_admit = time.perf_counter()

    def output(self, out: EngineOutput) -> None:
        now = time.perf_counter()
        if out.token_ids:
            self._output_tokens += len(out.token_ids)
            if self._t_first is None:
                self._t_first = now
                if self._span is not None:
                    self._span.add_event("gpumesh.first_token")
        self._t_last = now
        queued = getattr(out, "queued_s", None)
        if queued is not None:
            self._queued_s = float(queued)
        if out.finish is not None:
            self._finish = out.finish
            if out.finish is Finish.ABORT and self._span is not None:
                self._span.add_event("gpumesh.engine.aborted")

    def engine_abort(self) -> None:
        """The node drops an unfinished request from the engine. Idempotent: ``end`` notes it
        too, because a cancelled stream handler may end its span before the generation loop's
        ``finally`` (which does the abort) has run."""
        if self._span is not None and not self._abort_noted:
            self._abort_noted = True
            self._span.add_event("gpumesh.engine.abort")

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        self._status = gt.status_name(code)
        if self._span is not None:
            gt.set_error(self._span, code, message)

    def cancelled(self) -> None:
        """The handler was cancelled: the client went away or its deadline passed."""
        remaining = None
        with contextlib.suppress(Exception):   # best effort: the call may be gone
            remaining = self._context.time_remaining()
        deadline = remaining is not None and remaining <= 0.001
        code = grpc.StatusCode.DEADLINE_EXCEEDED if deadline else grpc.StatusCode.CANCELLED
        self._status = code.name
        span = self._span
        if span is not None:
            span.add_event("gpumesh.request.cancelled",
                           {"reason": "deadline" if deadline else "client"})
            if deadline:
                gt.set_error(span, code, "deadline exceeded")
            else:
                span.set_attribute("rpc.grpc.status_code", gt.grpc_code_value(code))

    def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        t_end = time.perf_counter()
        ttft = (self._t_first - self._t_admit
                if self._t_first is not None and self._t_admit is not None else None)
        span = self._span
        if self._t_admit is not None and self._finish is None:
            self.engine_abort()   # admitted, never finished: the engine is told to drop it
        if span is not None and span.is_recording():
            attrs: dict[str, Any] = {"gen_ai.usage.output_tokens": self._output_tokens}
            if self._finish is not None:
                attrs["gen_ai.response.finish_reasons"] = [self._finish.value]
            if self._status == "OK":
                attrs["rpc.grpc.status_code"] = 0
            if self._t_admit is not None:
                attrs["gpumesh.validate_s"] = self._t_admit - self._t0
            if ttft is not None:
                attrs["gpumesh.engine.ttft_s"] = ttft
                if self._queued_s is not None:
                    attrs["gpumesh.engine.queued_s"] = self._queued_s
                    attrs["gpumesh.engine.prefill_s"] = max(0.0, ttft - self._queued_s)
            if self._t_first is not None and self._t_last is not None:
                attrs["gpumesh.engine.decode_s"] = self._t_last - self._t_first
            span.set_attributes(attrs)
        if span is not None:
            span.end()
        self._tel.metrics.request_done(self._model, self._tel.node_id, self._status,
                                       t_end - self._t0, ttft)

    def trailing(self) -> tuple[tuple[str, str], ...]:
        """Trailing metadata to add: the trace id when this request is traced."""
        from gpumesh import metadata as md

        return ((md.TRACE_ID, self.trace_id),) if self.trace_id else ()


Trace = RequestTrace | _NoopTrace


class NodeTelemetry:
    """Per-node span factory. ``gt.Telemetry.disabled()`` makes every request a no-op."""

    def __init__(self, tel: gt.Telemetry, node_id: str, engine_kind: str, model: str) -> None:
        self.tel = tel
        self.node_id = node_id
        self.engine_kind = engine_kind
        self.model = model
        self.metrics = tel.metrics
        self._active = tel.tracing or tel.metrics.enabled

    @classmethod
    def disabled(cls) -> NodeTelemetry:
        return cls(gt.Telemetry.disabled(), "", "", "")

    def start(self, method: str, request: pb.GenerateRequest,
              context: grpc.aio.ServicerContext) -> Trace:
        """Called first thing in a handler; ``method`` is the RPC name."""
        if not self._active:
            return NOOP
        span = None
        if self.tel.tracing:
            parent = gt.extract(context.invocation_metadata())
            chat = request.WhichOneof("prompt") == "chat"
            span = self.tel.tracer.start_span(
                SPAN_NAME, context=parent, kind=trace.SpanKind.SERVER,
                attributes={
                    "rpc.system": "grpc", "rpc.service": "gpumesh.v1.Inference",
                    "rpc.method": method,
                    "gen_ai.operation.name": "chat" if chat else "text_completion",
                    "gen_ai.provider.name": self.engine_kind,
                    "gen_ai.request.model": request.model or self.model,
                    "gen_ai.response.model": self.model,
                    "gpumesh.node.id": self.node_id,
                    "gpumesh.streaming": method == "GenerateStream",
                })
        return RequestTrace(self, span, context, self.model)

    def register_gauges(self, load: Callable[[], Mapping[str, float]],
                        reconnects: Callable[[], Iterable[tuple[str, int]]] | None = None
                        ) -> None:
        """Node-side gauges. ``load()`` returns e.g. {"num_running": 3, "num_waiting": 0,
        "kv_cache_usage": 0.4, "in_flight": 3, "pending_prefill_tokens": 0};
        ``reconnects()`` (router address, cumulative count) pairs."""
        m = self.metrics
        if not m.enabled:
            return
        node = self.node_id
        for key, unit in (("num_running", "{request}"), ("num_waiting", "{request}"),
                          ("in_flight", "{request}"), ("kv_cache_usage", "1"),
                          ("pending_prefill_tokens", "{token}")):
            m.gauge(f"gpumesh.node.{key}",
                    lambda k=key: [(float(load().get(k, 0.0)), {"node": node})], unit=unit,
                    description=f"This node's {key.replace('_', ' ')}")
        if reconnects is not None:
            m.counter_from("gpumesh.node.heartbeat_reconnects",
                           lambda: [(n, {"node": node, "peer": p}) for p, n in reconnects()],
                           unit="{reconnect}", description="Heartbeat streams re-opened")
