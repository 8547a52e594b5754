"""LoRA adapters on the real vLLM CPU engine (tiny model, tiny random adapters): an adapter
changes what the model generates, loads on demand once, is reported as loaded with its load
time, and an adapter whose files are gone fails the request (FAILED_PRECONDITION), not the
engine. One LoRA-enabled engine for the module (the shared session engine runs without LoRA).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gpumesh.node.adapters import AdapterCatalog
from gpumesh.node.engines.base import AdapterLoadFailed, EngineRequest, Sampling
from gpumesh.node.errors import from_engine_exception

pytestmark = [pytest.mark.vllm]

GREEDY = Sampling(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = (17, 402, 33, 1005, 61, 7, 250, 12, 99, 808)


@pytest.fixture(scope="module")
async def lora_engine(tiny_model_dir: Path, tiny_adapters: Path, tmp_path_factory):
    pytest.importorskip("vllm")
    from gpumesh.node.engines.vllm import VllmEngine, VllmEngineConfig

    # a third adapter whose folder is deleted once the catalog has listed it
    doomed = tmp_path_factory.mktemp("doomed") / "doomed"
    shutil.copytree(tiny_adapters / "alpha", doomed)
    catalog = AdapterCatalog.from_config({"doomed": str(doomed)}, str(tiny_adapters), 16)
    shutil.rmtree(doomed)
    engine = VllmEngine(VllmEngineConfig(
        model=str(tiny_model_dir), served_name="tiny", max_model_len=256,
        num_gpu_blocks_override=16, enforce_eager=True, enable_lora=True, max_loras=2,
        max_lora_rank=8))
    await engine.start()
    try:
        yield engine, catalog
    finally:
        await engine.shutdown()


async def run(engine, rid: str, adapter=None) -> list[int]:
    out: list[int] = []
    async for o in engine.generate(EngineRequest(rid, PROMPT, GREEDY, adapter)):
        out.extend(o.token_ids)
    return out


async def test_adapters_change_generation_and_load_once(lora_engine) -> None:
    engine, catalog = lora_engine
    assert catalog.names == ("alpha", "beta", "doomed")
    assert engine.load().loaded_adapters == () and engine.load().adapter_load_s == 0.0
    base = await run(engine, "base")
    alpha = await run(engine, "a1", catalog.get("alpha"))
    load = engine.load()
    assert load.loaded_adapters == ("alpha",) and load.adapter_load_s > 0
    assert await run(engine, "a2", catalog.get("alpha")) == alpha   # held: same greedy output
    beta = await run(engine, "b1", catalog.get("beta"))
    assert engine.load().loaded_adapters == ("alpha", "beta")
    assert len(base) == len(alpha) == len(beta) == 12
    assert alpha != base and beta != base and alpha != beta
    assert await run(engine, "base2") == base    # the base model is untouched


async def test_missing_adapter_files_fail_the_request_not_the_engine(lora_engine) -> None:
    engine, catalog = lora_engine
    with pytest.raises(AdapterLoadFailed) as e:
        await run(engine, "d1", catalog.get("doomed"))
    assert from_engine_exception(e.value).code.name == "FAILED_PRECONDITION"
    assert "doomed" not in engine.load().loaded_adapters
    assert len(await run(engine, "after", catalog.get("alpha"))) == 12
