"""A real SMG gateway (smg 1.13.0, gRPC mode) routes OpenAI completions to two gpumesh sim
nodes over their VllmEngine service; SMG tokenizes and detokenizes with the tiny model's
tokenizer, so the sim emits ids inside that vocab (SimEngineConfig.vocab_size/eos_token_id)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest

from gpumesh.node.engines.base import EngineRequest, Sampling
from gpumesh.node.engines.sim import SimEngine
from tests.interop.smgproc import complete, sim_config, smg_over_sim_nodes

pytestmark = [pytest.mark.slow]
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
async def fleet(tiny_model_dir: Path, smg_exe: Path):
    # cache_aware (SMG's default) is the policy that subscribes to SubscribeKvEvents.
    async with smg_over_sim_nodes(smg_exe, tiny_model_dir, "smg-sim") as pair:
        yield pair


async def _expected(model_dir: Path, prompt: str, max_tokens: int) -> str:
    """What the sim generates for SMG's token ids, detokenized as SMG does."""
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(prompt).ids
    sim = SimEngine(dataclasses.replace(sim_config(model_dir), time_scale=0.0))
    await sim.start()
    out: list[int] = []
    async for o in sim.generate(EngineRequest("x", tuple(ids), Sampling(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))):
        out.extend(o.token_ids)
    await sim.shutdown()
    # Random byte-level ids may end inside a UTF-8 character: SMG's incremental detokenizer
    # holds such trailing bytes back (as vLLM's does) where a one-shot decode shows U+FFFD.
    return tok.decode(out, skip_special_tokens=True).rstrip("\ufffd")


def _body(model_dir: Path, prompt: str, max_tokens: int, stream: bool = True) -> dict:
    return {"model": str(model_dir), "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


async def test_streams_through_smg_are_correct(fleet, tiny_model_dir):
    smg, _ = fleet
    prompt = "The quick brown fox jumps over the lazy dog."
    got = await asyncio.to_thread(complete, smg.base, _body(tiny_model_dir, prompt, 32))
    assert got.finish_reason == "length"
    assert len([p for p in got.pieces if p]) > 1          # really streamed, in pieces
    assert got.text == await _expected(tiny_model_dir, prompt, 32)
    unary = await asyncio.to_thread(complete, smg.base,
                                    _body(tiny_model_dir, prompt, 32, stream=False))
    assert unary.text == got.text
    assert unary.usage["completion_tokens"] == 32


async def test_both_nodes_get_traffic(fleet, tiny_model_dir):
    smg, nodes = fleet
    before = [n.engine.stats.finished for n in nodes]
    # Prompts with no common prefix: SMG's cache_aware policy keeps prompts that share one on
    # the node that has it cached (all 8 once went to one node), and spreads the others.
    words = ["apple", "bridge", "cloud", "delta", "ember", "forest", "granite", "harbor",
             "island", "jungle", "kettle", "lantern", "meadow", "nickel", "orchard", "pebble"]
    prompts = [f"{w} {i * 7} stands apart from every other prompt here." for i, w in
               enumerate(words)]
    got = await asyncio.gather(*(asyncio.to_thread(
        complete, smg.base, _body(tiny_model_dir, p, 24)) for p in prompts))
    for p, g in zip(prompts, got):
        assert g.finish_reason == "length"
        assert g.text == await _expected(tiny_model_dir, p, 24)
    served = [n.engine.stats.finished - b for n, b in zip(nodes, before)]
    assert sum(served) == len(prompts) and min(served) > 0, served
    assert all(n.state.ledger.in_flight == 0 for n in nodes)


async def test_smg_reads_the_pushed_load_records(fleet):
    smg, _ = fleet
    workers = (await asyncio.to_thread(smg.get_json, "/workers"))["workers"]
    assert len(workers) == 2
    for w in workers:
        assert w["runtime_type"] == "vllm"
        # "pushed": SMG took the load from our SubscribeKvEvents records, not a GetLoads poll.
        assert w["engine_load"]["version"] == "pushed", w
        assert w["engine_load"]["loads"][0]["max_running_requests"] == 1024
