"""What every routed call does on the way in and out: parse the request, time it, have the
dispatcher prepare its context (``Dispatcher.prepare``: model, prompt size, prefix locality,
where the router's tokenizer for the model counts the prompt exactly); put the dispatch record
into the trailing metadata or the error status.

A request's deadline is the client's remaining gRPC deadline, or ``request_timeout_s`` when it
set none. Trailing metadata carries ``NODE_ID`` and ``ATTEMPTS`` (gpumesh.metadata), plus the
trace id when tracing.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from gpumesh import metadata as md
from gpumesh.router import errors
from gpumesh.router.config import RouterConfig
from gpumesh.router.dispatch import Dispatcher, DispatchRecord, RequestContext
from gpumesh.router.dispatch.context import estimate_prompt_tokens
from gpumesh.router.telemetry import NOOP, Trace
from gpumesh.v1 import inference_pb2

__all__ = ["abort", "deadline", "estimate_prompt_tokens", "parse_request", "prepare",
           "trailing"]


def parse_request(raw: bytes) -> inference_pb2.GenerateRequest:
    try:
        return inference_pb2.GenerateRequest.FromString(raw)
    except Exception:  # noqa: BLE001 - any decode failure is the client's
        raise errors.RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                                 "GenerateRequest could not be parsed") from None


def deadline(context: grpc.aio.ServicerContext, config: RouterConfig,
             clock: Callable[[], float]) -> float:
    """The request's deadline on ``clock``: the client's remaining gRPC deadline, or
    ``request_timeout_s`` when it set none."""
    remaining = context.time_remaining()
    return clock() + (config.dispatch.request_timeout_s if remaining is None else remaining)


async def prepare(raw: bytes, req: inference_pb2.GenerateRequest, config: RouterConfig,
                  dispatcher: Dispatcher, context: grpc.aio.ServicerContext,
                  clock: Callable[[], float], trace: Trace) -> RequestContext:
    """The request's context, built once (``Dispatcher.prepare``), and its trace told what
    was routed. Raises RouterError for a model the fleet does not serve or a bad field."""
    ctx = await dispatcher.prepare(req, raw, deadline(context, config, clock),
                                   trace.on_attempt)
    trace.routed(req, ctx.info.model, ctx.info.prompt_tokens)
    return ctx


def trailing(record: DispatchRecord, trace: Trace = NOOP) -> tuple[tuple[str, str], ...]:
    prefill = ((md.PREFILL_NODE_ID, record.prefill_node_id),) if record.prefill_node_id else ()
    return ((md.NODE_ID, record.node_id), (md.ATTEMPTS, str(len(record.attempts))),
            (md.MIGRATIONS, str(record.migrations)), *prefill, *trace.trailing())


async def abort(context: grpc.aio.ServicerContext, exc: BaseException,
                record: DispatchRecord, trace: Trace = NOOP) -> None:
    """Ends the call with ``exc``'s status (errors.status_for) and the record's metadata."""
    code, details = errors.status_for(exc)
    meta = trailing(record, trace)
    retry_after = getattr(exc, "retry_after_s", 0.0)
    if retry_after > 0:   # honoured by gRPC retry policies (gpumesh.client's included)
        ms = str(int(retry_after * 1000))
        meta = (*meta, ("grpc-retry-pushback-ms", ms), (md.RETRY_AFTER_MS, ms))
    await context.abort(code, details, trailing_metadata=meta)
