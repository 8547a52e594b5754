"""A burst of first requests through a precise-locality router loads the model's prefix
tokenizer once: every request that arrives while it loads waits for that one load, not for a
load of its own queued on the serial tokenizer thread ahead of every prompt's tokenization
(with an HF tokenizer taking ~0.3 s a load, 48 concurrent first requests waited ~48 loads)."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from gpumesh.router.fleet import locality
from gpumesh.v1 import inference_pb2, inference_pb2_grpc
from tests.integration.test_prefix_locality import MODEL, SYSTEM, mesh

BURST = 16
LOAD_S = 0.5   # the load under test is held this long, so the whole burst arrives during it


async def test_a_burst_of_first_requests_loads_the_tokenizer_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[str] = []
    lock = threading.Lock()
    real = locality.load_tokenizer

    def slow_load(spec: str) -> locality.PromptTokenizer:
        with lock:
            loads.append(spec)
        time.sleep(LOAD_S)   # on the tokenizer thread, as an HF tokenizer's load takes time
        return real(spec)

    monkeypatch.setattr(locality, "load_tokenizer", slow_load)
    async with mesh(2, prefix_locality="precise",
                    prefix_tokenizers=(f"{MODEL}=sim",)) as (router, _nodes):
        async with grpc.aio.insecure_channel(router.address) as ch:
            stub = inference_pb2_grpc.InferenceStub(ch)

            async def one(i: int) -> None:
                await stub.Generate(inference_pb2.GenerateRequest(
                    model=MODEL, text=f"{SYSTEM} tenant {i % 4} asks question {i}",
                    sampling=inference_pb2.SamplingParams(max_tokens=2)), timeout=120)

            await asyncio.gather(*(one(i) for i in range(BURST)))
        # the one loaded tokenizer serves the requests: prompts get their block hashes
        count, hashes = await router.locality.hashes(
            inference_pb2.GenerateRequest(model=MODEL, text=SYSTEM), MODEL)
        assert count > 0 and hashes
    assert loads == ["sim"]
