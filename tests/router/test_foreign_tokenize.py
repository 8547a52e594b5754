"""The router tokenizes prompts for foreign nodes (vLLM gRPC workers) off its event loop
(router.backends.vllm_grpc.Tokenizer on a gpumesh.serial_worker.SerialWorker): a slow
tokenization does not stall the router's other streams, not even those to the same worker; a
client that cancels meanwhile sends nothing to the worker; a tokenizer error is the request's
status and the router keeps serving; concurrent requests call each tokenizer object one at a
time.

Real loopback gRPC: a RouterServer whose foreign node is a gpumesh sim node's VllmEngine
service (vLLM's own proto), and the real tiny-model HF tokenizer; ``encode`` is wrapped to
block (standing in for a very long prompt) or to raise.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import grpc
import pytest

from gpumesh.serial_worker import INLINE_PROMPT_CHARS
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc
from gpumesh.node.app import NodeServer
from gpumesh.node.config import NodeConfig
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig
from gpumesh.router.app import RouterServer
from gpumesh.router.config import RouterConfig
from gpumesh.router.backends.vllm_grpc import Tokenizer

TOKENIZE_S = 2.0   # the other stream must finish within half of it, even on a busy machine
LONG_TEXT = " ".join(["mesh"] * 500)   # long enough to leave the loop
assert len(LONG_TEXT) >= INLINE_PROMPT_CHARS


async def _until(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
async def mesh(tiny_model_dir: Path):
    model = str(tiny_model_dir)
    node = NodeServer(NodeConfig(serving={"port": 0, "node_id": "sim-as-vllm"},
                                 engine={"kind": "sim", "model": model, "served_name": model}),
                      SimEngine(SimEngineConfig(model_name=model, vocab_size=2048,
                                                max_context_length=2048, time_scale=1.0)))
    await node.start()
    # A long lease: the tests block the shared event loop in the wrapped encode for
    # TOKENIZE_S, and nothing here waits for a lease to expire.
    router = RouterServer(RouterConfig(serving={"port": 0, "host": "127.0.0.1"},
                                       membership={"lease_ttl_s": 30.0,
                                                   "foreign_nodes": (
        f"127.0.0.1:{node.port}?node_id=foreign&tokenizer={model}",)}))
    await router.start()
    try:
        await _until(lambda: (e := router.registry.entry("foreign")) is not None
                     and e.report is not None)
        member = router.foreign.members[0]
        async with grpc.aio.insecure_channel(router.address) as ch:
            yield pb_grpc.InferenceStub(ch), member._tokenizer, member, model
    finally:
        await router.stop(1)
        await node.stop(0)


class _Blocking:
    """Wraps ``Tokenizer.encode`` on the instance: blocks TOKENIZE_S (or raises ``error``
    once) for prompts of at least INLINE_PROMPT_CHARS; records when it ran."""

    def __init__(self, tok: Tokenizer, error: Exception | None = None) -> None:
        self._tok, self._orig, self._error = tok, tok.encode, error
        self.started = threading.Event()
        self.done_at = 0.0

    def __enter__(self) -> Self:
        self._tok.encode = self  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self._tok.encode

    def __call__(self, text: str) -> list[int]:
        if len(text) >= INLINE_PROMPT_CHARS:
            self.started.set()
            if self._error is not None:
                err, self._error = self._error, None
                raise err
            time.sleep(TOKENIZE_S)
            self.done_at = time.monotonic()
        return self._orig(text)


def _req(model: str, max_tokens: int, **prompt) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=model, sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True), **prompt)


async def _slow(kind: str, stub: pb_grpc.InferenceStub, model: str) -> int:
    req = _req(model, 4, text=LONG_TEXT)
    if kind == "unary":
        return (await stub.Generate(req, timeout=30)).usage.prompt_tokens
    return [c async for c in stub.GenerateStream(req, timeout=30)][-1].usage.prompt_tokens


@pytest.mark.parametrize("kind", ["stream", "unary"])
async def test_a_slow_tokenization_does_not_stall_other_streams(mesh, kind):
    stub, tok, _, model = mesh
    with _Blocking(tok) as slow:
        slow_call = asyncio.create_task(_slow(kind, stub, model))
        assert await asyncio.to_thread(slow.started.wait, 10)
        t0 = time.monotonic()
        # Another stream to the same worker (its prompt token ids): neither its dispatch nor
        # the decoding of its text waits for the tokenizer's thread.
        chunks = [c async for c in stub.GenerateStream(_req(model, 8, token_ids=pb.TokenIds(
            ids=[5, 6, 7])), timeout=30)]
        other_done = time.monotonic()
        assert sum(len(c.token_ids) for c in chunks) == 8
        assert "".join(c.text for c in chunks)  # detokenized meanwhile
        assert slow.done_at == 0.0 or other_done < slow.done_at
        assert other_done - t0 < TOKENIZE_S / 2
        assert await slow_call == len(tok.encode(LONG_TEXT))


async def test_cancel_while_tokenizing_sends_nothing(mesh):
    stub, tok, member, model = mesh
    sent = member._client.account.admitted_requests
    with _Blocking(tok) as slow:
        call = stub.GenerateStream(_req(model, 4, text=LONG_TEXT), timeout=30)
        reading = asyncio.create_task(call.read())
        assert await asyncio.to_thread(slow.started.wait, 10)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        await _until(lambda: slow.done_at > 0, 10)
        await asyncio.sleep(0.2)
    assert member._client.account.admitted_requests == sent   # nothing reached the worker
    out = await stub.Generate(_req(model, 2, token_ids=pb.TokenIds(ids=[1, 2, 3])), timeout=30)
    assert len(out.token_ids) == 2


@pytest.mark.parametrize("error, code", [
    (ValueError("bad prompt"), grpc.StatusCode.INVALID_ARGUMENT),
    (RuntimeError("Already borrowed"), grpc.StatusCode.INTERNAL),
])
async def test_a_tokenizer_error_is_the_requests_status(mesh, error, code):
    stub, tok, _, model = mesh
    with _Blocking(tok, error), pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Generate(_req(model, 2, text=LONG_TEXT), timeout=30)
    assert exc.value.code() == code
    assert type(error).__name__ in (exc.value.details() or "")
    # The router, and this tokenizer's thread, keep serving.
    out = await stub.Generate(_req(model, 2, text=LONG_TEXT), timeout=30)
    assert out.usage.prompt_tokens == len(tok.encode(LONG_TEXT))


class _OverlapProbe:
    """Instrumentation, not a fake: forwards to a real HF tokenizer object and counts how many
    calls run at once on it."""

    def __init__(self, hf: object) -> None:
        self._hf = hf
        self._lock = threading.Lock()
        self.active = self.max_active = self.calls = 0
        self.threads: set[int] = set()

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._hf, name)
        if name not in ("encode", "decode", "apply_chat_template"):
            return attr

        def tracked(*args: object, **kwargs: object) -> object:
            with self._lock:
                self.active += 1
                self.calls += 1
                self.max_active = max(self.max_active, self.active)
                self.threads.add(threading.get_ident())
            try:
                return attr(*args, **kwargs)  # type: ignore[operator]
            finally:
                with self._lock:
                    self.active -= 1
        return tracked


async def test_concurrent_requests_call_each_tokenizer_object_one_at_a_time(mesh):
    stub, tok, _, model = mesh
    main, stream = _OverlapProbe(tok._tok), _OverlapProbe(tok.stream_decoder._hf)
    saved = tok._tok, tok._decoder._hf, tok.stream_decoder._hf
    tok._tok = tok._decoder._hf = main
    tok.stream_decoder._hf = stream
    long_text = " ".join(f"token{i % 97} routes" for i in range(120))
    prompts: list[dict[str, object]] = []
    for i in range(4):
        prompts += [{"text": long_text + f" {i}"}, {"text": f"short prompt {i}"},
                    {"chat": pb.ChatMessages(messages=[
                        pb.ChatMessage(role="system", content="be brief"),
                        pb.ChatMessage(role="user", content=long_text[: 900 + 60 * i])])}]
    try:
        async def one(i: int, p: dict[str, object]) -> Sequence[pb.GenerateStreamResponse]:
            if i % 2:
                return [await stub.Generate(_req(model, 24, **p), timeout=60)]
            return [c async for c in stub.GenerateStream(_req(model, 24, **p), timeout=60)]
        outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        tok._tok, tok._decoder._hf, tok.stream_decoder._hf = saved
    for o in outs:
        assert sum(len(c.token_ids) for c in o) == 24
        assert "".join(c.text for c in o) == tok.decode([i for c in o for i in c.token_ids])
    assert main.calls >= len(prompts) and stream.calls >= 24
    assert main.max_active == 1 and stream.max_active == 1
    assert len(main.threads) == 2        # the loop's (short calls) and the worker's
    assert stream.threads == {threading.get_ident()}   # the loop's only


async def test_a_prompt_for_a_closed_tokenizer_is_unavailable_and_reaches_no_worker(mesh):
    # A foreign member's tokenizer closes when the member goes away or the router stops; a
    # request that still needs its thread then fails UNAVAILABLE (retryable elsewhere), and
    # nothing is sent to the worker. A fresh Tokenizer stands in for the member's, so the
    # module's other tests keep theirs.
    stub, _, member, model = mesh
    client = member.channels._clients["foreign"]
    closed = Tokenizer(model)
    closed.close()
    saved, client._tok = client._tok, closed
    sent = member._client.account.admitted_requests
    try:
        for call in (stub.Generate, lambda r, **kw: _collect(stub.GenerateStream(r, **kw))):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await call(_req(model, 2, text=LONG_TEXT), timeout=30)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in (exc.value.details() or "")
        # a short prompt is tokenized inline (no thread needed): still served
        out = await stub.Generate(_req(model, 2, text="short"), timeout=30)
        assert len(out.token_ids) == 2
    finally:
        client._tok = saved
    assert member._client.account.admitted_requests == sent + 1   # only the short prompt reached the worker


async def _collect(call: grpc.aio.UnaryStreamCall) -> list[pb.GenerateStreamResponse]:
    return [c async for c in call]
