"""``RequestContext``: one client request as the router prepares it, once, before admission.

``prepare`` (called by ``Dispatcher.prepare``, for every Generate, GenerateStream and Pick)
resolves the model, checks the routing fields, sizes the prompt, asks prefix locality once
for the prompt's block hashes and the tokens each node holds of it, and looks the routing
key's last node up; the result is frozen. Admission, the attempt layers, tracing and the
servicer's trailing metadata all read this one object; nothing downstream rebuilds or
strips it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from gpumesh.router import errors
from gpumesh.router.dispatch import slo
from gpumesh.router.dispatch.records import AttemptHook
from gpumesh.router.fleet import Registry
from gpumesh.router.fleet.locality import PrefixLocality
from gpumesh.router.fleet.sessions import SessionTable
from gpumesh.router.scheduling import RequestInfo
from gpumesh.v1 import inference_pb2 as pb

MAX_ROUTING_KEY_BYTES = 256   # a session id, not a payload: longer keys are refused
MAX_ADAPTER_NAME = 128


@dataclass(frozen=True)
class RequestContext:
    """One request, prepared once (module doc)."""

    request: pb.GenerateRequest   # parsed once: routing and mid-stream continuations read it
    raw: bytes                    # the client's bytes, forwarded unchanged (b"" for Pick)
    # What routing reads: the resolved model, adapter, routing key and its last node, the
    # prompt's size (exact when a tokenizer counted it), its prefix block hashes and the
    # tokens each node holds of it, the output budget.
    info: RequestInfo
    deadline: float               # monotonic seconds (the client's deadline, or the default)
    key_name: str                 # the caller's API key name (router.auth; "" without keys)
    # The trace's per-attempt hook: starts the attempt's span and returns the metadata that
    # carries its context to the node; None without tracing.
    on_attempt: AttemptHook | None = None

    @property
    def model(self) -> str:
        return self.info.model


def estimate_prompt_tokens(req: pb.GenerateRequest, chars_per_token: float) -> int:
    """Prompt size without a tokenizer: exact for token ids, UTF-8 bytes / chars_per_token
    for text, plus a few tokens per chat message for the template. ``prepare`` uses the
    model's tokenizer count instead where prefix locality has one; either way the node is
    told what the router charged (CHARGED_TOKENS), so both sides agree."""
    kind = req.WhichOneof("prompt")
    if kind == "token_ids":
        return len(req.token_ids.ids)
    if kind == "text":
        return math.ceil(len(req.text.encode()) / chars_per_token)
    if kind == "chat":
        return sum(math.ceil(len(m.content.encode()) / chars_per_token) + 4
                   for m in req.chat.messages)
    return 0


def check_routing_fields(req: pb.GenerateRequest, registry: Registry, model: str) -> None:
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


async def prepare(req: pb.GenerateRequest, raw: bytes, deadline: float, key_name: str,
                  on_attempt: AttemptHook | None, *, registry: Registry,
                  chars_per_token: float, locality: PrefixLocality | None,
                  sessions: SessionTable | None,
                  model_slos: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
                  ) -> RequestContext:
    """The request's context (module doc). Raises RouterError for a model the fleet does not
    serve or a bad routing field."""
    model = registry.resolve(req.model)
    check_routing_fields(req, registry, model)
    # the request's objectives: its own, else its API key's, else its model's
    # (INVALID_ARGUMENT when out of range)
    objectives = slo.request_slo(req.ttft_slo_ms, req.tpot_slo_ms, model, *model_slos)
    counted, hashes = 0, ()
    if locality is not None and locality.enabled:
        # prefix locality, once per request: the prompt's exact token count and block hashes
        # (tokenized off the event loop when long), then what each node holds of it
        counted, hashes = await locality.hashes(req, model)
    info = RequestInfo(model, counted or estimate_prompt_tokens(req, chars_per_token),
                       req.routing_key, adapter=req.adapter,
                       session_node=(sessions.lookup(model, req.routing_key)
                                     if sessions is not None and req.routing_key else ""),
                       prefix_hashes=hashes, output_tokens=max(req.sampling.max_tokens, 0),
                       ttft_slo_s=objectives.ttft_s, tpot_slo_s=objectives.tpot_s)
    if hashes and locality is not None:
        info = locality.annotate(info)
    return RequestContext(req, raw, info, deadline, key_name, on_attempt)
