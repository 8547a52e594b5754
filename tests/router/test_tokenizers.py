"""router.tokenizers.RouterTokenizers on the real tiny-model HF tokenizer: prefix hashing and a
stock worker naming the same tokenizer share one object, loaded once however many callers
arrive during the load; a stock worker's copy gets its stream decoder; a failed load leaves
a model without a tokenizer (prefix hashing) or raises (a stock worker), and is tried again
later; a model with no node known yet is not decided."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from gpumesh.router import tokenizers
from gpumesh.router.tokenizers import RouterTokenizers, SimPromptTokenizer, Tokenizer
from gpumesh.sim_tokenizer import SimTokenizer


def _counting(monkeypatch: pytest.MonkeyPatch, hold_s: float = 0.0) -> list[str]:
    loads: list[str] = []
    lock = threading.Lock()
    real = tokenizers.load_tokenizer

    def load(spec: str) -> tokenizers.PromptTokenizer:
        with lock:
            loads.append(spec)
        time.sleep(hold_s)
        return real(spec)

    monkeypatch.setattr(tokenizers, "load_tokenizer", load)
    return loads


async def test_hashing_and_a_stock_worker_share_one_load(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tiny_model_dir)
    loads = _counting(monkeypatch, hold_s=0.3)
    toks = RouterTokenizers({"m": path}, engine_of=lambda model: "vllm")
    try:
        got = await asyncio.gather(*(toks.prompt_tokenizer("m") for _ in range(6)),
                                   *(toks.worker_tokenizer(path) for _ in range(3)))
        assert loads == [path]
        assert all(t is got[0] for t in got)
        tok = got[-1]
        assert isinstance(tok, Tokenizer)
        ids = await tok.encode_prompt("the mesh routes tokens")
        assert ids and tok.stream_decoder.decode(ids) == tok.decode(ids)
        assert toks.ready("m")
    finally:
        toks.close()


async def test_a_tokenizer_loaded_for_hashing_gains_its_stream_decoder(
        tiny_model_dir: Path) -> None:
    path = str(tiny_model_dir)
    toks = RouterTokenizers({"m": path})
    try:
        hashing = await toks.prompt_tokenizer("m")
        assert isinstance(hashing, Tokenizer)
        with pytest.raises(RuntimeError, match="without a stream decoder"):
            hashing.stream_decoder   # noqa: B018 - the property raises
        worker = await toks.worker_tokenizer(path)
        assert worker is hashing
        assert worker.stream_decoder.decode(worker.encode("hello")) == "hello"
    finally:
        toks.close()


async def test_failed_loads(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-tokenizer")
    toks = RouterTokenizers({"m": missing})
    try:
        assert await toks.prompt_tokenizer("m") is None   # no locality for it, logged
        assert toks.ready("m")
        with pytest.raises(Exception):
            await toks.worker_tokenizer(missing)
        with pytest.raises(Exception):   # not remembered as loaded: tried again
            await toks.worker_tokenizer(missing)
    finally:
        toks.close()


async def test_models_by_engine() -> None:
    engines = {"simulated": "sim", "real": "vllm"}
    toks = RouterTokenizers(engine_of=lambda model: engines.get(model, ""))
    try:
        assert await toks.prompt_tokenizer("unknown") is None
        assert not toks.ready("unknown")   # no node yet: decided when one registers
        assert await toks.prompt_tokenizer("real") is None   # vLLM without a configured spec
        assert toks.ready("real")
        sim = await toks.prompt_tokenizer("simulated")
        assert isinstance(sim, SimPromptTokenizer)
        chat = [("system", "be brief"), ("user", "hello " * 400)]
        assert await sim.render_chat_prompt(chat) == SimTokenizer().render_chat(chat)
        toks.models_changed(frozenset({"unknown", "simulated"}))
        await asyncio.sleep(0.05)
        assert toks.ready("simulated") and not toks.ready("unknown")
    finally:
        toks.close()
