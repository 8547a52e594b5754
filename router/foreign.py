"""Foreign nodes: stock vLLM gRPC workers (``vllm.grpc.engine.VllmEngine``) in the fleet.

A worker started with vLLM's own launcher (``python -m vllm.entrypoints.launchers.grpc_server``)
speaks no gpumesh: no Registration, no heartbeats, no ``gpumesh.v1.Inference``. For each worker
listed in ``RouterConfig.foreign_nodes`` this module does both halves a gpumesh node does itself:

Membership (``ForeignMember``, one task per worker): GetModelInfo -> ``Registry.register``
(kind "vllm-grpc", a fresh incarnation per connection), then load reports into
``Registry.heartbeat`` exactly as heartbeats would be applied:

- pushed: ``SubscribeKvEvents`` (``load_records_before_first_batch``): every batch's
  ``EngineLoad`` record is a report (KV block events themselves are not used);
- polled: ``GetLoads`` every ``poll_interval_s`` whenever no pushed record arrived within that
  interval (a stock worker without ``--kv-events-config`` answers the subscription
  UNIMPLEMENTED; vLLM's Python servicer pushes nothing before its first KV batch).

Mapping (vLLM -> ``LoadSample``): running / waiting as reported; ``pending_prefill_tokens`` =
``prefill_pending_tokens`` when the record carries it (prompt tokens handed to the engine with no
output yet: the node ledger's meaning), else ``num_waiting_uncached_tokens`` (vLLM's estimate of
queued, not-yet-started prompt tokens); ``kv_cache_usage`` = ``token_usage``;
``generation_tokens_per_s`` = ``gen_throughput``; prompt tokens/s unknown (0: the scorer uses its
reference floor); ``in_flight`` = running + waiting. The worker cannot report what *this* router
sent it, so the transport counts it (requests sent / that produced a first token) and the report
carries those counts as this router's ``RouterAccount``: credits are cleared by the same rule as
for gpumesh nodes. A request sent while a report was in flight may be counted as reported a few
milliseconds early (the worker had not seen it yet).

Transport (``ForeignClient``): the same seam as ``router.transport.NodeClient`` (serialized
gpumesh ``GenerateRequest`` in, serialized gpumesh responses out), translating to VllmEngine
``Generate``: text and chat prompts are tokenized with the model's tokenizer (HF
``transformers``; the worker's ``tokenizer_path`` from GetModelInfo, or the spec's
``tokenizer``), token ids are sent as-is; the worker answers token ids only, detokenized here
incrementally (a multi-byte character is never split). One gpumesh chunk per worker chunk
(StreamOptions coalescing is not applied to foreign nodes). Cancelling the call cancels the
worker's Generate (vLLM aborts the request).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import grpc
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2 as smg_common

from gpumesh.serial_worker import (
    INLINE_DECODE_IDS,
    INLINE_PROMPT_CHARS,
    SerialWorker,
    WorkerClosed,
)
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.router.errors import NOT_ADMITTED_CODES
from gpumesh.router.registry import AccountSample, ModelSpec, NodeRegistration, Registry
from gpumesh.router.scheduling.types import LoadSample
from gpumesh.router.transport import NodeChannels

log = logging.getLogger(__name__)

KIND = "vllm-grpc"
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
           "abort": pb.FINISH_REASON_ABORT}
_DEFAULT_MAX_TOKENS = 16   # gpumesh's contract (vLLM's would be "the rest of the context")
_stream_ids = itertools.count(1 << 40)   # registry stream ids, apart from Connect streams'


@dataclass(frozen=True)
class ForeignSpec:
    """One foreign worker: ``host:port[?weight=W&node_id=ID&tokenizer=PATH&max_concurrency=N]``."""

    address: str
    node_id: str = ""
    capacity_weight: float = 1.0
    tokenizer: str = ""          # "" -> the worker's GetModelInfo.tokenizer_path
    max_concurrency: int = 0

    @classmethod
    def parse(cls, text: str) -> ForeignSpec:
        address, _, query = text.strip().partition("?")
        q = {k: v[-1] for k, v in parse_qs(query).items()}
        unknown = set(q) - {"weight", "node_id", "tokenizer", "max_concurrency"}
        if not address or ":" not in address or unknown:
            raise ValueError(f"foreign node must be host:port[?weight=&node_id=&tokenizer=&"
                             f"max_concurrency=], got {text!r}")
        return cls(address, q.get("node_id", ""), float(q.get("weight", 1.0)),
                   q.get("tokenizer", ""), int(q.get("max_concurrency", 0)))

    @property
    def resolved_node_id(self) -> str:
        return self.node_id or f"vllm@{self.address}"


# --------------------------------------------------------------------------- tokenizer


class _Decoder:
    """``decode`` on one HF tokenizer object: the text of ``ids``, special tokens skipped."""

    def __init__(self, hf: Any) -> None:
        self._hf = hf

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._hf.decode(list(ids), skip_special_tokens=True))


class Tokenizer:
    """The model's HF tokenizer (``transformers``), loaded once per worker connection.

    Two tokenizer objects, because an HF fast tokenizer must not be called concurrently
    ("Already borrowed"): the main one serves prompts and one-shot decodes, every call
    serial on its ``SerialWorker`` and the long ones off the event loop (a 4,500-token prompt
    takes ~3 ms to encode, which would stall every stream of the router); ``stream_decoder``
    (a second copy) serves the streams' incremental decode steps, only ever called inline on
    the event loop's thread, so a step never waits behind a long encode on the worker (the
    price: a second copy of the tokenizer in memory per worker connection). The async
    ``encode_prompt`` / ``render_chat_prompt`` / ``decode_all`` go through the worker
    (``WorkerClosed`` once the router is stopping); the sync ``encode`` / ``render_chat`` /
    ``decode`` are what they run, and what tests and scripts call.
    """

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - environment
            raise RuntimeError("foreign nodes need the `transformers` package to tokenize and "
                               "detokenize for vLLM gRPC workers") from exc
        self._tok: Any = AutoTokenizer.from_pretrained(path)
        self._decoder = _Decoder(self._tok)
        self.stream_decoder = _Decoder(AutoTokenizer.from_pretrained(path))
        self._worker = SerialWorker("gpumesh-foreign-tokenize")

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        rendered = self._tok.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages], tokenize=False,
            add_generation_prompt=True)
        return list(self._tok.encode(rendered, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._decoder.decode(ids)

    async def encode_prompt(self, text: str) -> list[int]:
        return await self._worker.run(self.encode, text, inline=len(text) < INLINE_PROMPT_CHARS)

    async def render_chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        chars = sum(len(r) + len(c) for r, c in messages)
        return await self._worker.run(self.render_chat, messages, inline=chars < INLINE_PROMPT_CHARS)

    async def decode_all(self, ids: Sequence[int]) -> str:
        return await self._worker.run(self.decode, ids, inline=len(ids) < INLINE_DECODE_IDS)

    def close(self) -> None:
        self._worker.close()


class _Detokenizer:
    """Incremental detokenization: emits the text added since the last call, holding back a
    trailing incomplete UTF-8 character (U+FFFD) until the next ids complete it (or the end).
    The deltas concatenate to ``tok.decode(all_ids)`` (special tokens skipped) for byte-level
    BPE tokenizers. Each ``push`` costs O(ids since the last fully emitted push), not O(all).

    Why a window over ``tok.decode`` rather than ``tokenizers.decoders.DecodeStream``: it uses
    the same ``decode`` as a one-shot detokenization (skip_special_tokens, transformers'
    clean-up), works for any HF tokenizer (DecodeStream needs a fast one, and only recent
    ``tokenizers``, which pyproject does not pin), and it still emits the complete text
    before a trailing incomplete character as soon as it has it. It is vLLM's
    ``detokenize_incrementally`` / HF ``TextStreamer`` scheme: the window starts at the ids
    of the last push that decoded cleanly, kept as context (a SentencePiece decoder strips the
    first token's leading space), and ``_sent`` counts the window's characters already out.
    """

    def __init__(self, tok: Tokenizer | _Decoder) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._start = 0   # the window: ids[_start:]
        self._read = 0    # ids[:_read] are out in full (the window slides to here)
        self._sent = 0    # characters of decode(ids[_start:]) already emitted

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        self._ids.extend(ids)
        text = self._tok.decode(self._ids[self._start:])
        end = len(text) if final else len(text.rstrip("\ufffd"))
        delta = text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        if end == len(text) and len(self._ids) > self._read:
            # All out, no character pending: slide the window to the ids since the last slide.
            if self._read > self._start:
                self._start = self._read
                text = self._tok.decode(self._ids[self._start:])
            self._read, self._sent = len(self._ids), len(text)
        return delta


# --------------------------------------------------------------------------- transport


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _is_template_error(exc: BaseException) -> bool:
    """A chat template's own error (e.g. its ``raise_exception`` on a role it refuses)."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers renders templates with jinja2
        return False
    return isinstance(exc, TemplateError)


@dataclass
class _Counts:
    """This router's requests to one worker (the RouterAccount the worker cannot report)."""

    sent: int = 0
    sent_tokens: int = 0
    first: int = 0
    first_tokens: int = 0

    def sample(self) -> AccountSample:
        return AccountSample(self.sent, self.sent_tokens, self.first, self.first_tokens)


class _StreamCall:
    """What the dispatcher needs of a ``grpc.aio.UnaryStreamCall``: read / cancel / done."""

    def __init__(self, gen: AsyncIterator[bytes], inner: list[grpc.aio.Call]) -> None:
        self._gen = gen
        self._inner = inner
        self._done = False

    async def read(self) -> bytes | Any:
        try:
            return await self._gen.__anext__()
        except StopAsyncIteration:
            self._done = True
            return grpc.aio.EOF
        except BaseException:
            self._done = True
            raise

    def cancel(self) -> bool:
        self._done = True
        for call in self._inner:
            call.cancel()
        # Run the generator's cleanup (its counts) now rather than at garbage collection.
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(self._gen.aclose())  # type: ignore[attr-defined]
        return True

    def done(self) -> bool:
        return self._done


class ForeignClient:
    """``router.transport.NodeClient``'s interface over a VllmEngine worker (module doc)."""

    def __init__(self, node_id: str, address: str, channel: grpc.aio.Channel,
                 tokenizer: Tokenizer, counts: _Counts) -> None:
        self.node_id = node_id
        self.address = address
        self._stub = vpb_grpc.VllmEngineStub(channel)
        self._tok = tokenizer
        self._counts = counts

    async def _translate(self, raw: bytes, stream: bool) -> tuple[vpb.GenerateRequest, int]:
        req = pb.GenerateRequest.FromString(raw)
        kind = req.WhichOneof("prompt")
        if kind == "token_ids":
            ids = list(req.token_ids.ids)
        elif kind in ("text", "chat"):
            try:
                if kind == "text":
                    ids = await self._tok.encode_prompt(req.text)
                else:
                    ids = await self._tok.render_chat_prompt(
                        [(m.role, m.content) for m in req.chat.messages])
            except Exception as exc:  # the tokenizer's, mapped once here
                raise self._tokenize_error(exc) from exc
        else:
            raise _rpc_error(grpc.StatusCode.INVALID_ARGUMENT,
                             "request has no prompt: set text, chat or token_ids")
        if not ids:
            raise _rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        s = req.sampling
        sp = vpb.SamplingParams(
            temperature=s.temperature if s.HasField("temperature") else 1.0,
            top_p=s.top_p if s.HasField("top_p") else 1.0, top_k=s.top_k,
            max_tokens=s.max_tokens if s.HasField("max_tokens") else _DEFAULT_MAX_TOKENS,
            stop=list(s.stop), ignore_eos=s.ignore_eos)
        if s.HasField("seed"):
            sp.seed = s.seed & 0x7FFFFFFF   # vLLM's proto takes an int32
        return vpb.GenerateRequest(
            request_id=req.request_id or uuid.uuid4().hex, stream=stream, sampling_params=sp,
            tokenized=vpb.TokenizedInput(original_text=req.text if kind == "text" else "",
                                         input_ids=ids)), len(ids)

    def _tokenize_error(self, exc: Exception) -> grpc.aio.AioRpcError:
        """A tokenizer failure as the status the dispatcher and client see (the request never
        reached the worker): a bad prompt (ValueError, a chat template's error) is the
        client's, a stopping router UNAVAILABLE (retried elsewhere), anything else INTERNAL."""
        if isinstance(exc, WorkerClosed):
            return _rpc_error(grpc.StatusCode.UNAVAILABLE, "router is shutting down")
        detail = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, ValueError) or _is_template_error(exc):
            return _rpc_error(grpc.StatusCode.INVALID_ARGUMENT,
                              f"cannot tokenize the prompt for {self.address}: {detail}")
        log.warning("tokenizing for %s failed: %s", self.address, detail)
        return _rpc_error(grpc.StatusCode.INTERNAL, f"router tokenizer error: {detail}")

    def stream(self, request: bytes, *, timeout_s: float, metadata: Sequence[tuple[str, str]]
               ) -> _StreamCall:
        inner: list[grpc.aio.Call] = []
        return _StreamCall(self._stream(request, timeout_s, metadata, inner), inner)

    async def _stream(self, raw: bytes, timeout_s: float, metadata: Sequence[tuple[str, str]],
                      inner: list[grpc.aio.Call]) -> AsyncIterator[bytes]:
        vreq, n_prompt = await self._translate(raw, stream=True)
        self._counts.sent += 1
        self._counts.sent_tokens += n_prompt
        call = self._stub.Generate(vreq, timeout=timeout_s, metadata=tuple(metadata))
        inner.append(call)
        # Inline on the loop: a step decodes a few ids (~10 us; a hop to a thread would cost
        # ~100 us per message), on the decoder only this thread uses.
        detok = _Detokenizer(self._tok.stream_decoder)
        first = True
        generated = 0
        refused = False
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    raise _rpc_error(grpc.StatusCode.UNAVAILABLE,
                                     f"worker {self.address} ended the stream without a result")
                if msg.HasField("chunk"):
                    ids = list(msg.chunk.token_ids)
                    if not ids:
                        continue
                    if first:
                        self._counts.first += 1
                        self._counts.first_tokens += n_prompt
                    generated += len(ids)
                    out = pb.GenerateStreamResponse(text=detok.push(ids), token_ids=ids)
                    if first:
                        out.request_id, first = vreq.request_id, False
                    yield out.SerializeToString()
                elif msg.HasField("complete"):
                    # Streamed: the complete repeats the last chunk's ids (vLLM DELTA mode).
                    c = msg.complete
                    out = pb.GenerateStreamResponse(
                        text=detok.push((), final=True),
                        finish_reason=_FINISH.get(c.finish_reason, pb.FINISH_REASON_ABORT),
                        usage=pb.Usage(prompt_tokens=c.prompt_tokens or n_prompt,
                                       completion_tokens=generated))
                    if first:
                        out.request_id = vreq.request_id
                    yield out.SerializeToString()
                    return
        except grpc.aio.AioRpcError as exc:
            refused = first and exc.code() in NOT_ADMITTED_CODES
            raise
        finally:
            self._settle(first, refused, n_prompt)
            if not call.done():
                call.cancel()

    def _settle(self, no_first_token: bool, refused: bool, n_prompt: int) -> None:
        """A request that ended before its first token: a refused one was never admitted (the
        dispatcher says so too), any other counts as past its first token (as a node counts)."""
        if refused:
            self._counts.sent -= 1
            self._counts.sent_tokens -= n_prompt
        elif no_first_token:
            self._counts.first += 1
            self._counts.first_tokens += n_prompt

    def unary(self, request: bytes, *, timeout_s: float, metadata: Sequence[tuple[str, str]]
              ) -> asyncio.Future[bytes]:
        return asyncio.ensure_future(self._unary(request, timeout_s, metadata))

    async def _unary(self, raw: bytes, timeout_s: float,
                     metadata: Sequence[tuple[str, str]]) -> bytes:
        vreq, n_prompt = await self._translate(raw, stream=False)
        self._counts.sent += 1
        self._counts.sent_tokens += n_prompt
        call = self._stub.Generate(vreq, timeout=timeout_s, metadata=tuple(metadata))
        refused = False
        try:
            async for msg in call:
                if msg.HasField("complete"):
                    c = msg.complete
                    ids = list(c.output_ids)
                    try:
                        text = await self._tok.decode_all(ids)
                    except WorkerClosed:
                        raise _rpc_error(grpc.StatusCode.UNAVAILABLE,
                                         "router is shutting down") from None
                    return pb.GenerateResponse(
                        text=text, token_ids=ids,
                        finish_reason=_FINISH.get(c.finish_reason, pb.FINISH_REASON_ABORT),
                        usage=pb.Usage(prompt_tokens=c.prompt_tokens or n_prompt,
                                       completion_tokens=len(ids)),
                        request_id=vreq.request_id).SerializeToString()
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE,
                             f"worker {self.address} ended without a result")
        except grpc.aio.AioRpcError as exc:
            refused = exc.code() in NOT_ADMITTED_CODES
            raise
        finally:
            self._settle(True, refused, n_prompt)
            if not call.done():
                call.cancel()

    async def close(self, grace_s: float | None) -> None:
        """The channel belongs to the ForeignMember (it outlives registrations)."""


