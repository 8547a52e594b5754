"""``ForeignClient``: the node transport seam (``backends.channels.NodeTransport``) over a
stock vLLM gRPC worker's VllmEngine ``Generate``.

Serialized gpumesh ``GenerateRequest`` in (translated by ``translate``), serialized gpumesh
responses out: the worker's token ids are detokenized here incrementally. One gpumesh chunk
per worker chunk (StreamOptions coalescing is not applied to foreign nodes). Cancelling the
call cancels the worker's Generate (vLLM aborts the request).

The worker cannot report what *this* router sent it, so the client counts it
(``ForeignClient.account``: requests sent / that produced a first token); membership reports
that as this router's ``RouterAccount``, so credits clear by the same rule as for gpumesh
nodes.
A request sent while a report was in flight may be counted as reported slightly early (the
worker had not seen it yet).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc

from gpumesh.router.backends.vllm_grpc.call import WorkerStreamCall, rpc_error
from gpumesh.router.backends.vllm_grpc.detokenizer import Detokenizer
from gpumesh.router.backends.vllm_grpc.translate import finish_reason, prompt_ids, to_vllm_request
from gpumesh.router.errors import NOT_ADMITTED_CODES
from gpumesh.router.tokenizers import Tokenizer
from gpumesh.serial_worker import WorkerClosed
from gpumesh.types import RouterAccount
from gpumesh.v1 import inference_pb2 as pb


class ForeignClient:
    """Calls to one stock vLLM gRPC worker (module doc); ``account``: what router
    ``router_id`` sent it through this client (``finished_requests`` not counted)."""

    def __init__(self, node_id: str, address: str, channel: grpc.aio.Channel,
                 tokenizer: Tokenizer, router_id: str) -> None:
        self.node_id = node_id
        self.address = address
        self._stub = vpb_grpc.VllmEngineStub(channel)
        self._tok = tokenizer
        self.account = RouterAccount(router_id)

    async def _translate(self, raw: bytes, stream: bool) -> tuple[vpb.GenerateRequest, int]:
        req = pb.GenerateRequest.FromString(raw)
        ids = await prompt_ids(req, self._tok, self.address)
        return to_vllm_request(req, ids, stream), len(ids)

    def stream(self, request: bytes, *, timeout_s: float, metadata: Sequence[tuple[str, str]]
               ) -> WorkerStreamCall:
        inner: list[grpc.aio.Call] = []
        return WorkerStreamCall(self._stream(request, timeout_s, metadata, inner), inner)

    async def _stream(self, raw: bytes, timeout_s: float, metadata: Sequence[tuple[str, str]],
                      inner: list[grpc.aio.Call]) -> AsyncIterator[bytes]:
        vreq, n_prompt = await self._translate(raw, stream=True)
        self._sent(n_prompt)
        call = self._stub.Generate(vreq, timeout=timeout_s, metadata=tuple(metadata))
        inner.append(call)
        # Inline on the loop: a step decodes a few ids, cheaper than a hop to a thread, on the
        # decoder only this thread uses.
        detok = Detokenizer(self._tok.stream_decoder)
        first = True
        generated = 0
        refused = False
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                                    f"worker {self.address} ended the stream without a result")
                if msg.HasField("chunk"):
                    ids = list(msg.chunk.token_ids)
                    if not ids:
                        continue
                    if first:
                        self.account = self.account.first_token(n_prompt)
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
                        finish_reason=finish_reason(c.finish_reason),
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

    def unary(self, request: bytes, *, timeout_s: float, metadata: Sequence[tuple[str, str]]
              ) -> asyncio.Future[bytes]:
        return asyncio.ensure_future(self._unary(request, timeout_s, metadata))

    async def _unary(self, raw: bytes, timeout_s: float,
                     metadata: Sequence[tuple[str, str]]) -> bytes:
        vreq, n_prompt = await self._translate(raw, stream=False)
        self._sent(n_prompt)
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
                        raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                                        "router is shutting down") from None
                    return pb.GenerateResponse(
                        text=text, token_ids=ids, finish_reason=finish_reason(c.finish_reason),
                        usage=pb.Usage(prompt_tokens=c.prompt_tokens or n_prompt,
                                       completion_tokens=len(ids)),
                        request_id=vreq.request_id).SerializeToString()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                            f"worker {self.address} ended without a result")
        except grpc.aio.AioRpcError as exc:
            refused = exc.code() in NOT_ADMITTED_CODES
            raise
        finally:
            self._settle(True, refused, n_prompt)
            if not call.done():
                call.cancel()

    def _sent(self, n_prompt: int) -> None:
        self.account = self.account.admit(n_prompt)

    def _settle(self, no_first_token: bool, refused: bool, n_prompt: int) -> None:
        """A request that ended before its first token: a refused one was never admitted (the
        dispatcher says so too), any other counts as past its first token (as a node counts)."""
        if refused:
            self.account = self.account.admit(-n_prompt, -1)
        elif no_first_token:
            self.account = self.account.first_token(n_prompt)

    async def close(self, grace_s: float | None) -> None:
        """The channel belongs to the ForeignMember (it outlives registrations)."""
