"""A fresh vLLM CPU engine survives a short first prompt.

vllm-cpu 0.32 skips its warm-up pass in eager mode with an explicit KV size, and its
attention kernel uses AMX tiles without asking Linux for them; on a CPU with AMX (Sapphire
Rapids, as on these machines) a few-token first prompt then killed the worker with SIGILL and
every later request failed with EngineDeadError.
gpumesh.node.engines.vllm.worker.WorkerSetup requests AMX in the worker before the engine
serves. Its own engine (the session's has served other requests
first), on core 1 next to the session engine's core 0. On a CPU without AMX the kernel is not
used and this checks only that the engine serves.
"""

from __future__ import annotations

import pytest

from gpumesh.node.engines.base import EngineRequest, Finish, Sampling
from gpumesh.node.engines.vllm import VllmEngine, VllmEngineConfig
from gpumesh.node.engines.vllm.engine_args import engine_kwargs


@pytest.mark.vllm
async def test_a_short_first_prompt_on_a_fresh_engine_is_served(tiny_model_dir, monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    config = VllmEngineConfig(model=str(tiny_model_dir), served_name="tiny", max_model_len=256,
                              num_gpu_blocks_override=8, enforce_eager=True)
    assert engine_kwargs(config)["worker_extension_cls"] == "gpumesh.node.engines.vllm.worker.WorkerSetup"
    engine = VllmEngine(config)
    await engine.start()
    try:
        ids = tuple(engine.tokenize("hi"))
        assert 0 < len(ids) <= 4
        outs = [o async for o in engine.generate(EngineRequest(
            "first", ids, Sampling(max_tokens=2, temperature=0.0, ignore_eos=True)))]
        assert sum(len(o.token_ids) for o in outs) == 2
        assert outs[-1].finish == Finish.LENGTH
        # and it keeps serving
        outs = [o async for o in engine.generate(EngineRequest(
            "second", ids, Sampling(max_tokens=1, temperature=0.0, ignore_eos=True)))]
        assert outs[-1].finish == Finish.LENGTH
    finally:
        await engine.shutdown()
