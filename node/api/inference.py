"""The node's Inference servicer: a thin adapter (proto in -> validated ``Prepared`` -> the
node's generation loop -> coalesced chunks -> proto out). The same contract the router serves.

Who calls it: grpc.aio, per request. Cancellation or deadline: grpc cancels this handler's
task, which closes the generation loop (``node.api.generation``), and the loop aborts the
request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from gpumesh import metadata as md
from gpumesh import tickets, wire
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc
from gpumesh.node.adapters import AdapterCatalog
from gpumesh.node.api.generation import PER_OUTPUT, GenerationLoop, Prepared
from gpumesh.node.api.sampling import check_sampling_ranges
from gpumesh.node.engines.base import (
    AdapterRef,
    Engine,
    EngineError,
    EngineRequest,
    Finish,
    Sampling,
)
from gpumesh.node.engines.prompts import PromptEncoder
from gpumesh.node.errors import (
    RequestError,
    from_engine_exception,
    invalid,
    not_found,
    out_of_range,
    permission_denied,
    unavailable,
)
from gpumesh.node.state import ServingState
from gpumesh.node.streaming.budget import CoalescePolicy
from gpumesh.node.telemetry import NOOP, NodeTelemetry, Trace

log = logging.getLogger(__name__)

_FINISH = {Finish.STOP: pb.FINISH_REASON_STOP, Finish.LENGTH: pb.FINISH_REASON_LENGTH,
           Finish.ABORT: pb.FINISH_REASON_ABORT}
DEFAULT_MAX_TOKENS = 16
MAX_KV_PARAMS_BYTES = 64 * 1024   # GenerateRequest.kv_transfer_params, encoded


def _kv_params(raw: str) -> dict[str, Any] | None:
    """GenerateRequest.kv_transfer_params: None when empty, else a JSON object (bounded);
    the engine checks its shape."""
    if not raw:
        return None
    if len(raw) > MAX_KV_PARAMS_BYTES:
        raise invalid(f"kv_transfer_params is over {MAX_KV_PARAMS_BYTES} bytes")
    try:
        params = json.loads(raw)
    except ValueError:
        raise invalid("kv_transfer_params is not valid JSON") from None
    if not isinstance(params, dict):
        raise invalid("kv_transfer_params must be a JSON object")
    return params


def _sampling(p: pb.SamplingParams) -> Sampling:
    max_tokens = p.max_tokens if p.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    temperature = p.temperature if p.HasField("temperature") else 1.0
    top_p = p.top_p if p.HasField("top_p") else 1.0
    if max_tokens < 1:
        raise invalid("sampling.max_tokens must be >= 1")
    check_sampling_ranges(temperature, top_p, p.stop, "sampling.")
    return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                    top_k=p.top_k, seed=p.seed if p.HasField("seed") else None,
                    stop=tuple(p.stop), ignore_eos=p.ignore_eos)


class NodeInferenceServicer(pb_grpc.InferenceServicer):
    """``gpumesh.v1.Inference`` served by one node process over its engine (the router serves
    the same service over its fleet)."""

    def __init__(self, engine: Engine, state: ServingState, default_coalescing: CoalescePolicy,
                 ticket_secret: bytes = b"", require_ticket: bool = False,
                 telemetry: NodeTelemetry | None = None,
                 prompts: PromptEncoder | None = None,
                 adapters: AdapterCatalog | None = None) -> None:
        self._engine = engine
        self._adapters = adapters or AdapterCatalog({})
        # The node's shared one (gpumesh.node.app); a servicer built alone gets its own.
        self._prompts = prompts or PromptEncoder(engine)
        self._telemetry = telemetry or NodeTelemetry.disabled()
        self._state = state
        self._loop = GenerationLoop(engine, state)
        self._default_coalescing = default_coalescing
        self._secret = ticket_secret
        self._require_ticket = require_ticket

    # --- validation ---------------------------------------------------------------------
    def _resolve_model(self, name: str) -> None:
        spec = self._engine.model
        if name and name != spec.name and name not in spec.aliases:
            served = ", ".join((spec.name, *spec.aliases))
            raise not_found(f"model {name!r} is not served here; served: {served}")

    def _resolve_adapter(self, name: str) -> AdapterRef | None:
        """The named LoRA adapter; NOT_FOUND when this node can never serve it (its adapter
        set is fixed at start: gpumesh.node.adapters)."""
        if not name:
            return None
        ref = self._adapters.get(name)
        if ref is None:
            served = ", ".join(self._adapters.names[:20]) or "none"
            raise not_found(f"adapter {name[:128]!r} is not served here; served: {served}")
        return ref

    async def _prompt_ids(self, req: pb.GenerateRequest) -> list[int]:
        kind = req.WhichOneof("prompt")
        if kind == "text":
            if not req.text:
                raise invalid("prompt text is empty")
            ids = await self._prompts.tokenize(req.text)
        elif kind == "chat":
            msgs = [(m.role, m.content) for m in req.chat.messages]
            if not msgs:
                raise invalid("chat has no messages")
            if any(not role for role, _ in msgs):
                raise invalid("every chat message needs a role")
            ids = await self._prompts.render_chat(msgs)
        elif kind == "token_ids":
            ids = list(req.token_ids.ids)
        else:
            raise invalid("request has no prompt: set text, chat or token_ids")
        if not ids:
            raise invalid("prompt is empty after tokenization")
        return ids

    def _dispatcher(self, req: pb.GenerateRequest, context: grpc.aio.ServicerContext
                    ) -> tuple[str, int | None]:
        """(router id, tokens it charged) from a lookaside ticket or the router's metadata."""
        if req.ticket:
            if not self._secret:
                raise permission_denied("this node accepts no lookaside tickets (no secret set)")
            try:
                ticket = tickets.verify(self._secret, req.ticket, self._state.node_id)
            except tickets.TicketError as exc:
                raise permission_denied(f"lookaside ticket refused: {exc}") from None
            return ticket.router_id, ticket.prompt_tokens
        meta = dict(context.invocation_metadata() or ())
        router_id = meta.get(md.ROUTER_ID, "")
        if self._require_ticket and not router_id:
            raise permission_denied("this node only serves requests routed by a gpumesh router")
        charged = meta.get(md.CHARGED_TOKENS)
        return router_id, int(charged) if charged and charged.isdigit() else None

    async def _prepare(self, req: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> Prepared:
        if self._state.draining:
            raise unavailable(f"node {self._state.node_id} is draining")
        self._resolve_model(req.model)
        adapter = self._resolve_adapter(req.adapter)
        sampling = _sampling(req.sampling)
        try:
            # Tokenizes (off the loop when long): the engine may be starting or shut down.
            # A cancelled request ends here, before anything is admitted.
            ids = await self._prompt_ids(req)
        except EngineError as exc:
            raise from_engine_exception(exc) from exc
        limit = self._engine.model.max_context_length
        if len(ids) + sampling.max_tokens > limit:
            raise out_of_range(
                f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                f"context window of {limit} tokens")
        router_id, charged = self._dispatcher(req, context)
        so = req.stream_options
        default = self._default_coalescing
        if so.per_token:
            policy = CoalescePolicy(0.0, 1)
        elif so.flush_interval_ms:
            # The client's own interval, kept as asked (no widening under load).
            policy = CoalescePolicy(so.flush_interval_ms / 1000,
                                    so.max_tokens_per_chunk or default.max_tokens)
        else:
            policy = CoalescePolicy(default.flush_interval_s,
                                    so.max_tokens_per_chunk or default.max_tokens,
                                    default.messages_per_s)
        request_id = req.request_id or uuid.uuid4().hex
        resumed = list(req.resume.ids) if req.HasField("resume") else []
        if resumed:
            # A continuation: what was delivered joins the prompt; max_tokens counted it.
            if len(resumed) >= sampling.max_tokens:
                raise invalid(f"resume holds {len(resumed)} tokens: nothing is left of "
                              f"max_tokens {sampling.max_tokens}")
            ids = ids + resumed
            sampling = dataclasses.replace(sampling,
                                           max_tokens=sampling.max_tokens - len(resumed))
        return Prepared(EngineRequest(request_id, tuple(ids), sampling, adapter,
                                      _kv_params(req.kv_transfer_params)),
                        router_id, charged, policy, len(resumed))

    def _trailing(self, context: grpc.aio.ServicerContext,
                  trace: Trace = NOOP) -> None:
        context.set_trailing_metadata(((md.NODE_ID, self._state.node_id), *trace.trailing()))

    @contextlib.asynccontextmanager
    async def _call(self, method: str, request: pb.GenerateRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[Trace]:
        """One Generate / GenerateStream call's span: a ``RequestError`` ends the call with
        its status (the span and trailing metadata told first), a cancelled one is marked."""
        trace = self._telemetry.start(method, request, context)
        try:
            yield trace
        except RequestError as err:
            trace.fail(err.code, err.message)
            self._trailing(context, trace)
            await context.abort(err.code, err.message)
        except (asyncio.CancelledError, GeneratorExit):
            trace.cancelled()
            raise
        finally:
            trace.end()

    async def GenerateStream(self, request: pb.GenerateRequest,
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[pb.GenerateStreamResponse]:
        async with self._call("GenerateStream", request, context) as trace:
            prep = await self._prepare(request, context)
            trace.prepared(prep.request, prep.router_id)
            first = True
            completion = prep.resumed   # a continuation's usage counts what was delivered
            # aclosing: a cancelled stream aborts in the engine at once, not when the
            # generator is garbage-collected.
            async with contextlib.aclosing(self._loop.run(prep, trace)) as outs:
                async for out in outs:
                    completion += len(out.token_ids)
                    msg = pb.GenerateStreamResponse(text=out.text, token_ids=out.token_ids)
                    if first:
                        msg.request_id = prep.request.request_id
                        first = False
                    if out.finish is not None:
                        if out.kv_transfer_params is not None:
                            msg.kv_transfer_params = json.dumps(out.kv_transfer_params)
                        msg.finish_reason = _FINISH[out.finish]
                        msg.usage.prompt_tokens = (len(prep.request.prompt_token_ids)
                                                   - prep.resumed)
                        msg.usage.completion_tokens = completion
                        self._trailing(context, trace)
                    yield msg

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        async with self._call("Generate", request, context) as trace:
            prep = await self._prepare(request, context)
            trace.prepared(prep.request, prep.router_id)
            texts: list[str] = []
            ids: list[int] = []
            finish = None
            kv_params = None
            # Unary: no client is waiting on chunks, so take the engine's outputs as they come.
            unary = dataclasses.replace(prep, coalescing=PER_OUTPUT)
            async with contextlib.aclosing(self._loop.run(unary, trace)) as outs:
                async for out in outs:
                    texts.append(out.text)
                    ids.extend(out.token_ids)
                    finish = out.finish
                    kv_params = out.kv_transfer_params or kv_params
            self._trailing(context, trace)
            return pb.GenerateResponse(
                text="".join(texts), token_ids=ids,
                finish_reason=_FINISH[finish] if finish else pb.FINISH_REASON_UNSPECIFIED,
                usage=pb.Usage(prompt_tokens=len(prep.request.prompt_token_ids) - prep.resumed,
                               completion_tokens=prep.resumed + len(ids)),
                request_id=prep.request.request_id,
                kv_transfer_params=json.dumps(kv_params) if kv_params is not None else "")
        raise AssertionError("unreachable")  # _call ends a refused call with context.abort

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        spec = dataclasses.replace(self._engine.model, adapters=self._adapters.names)
        return pb.ListModelsResponse(
            models=[wire.model_info_to_proto(spec, [self._state.node_id])],
            frontend_addresses=self._state.frontend_addresses)
