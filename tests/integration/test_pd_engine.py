"""Disaggregated prefill/decode at the engine level: two real vLLM CPU engines (the tiny
model), one with the prefill role's KV connector, one with the decode role's. The same greedy
request, aggregated on the prefill engine vs prefilled there and decoded on the other engine,
gives the same tokens; the decode engine pulled the prompt's KV over NIXL (its connector
counted the transfer) and never saw the prompt before.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gpumesh.node.engines.base import EngineRequest, InvalidRequest, Sampling

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("nixl")


def _config(model: Path, role: str):  # type: ignore[no-untyped-def]
    from gpumesh.node.engines.vllm import VllmEngineConfig

    return VllmEngineConfig(model=str(model), served_name="tiny", max_model_len=512,
                            num_gpu_blocks_override=16, enforce_eager=True, role=role)


@pytest.fixture(scope="module")
async def engines(tiny_model_dir: Path) -> AsyncIterator[tuple[object, object]]:
    """(prefill engine on core 0, decode engine on core 1)."""
    from gpumesh.node.engines.vllm import VllmEngine

    started = []
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    try:
        for core, role in ((0, "prefill"), (1, "decode")):
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)   # read by the engine core
            engine = VllmEngine(_config(tiny_model_dir, role))
            await engine.start()
            started.append(engine)
        yield started[0], started[1]
    finally:
        if saved is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
        for engine in started:
            await engine.shutdown()


async def _tokens(engine, ids: list[int], max_tokens: int,  # type: ignore[no-untyped-def]
                  params: dict | None = None) -> tuple[list[int], dict | None]:
    req = EngineRequest(uuid.uuid4().hex, tuple(ids), Sampling(max_tokens=max_tokens,
                                                               temperature=0.0), None, params)
    out: list[int] = []
    kv = None
    async for o in engine.generate(req):
        out.extend(o.token_ids)
        if o.finish is not None:
            kv = o.kv_transfer_params
    return out, kv


def _cpu_seconds(procs) -> float:  # type: ignore[no-untyped-def]
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except Exception:  # exited meanwhile: psutil.NoSuchProcess
            continue
        total += t.user + t.system
    return total


async def test_idle_engines_leave_the_cores_free(engines) -> None:
    """Idle prefill and decode engines (their engine cores and workers) use almost no CPU.
    NIXL's progress thread polls without pause; the node makes it wait between polls on vLLM
    CPU (kv_transfer's module doc): without that, each of these two workers kept a core busy
    while idle, and the two engines on this 2-core machine starved everything else. Runs
    first in this module, before any request leaves a transfer pending (an engine steps
    until then)."""
    import psutil

    children = psutil.Process().children(recursive=True)
    assert len(children) >= 4   # two engine cores and their workers, at least
    await asyncio.sleep(1.0)
    used, t0 = _cpu_seconds(children), time.monotonic()
    await asyncio.sleep(3.0)
    cores = (_cpu_seconds(children) - used) / (time.monotonic() - t0)
    assert cores < 0.5, f"idle engines used {cores:.2f} cores"


@pytest.mark.parametrize("words", [2, 12, 30])
async def test_disaggregated_tokens_equal_aggregated(engines, words: int) -> None:
    prefill, decode = engines
    ids = prefill.tokenize(f"pd {words} " + "the quick brown fox jumps " * words)
    aggregated, none = await _tokens(prefill, ids, 24)
    assert none is None   # no transfer asked, none reported
    before = decode.kv_transfers
    first, params = await _tokens(prefill, ids, 1, {"do_remote_decode": True})
    assert first == aggregated[:1]
    assert params and params["do_remote_prefill"] is True
    assert params["remote_port"] == prefill.kv_side_channel[1]
    disaggregated, _ = await _tokens(decode, ids, 24, params)
    assert disaggregated == aggregated
    after = decode.kv_transfers
    # the decode engine read the prompt's KV from the prefill engine (full blocks only: a
    # prompt shorter than one block has nothing to pull and is computed on the decode side)
    if len(ids) > 128:
        assert after.transfers > before.transfers and after.bytes > before.bytes
    assert after.failures == before.failures


async def test_bad_params_are_invalid(engines) -> None:
    prefill, _ = engines
    ids = prefill.tokenize("hello")
    with pytest.raises(InvalidRequest, match="do_remote"):
        await _tokens(prefill, ids, 2, {"something": 1})
    with pytest.raises(InvalidRequest, match="remote_engine_id"):
        await _tokens(prefill, ids, 2, {"do_remote_prefill": True})


async def test_engine_without_connector_refuses_params(vllm_engine) -> None:
    ids = vllm_engine.tokenize("hello")
    with pytest.raises(InvalidRequest, match="KV connector"):
        await _tokens(vllm_engine, ids, 2, {"do_remote_decode": True})