# --------------------------------------------------------------------------- membership


def load_from_record(r: smg_common.EngineLoad) -> LoadSample:
    pending = (r.prefill_pending_tokens if r.HasField("prefill_pending_tokens")
               else r.waiting_uncached_tokens)
    return LoadSample(
        num_running=r.running_requests, num_waiting=r.waiting_requests,
        pending_prefill_tokens=pending, kv_cache_usage=r.token_usage,
        prefix_cache_hit_rate=r.cache_hit_rate if r.HasField("cache_hit_rate") else 0.0,
        generation_tokens_per_s=r.gen_throughput,
        in_flight=r.running_requests + r.waiting_requests)


def load_from_scheduler(s: vpb.SchedulerLoad) -> LoadSample:
    return LoadSample(
        num_running=s.num_running_reqs, num_waiting=s.num_waiting_reqs,
        pending_prefill_tokens=s.num_waiting_uncached_tokens, kv_cache_usage=s.token_usage,
        prefix_cache_hit_rate=s.cache_hit_rate, generation_tokens_per_s=s.gen_throughput,
        in_flight=s.num_running_reqs + s.num_waiting_reqs)


class ForeignMember:
    """Keeps one foreign worker registered and reported while it answers (module doc)."""

    def __init__(self, spec: ForeignSpec, registry: Registry, channels: NodeChannels, *,
                 poll_interval_s: float = 0.25, rpc_timeout_s: float = 5.0,
                 max_backoff_s: float = 5.0) -> None:
        self.spec = spec
        self.node_id = spec.resolved_node_id
        self._registry = registry
        self._channels = channels
        self._poll = poll_interval_s
        self._timeout = rpc_timeout_s
        self._max_backoff = max_backoff_s
        self._channel = grpc.aio.insecure_channel(spec.address, options=[
            ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        self._stub = vpb_grpc.VllmEngineStub(self._channel)
        self._tokenizer: Tokenizer | None = None
        self._stream_id = 0
        self._seq = 0
        self._last_push = 0.0
        self._counts = _Counts()
        self.pushed = 0          # reports taken from pushed records (tests, status)
        self.polled = 0          # reports taken from GetLoads

    async def run(self) -> None:
        backoff = 0.2
        while True:
            try:
                await self._session()
            except asyncio.CancelledError:
                self._leave("router stopping")
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: leave, back off, retry
                if self._stream_id:
                    log.warning("foreign node %s lost: %s", self.node_id, exc)
                else:
                    log.debug("foreign node %s not reachable yet: %s", self.node_id, exc)
                self._leave(f"{type(exc).__name__}")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff)
            else:
                backoff = 0.2

    async def close(self) -> None:
        await self._channel.close(None)
        if self._tokenizer is not None:
            self._tokenizer.close()

    def _leave(self, reason: str) -> None:
        if self._stream_id:
            self._registry.deregister(self.node_id, self._stream_id, reason)
            self._stream_id = 0

    async def _session(self) -> None:
        health = await self._stub.HealthCheck(vpb.HealthCheckRequest(), timeout=self._timeout)
        if not health.healthy:
            raise RuntimeError(f"worker unhealthy: {health.message}")
        info = await self._stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=self._timeout)
        if self._tokenizer is None:
            path = self.spec.tokenizer or info.tokenizer_path or info.model_path
            if not Path(path).exists():
                raise RuntimeError(f"no local tokenizer for {self.node_id} at {path!r}; set "
                                   "tokenizer= in its foreign_nodes entry")
            self._tokenizer = await asyncio.to_thread(Tokenizer, path)
        name = info.served_model_name or info.model_path
        self._counts = _Counts()   # a fresh incarnation: the ledger restarts with it
        self._stream_id = next(_stream_ids)
        self._seq = 0
        self._registry.register(NodeRegistration(
            node_id=self.node_id, address=self.spec.address,
            models=(ModelSpec(name, (), info.max_context_length, 1, self.spec.capacity_weight),),
            incarnation=uuid.uuid4().hex[:16], engine="vllm",
            max_concurrency=self.spec.max_concurrency, kind=KIND), self._stream_id)
        self._channels.adopt(ForeignClient(self.node_id, self.spec.address, self._channel,
                                           self._tokenizer, self._counts))
        log.info("foreign node %s (%s) joined serving %s", self.node_id, self.spec.address, name)
        sub = asyncio.create_task(self._subscribe())
        try:
            await self._poll_loop(sub)
        finally:
            sub.cancel()
            with contextlib.suppress(BaseException):
                await sub

    def _report(self, load: LoadSample) -> None:
        self._seq += 1
        self._registry.heartbeat(self.node_id, self._stream_id, self._seq,
                                 int(time.time() * 1000), load,
                                 ((self._registry.router_id, self._counts.sample()),))

    async def _subscribe(self) -> None:
        """Pushed records while the worker sends them; ends quietly when it cannot."""
        try:
            async for batch in self._stub.SubscribeKvEvents(
                    smg_common.SubscribeKvEventsRequest(load_records_before_first_batch=True)):
                if batch.HasField("load"):
                    self._last_push = time.monotonic()
                    self.pushed += 1
                    self._report(load_from_record(batch.load))
        except grpc.aio.AioRpcError as exc:
            log.info("foreign node %s pushes no load records (%s); polling GetLoads",
                     self.node_id, exc.code().name)

    async def _poll_loop(self, sub: asyncio.Task[None]) -> None:
        while True:
            if time.monotonic() - self._last_push > self._poll:
                loads = await self._stub.GetLoads(vpb.GetLoadsRequest(), timeout=self._timeout)
                if loads.loads:
                    self.polled += 1
                    self._report(_merge(loads.loads))
            await asyncio.sleep(self._poll)


