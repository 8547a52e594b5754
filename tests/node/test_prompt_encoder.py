"""Prompts are tokenized off the event loop (gpumesh.node.engines.prompts.PromptEncoder): a
slow tokenization does not stall the node's other streams, a client that cancels meanwhile
leaves nothing in the engine, and concurrent prompts use the real tokenizer one call at a time.

Real loopback gRPC. The first tests run a real NodeServer over a TEST ENGINE: the labelled
simulator (SimEngine) whose ``tokenize`` sleeps, standing in for a very long prompt on a real
tokenizer. The last one uses the real vLLM CPU engine on the tiny model (the session's).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc

from gpumesh.client import MeshClient, build_request
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc
from gpumesh.node.app import NodeServer
from gpumesh.node.streaming.budget import CoalescePolicy
from gpumesh.node.config import NodeConfig
from gpumesh.node.engines.base import EngineRequest
from gpumesh.serial_worker import INLINE_PROMPT_CHARS
from gpumesh.node.api.inference import NodeInferenceServicer
from gpumesh.node.state import ServingState
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig

TOKENIZE_S = 1.0
# Long enough to leave the loop (PromptEncoder runs shorter prompts inline).
LONG_TEXT = " ".join(["mesh"] * 500)
assert len(LONG_TEXT) >= INLINE_PROMPT_CHARS


class SlowTokenizeSim(SimEngine):
    """TEST ENGINE: the simulator, but ``tokenize`` blocks its thread for TOKENIZE_S (as a
    huge prompt would on a real tokenizer); records when tokenization ran and what reached
    ``generate``."""

    def __init__(self) -> None:
        super().__init__(SimEngineConfig(model_name="sim"))
        self.tokenizing = threading.Event()
        self.tokenized_at = 0.0
        self.generated: list[str] = []

    def tokenize(self, text: str) -> list[int]:
        self.tokenizing.set()
        time.sleep(TOKENIZE_S)
        self.tokenized_at = time.monotonic()
        return super().tokenize(text)

    async def generate(self, request: EngineRequest):  # type: ignore[override]
        self.generated.append(request.request_id)
        async for out in super().generate(request):
            yield out


@pytest.fixture
async def slow_node():
    engine = SlowTokenizeSim()
    node = NodeServer(NodeConfig(engine={"kind": "sim"},
                                 serving={"port": 0, "node_id": "slowtok"}), engine)
    await node.start()
    try:
        yield node, engine
    finally:
        await node.stop()


async def _slow_call(kind: str, addr: str) -> int:
    """One request with the slow text prompt; returns the prompt tokens it reports."""
    async with grpc.aio.insecure_channel(addr) as ch:
        if kind == "vllm":  # vLLM's native gRPC service on the same node
            resp = [r async for r in vpb_grpc.VllmEngineStub(ch).Generate(vpb.GenerateRequest(
                request_id="slow", text=LONG_TEXT,
                sampling_params=vpb.SamplingParams(max_tokens=4)), timeout=30)]
            return resp[-1].complete.prompt_tokens
        req = build_request(LONG_TEXT, max_tokens=4)
        stub = pb_grpc.InferenceStub(ch)
        if kind == "unary":
            return (await stub.Generate(req, timeout=30)).usage.prompt_tokens
        chunks = [c async for c in stub.GenerateStream(req, timeout=30)]
        return chunks[-1].usage.prompt_tokens


@pytest.mark.parametrize("kind", ["stream", "unary", "vllm"])
async def test_a_slow_tokenization_does_not_stall_other_streams(slow_node, kind):
    node, engine = slow_node
    addr = f"127.0.0.1:{node.port}"
    slow = asyncio.create_task(_slow_call(kind, addr))
    assert await asyncio.to_thread(engine.tokenizing.wait, 10)
    t0 = time.monotonic()
    async with MeshClient(addr) as client:
        chunks = [c async for c in client.stream(
            build_request([1, 2, 3], max_tokens=8, ignore_eos=True), timeout=30)]
    other_done = time.monotonic()
    assert sum(len(c.token_ids) for c in chunks) == 8
    # On the loop, the other stream could not even start before the tokenization ended.
    # Off it, the stream (tens of ms) completes while the tokenizer still sleeps.
    assert engine.tokenized_at == 0.0 or other_done < engine.tokenized_at
    assert other_done - t0 < TOKENIZE_S / 2
    assert await slow == 500  # the slow request itself completes, with its prompt


async def test_cancel_while_tokenizing_admits_nothing(slow_node, caplog):
    node, engine = slow_node
    caplog.set_level(logging.WARNING)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{node.port}") as ch:
        stub = pb_grpc.InferenceStub(ch)
        call = stub.GenerateStream(build_request(LONG_TEXT, max_tokens=4), timeout=30)
        reading = asyncio.create_task(call.read())
        assert await asyncio.to_thread(engine.tokenizing.wait, 10)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        # Let the tokenization finish on its thread (its result is discarded).
        deadline = time.monotonic() + 10
        while not engine.tokenized_at and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        assert engine.tokenized_at
        assert engine.generated == []
        assert node.state.ledger.in_flight == 0
        load = engine.load()
        assert load.num_running == load.num_waiting == 0
        # The node keeps serving.
        out = await stub.Generate(build_request([1, 2, 3], max_tokens=2), timeout=30)
        assert len(out.token_ids) == 2
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records


class _OverlapProbe:
    """Instrumentation, not a fake: forwards everything to the real VllmEngine and counts
    how many tokenizer calls run at once, and on which threads."""

    def __init__(self, engine: object) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self.active = self.max_active = 0
        self.threads: set[int] = set()

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)

    @contextmanager
    def _track(self) -> Iterator[None]:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.threads.add(threading.get_ident())
        try:
            yield
        finally:
            with self._lock:
                self.active -= 1

    def tokenize(self, text: str) -> list[int]:
        with self._track():
            return self._engine.tokenize(text)  # type: ignore[attr-defined]

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        with self._track():
            return self._engine.render_chat(messages)  # type: ignore[attr-defined]


@pytest.mark.vllm
async def test_concurrent_prompts_use_the_real_tokenizer_one_at_a_time(vllm_engine):
    probe = _OverlapProbe(vllm_engine)
    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(
        NodeInferenceServicer(probe, ServingState("tok"), CoalescePolicy()), server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    # Long prompts (~470 tokens, under the session engine's 512) go to the thread, short ones
    # run inline when it is idle (as the first one does, alone): both paths, many at once.
    long_text = " ".join(f"token{i % 97} routes" for i in range(80))
    prompts: list[str | list[tuple[str, str]]] = []
    for i in range(4):
        prompts += [long_text + f" {i}", f"short prompt {i}",
                    [("system", "be brief"), ("user", long_text[: 900 + 50 * i])]]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.InferenceStub(ch)
            await stub.Generate(build_request("warm up", model="tiny", max_tokens=1), timeout=60)
            outs = await asyncio.gather(*(stub.Generate(
                build_request(p, model="tiny", max_tokens=1, temperature=0), timeout=120)
                for p in prompts))
    finally:
        await server.stop(None)
    expected = [len(vllm_engine.tokenize(p)) if isinstance(p, str)
                else len(vllm_engine.render_chat(p)) for p in prompts]
    assert [o.usage.prompt_tokens for o in outs] == expected
    assert all(o.finish_reason == pb.FINISH_REASON_LENGTH for o in outs)
    assert max(expected) <= 511 and min(expected) > 0
    assert probe.max_active == 1
    assert len(probe.threads) == 2  # the event loop's (short prompts) and the worker's
