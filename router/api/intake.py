"""What every routed call does on the way in and out: parse, size and time the request; put
the dispatch record into the trailing metadata or the error status.

A request's deadline is the client's remaining gRPC deadline, or ``request_timeout_s`` when it
set none. Trailing metadata carries ``NODE_ID`` and ``ATTEMPTS`` (gpumesh.metadata), plus the
trace id when tracing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import grpc

from gpumesh import metadata as md
from gpumesh.router import errors
from gpumesh.router.config import RouterConfig
from gpumesh.router.dispatch import DispatchRecord
from gpumesh.router.fleet import Registry
from gpumesh.router.fleet.locality import PrefixLocality
from gpumesh.router.scheduling import RequestInfo
from gpumesh.router.telemetry import NOOP, Trace
from gpumesh.v1 import inference_pb2


def estimate_prompt_tokens(req: inference_pb2.GenerateRequest, chars_per_token: float) -> int:
    """Prompt size for routing: exact for token ids, UTF-8 bytes / chars_per_token for text,
    plus a few tokens per chat message for the template. (The router has no tokenizer; the
    node counts what the router charged via CHARGED_TOKENS, so both sides agree.)"""
    kind = req.WhichOneof("prompt")
    if kind == "token_ids":
        return len(req.token_ids.ids)
    if kind == "text":
        return math.ceil(len(req.text.encode()) / chars_per_token)
    if kind == "chat":
        return sum(math.ceil(len(m.content.encode()) / chars_per_token) + 4
                   for m in req.chat.messages)
    return 0


def parse_request(raw: bytes) -> inference_pb2.GenerateRequest:
    try:
        return inference_pb2.GenerateRequest.FromString(raw)
    except Exception:  # noqa: BLE001 - any decode failure is the client's
        raise errors.RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                                 "GenerateRequest could not be parsed") from None


def request_info(req: inference_pb2.GenerateRequest, config: RouterConfig, registry: Registry,
                 context: grpc.aio.ServicerContext, clock: Callable[[], float]
                 ) -> tuple[RequestInfo, float]:
    """The request as routing sees it (model resolved, prompt sized) and its deadline on
    ``clock``. Raises RouterError for a model the fleet does not serve."""
    model = registry.resolve(req.model)
    check_routing_fields(req, registry, model)
    info = RequestInfo(model, estimate_prompt_tokens(req, config.chars_per_token),
                       req.routing_key, adapter=req.adapter,
                       output_tokens=max(req.sampling.max_tokens, 0))
    remaining = context.time_remaining()
    return info, clock() + (config.request_timeout_s if remaining is None else remaining)


MAX_ROUTING_KEY_BYTES = 256   # a session id, not a payload: longer keys are refused
MAX_ADAPTER_NAME = 128


def check_routing_fields(req: inference_pb2.GenerateRequest, registry: Registry,
                         model: str) -> None:
    """``routing_key`` at most MAX_ROUTING_KEY_BYTES (INVALID_ARGUMENT); ``adapter`` listed by
    some node of ``model`` (NOT_FOUND, naming the ones served; the registration's list is
    fixed, so no node of the fleet as it stands can ever serve it)."""
    if len(req.routing_key.encode()) > MAX_ROUTING_KEY_BYTES:
        raise errors.RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"routing_key longer than {MAX_ROUTING_KEY_BYTES} bytes")
    if not req.adapter:
        return
    if len(req.adapter) > MAX_ADAPTER_NAME:
        raise errors.RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"adapter name longer than {MAX_ADAPTER_NAME} characters")
    snap = registry.snapshot(model)
    served = snap.spec.adapters if snap is not None else ()
    if req.adapter not in served:
        listed = ", ".join(served[:20]) or "none"
        raise errors.RouterError(grpc.StatusCode.NOT_FOUND,
                                 f"adapter {req.adapter!r} is not served for model {model!r}; "
                                 f"served: {listed}")


async def with_prefix(req: inference_pb2.GenerateRequest, info: RequestInfo,
                      locality: PrefixLocality | None) -> RequestInfo:
    """``info`` for prefix locality: the prompt's exact token count and block hashes
    (tokenized off the event loop when long), and the tokens each node holds of it
    (``cached_tokens``); unchanged without locality or a tokenizer for the model."""
    if locality is None or not locality.enabled:
        return info
    n, hashes = await locality.hashes(req, info.model)
    if not n:
        return info
    return locality.annotate(replace(info, prompt_tokens=n, prefix_hashes=hashes))


def trailing(record: DispatchRecord, trace: Trace = NOOP) -> tuple[tuple[str, str], ...]:
    return ((md.NODE_ID, record.node_id), (md.ATTEMPTS, str(len(record.attempts))),
            (md.MIGRATIONS, str(record.migrations)), *trace.trailing())


async def abort(context: grpc.aio.ServicerContext, exc: BaseException,
                record: DispatchRecord, trace: Trace = NOOP) -> None:
    """Ends the call with ``exc``'s status (errors.status_for) and the record's metadata."""
    code, details = errors.status_for(exc)
    meta = trailing(record, trace)
    retry_after = getattr(exc, "retry_after_s", 0.0)
    if retry_after > 0:   # honoured by gRPC retry policies (gpumesh.client's included)
        meta = (*meta, ("grpc-retry-pushback-ms", str(int(retry_after * 1000))))
    await context.abort(code, details, trailing_metadata=meta)