def _merge(loads: Sequence[vpb.SchedulerLoad]) -> LoadSample:
    """Data-parallel ranks summed (one node to the router); KV usage averaged."""
    parts = [load_from_scheduler(s) for s in loads]
    n = len(parts)
    return LoadSample(
        num_running=sum(p.num_running for p in parts),
        num_waiting=sum(p.num_waiting for p in parts),
        pending_prefill_tokens=sum(p.pending_prefill_tokens for p in parts),
        kv_cache_usage=sum(p.kv_cache_usage for p in parts) / n,
        prefix_cache_hit_rate=sum(p.prefix_cache_hit_rate for p in parts) / n,
        generation_tokens_per_s=sum(p.generation_tokens_per_s for p in parts),
        in_flight=sum(p.in_flight for p in parts))


class ForeignFleet:
    """Every configured foreign worker's member task (wired by ``router.app``)."""

    def __init__(self, specs: Sequence[str], registry: Registry, channels: NodeChannels,
                 poll_interval_s: float = 0.25) -> None:
        self.members = [ForeignMember(ForeignSpec.parse(s), registry, channels,
                                      poll_interval_s=poll_interval_s) for s in specs]
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(m.run(), name=f"foreign:{m.node_id}")
                       for m in self.members]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(m.close() for m in self.members), return_exceptions=True)
        self._tasks = []
