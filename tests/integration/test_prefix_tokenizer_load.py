"""A router loads a model's prefix tokenizer when the model first registers, once: not on the
first request (an HF tokenizer of a large vocabulary takes seconds to load, and every request
that arrives meanwhile waits for it), and not once per request of a burst that arrives while
it loads (a load each would queue on the serial tokenizer thread ahead of every prompt's
tokenization)."""

from __future__ import annotations

import asyncio
import threading
import time

from pathlib import Path

import grpc
import pytest

from gpumesh.router import tokenizers
from gpumesh.v1 import inference_pb2, inference_pb2_grpc
from tests.integration.test_prefix_locality import MODEL, SYSTEM, mesh, wait_for

BURST = 16
LOAD_S = 0.5   # the load under test is held this long, so the whole burst arrives during it


async def test_a_burst_of_first_requests_loads_the_tokenizer_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[str] = []
    lock = threading.Lock()
    real = tokenizers.load_tokenizer

    def slow_load(spec: str) -> tokenizers.PromptTokenizer:
        with lock:
            loads.append(spec)
        time.sleep(LOAD_S)   # on the tokenizer thread, as an HF tokenizer's load takes time
        return real(spec)

    monkeypatch.setattr(tokenizers, "load_tokenizer", slow_load)
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


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float, float]]:
    """Records each tokenizer load as (spec, start, end) on the monotonic clock."""
    loads: list[tuple[str, float, float]] = []
    real = tokenizers.load_tokenizer

    def load(spec: str) -> tokenizers.PromptTokenizer:
        t0 = time.monotonic()
        tok = real(spec)
        loads.append((spec, t0, time.monotonic()))
        return tok

    monkeypatch.setattr(tokenizers, "load_tokenizer", load)
    return loads


async def test_a_model_s_tokenizer_loads_when_the_model_registers(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loads = _recording(monkeypatch)
    async with mesh(2, prefix_locality="approximate",
                    prefix_tokenizers=(f"{MODEL}={tiny_model_dir}",)) as (router, _nodes):
        # no request is sent: the nodes' registration alone loads the real HF tokenizer
        await wait_for(lambda: router.tokenizers.ready(MODEL), timeout=120)
        assert [spec for spec, _, _ in loads] == [str(tiny_model_dir)]
        count, hashes = await router.locality.hashes(
            inference_pb2.GenerateRequest(model=MODEL, text=SYSTEM), MODEL)
        assert count > 0 and hashes
        assert len(loads) == 1


async def test_a_burst_to_a_router_that_has_just_met_its_model(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """48 concurrent requests of 8 tenants the moment the nodes have registered: every one
    completes and is routed with its prompt's block hashes (the router's approximate record
    holds each tenant's prefix afterwards), from the one load that registration started."""
    loads = _recording(monkeypatch)
    tenants = 8
    async with mesh(2, prefix_locality="approximate",
                    prefix_tokenizers=(f"{MODEL}={tiny_model_dir}",)) as (router, _nodes):
        # registration alone started the load: no request has been sent yet
        assert router.tokenizers.started(MODEL)
        async with grpc.aio.insecure_channel(router.address) as ch:
            stub = inference_pb2_grpc.InferenceStub(ch)

            async def one(i: int) -> None:
                await stub.Generate(inference_pb2.GenerateRequest(
                    model=MODEL, text=f"tenant {i % tenants} {SYSTEM} question {i}",
                    sampling=inference_pb2.SamplingParams(max_tokens=2)), timeout=120)

            await asyncio.gather(*(one(i) for i in range(48)))
        assert len(loads) == 1
        assert loads[0][0] == str(tiny_model_dir)
        index = router.locality.indexes.get(MODEL)
        assert index is not None
        for t in range(tenants):
            _, hashes = await router.locality.hashes(inference_pb2.GenerateRequest(
                model=MODEL, text=f"tenant {t} {SYSTEM} another question"), MODEL)
            assert index.match(hashes, router.locality.clock()), f"tenant {t} not recorded"
