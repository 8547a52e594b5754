"""LoRA adapters on the node without vLLM: the tiny adapter builder, the adapter catalog (what a
node serves, what it refuses), the simulated adapter cache, and a simulated node end to end
(NOT_FOUND for an adapter it can never serve, loaded adapters and load time in its report)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from gpumesh.client import MeshClient, build_request
from gpumesh.node.adapters import AdapterCatalog, AdapterError
from gpumesh.node.app import NodeServer
from gpumesh.node.config import NodeConfig
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig
from gpumesh.node.engines.sim.adapters import SimAdapters
from gpumesh.tiny_adapter import ADAPTER_FILES, build_tiny_adapter


def test_tiny_adapter_is_peft_lora_for_the_tiny_model(tmp_path: Path) -> None:
    from safetensors import safe_open

    a = build_tiny_adapter(tmp_path / "a", seed=1, base_model_dir="/m")
    b = build_tiny_adapter(tmp_path / "b", seed=1)
    assert sorted(p.name for p in a.iterdir()) == sorted(ADAPTER_FILES)
    cfg = json.loads((a / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["target_modules"]) == ("LORA", 8, ["q_proj", "v_proj"])
    with safe_open(str(a / "adapter_model.safetensors"), "pt") as f:
        keys = sorted(f.keys())
        shapes = {k: tuple(f.get_tensor(k).shape) for k in keys}
    assert len(keys) == 2 * 2 * 2   # layers x modules x (A, B)
    assert shapes["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] == (8, 128)
    assert shapes["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"] == (64, 8)
    same = (a / "adapter_model.safetensors").read_bytes() == \
        (b / "adapter_model.safetensors").read_bytes()
    assert same   # a pure function of the seed


def test_catalog_from_a_folder_and_explicit_entries(tmp_path: Path) -> None:
    build_tiny_adapter(tmp_path / "dir" / "alpha", seed=1)
    build_tiny_adapter(tmp_path / "dir" / "beta", seed=2)
    (tmp_path / "dir" / "not-an-adapter").mkdir()
    build_tiny_adapter(tmp_path / "big", seed=3, rank=32)
    build_tiny_adapter(tmp_path / "gamma", seed=4)
    cat = AdapterCatalog.from_config({"gamma": str(tmp_path / "gamma"),
                                      "big": str(tmp_path / "big"),
                                      "gone": str(tmp_path / "missing")},
                                     str(tmp_path / "dir"), max_lora_rank=16)
    # rank 32 > 16 and a folder without adapter_config.json can never load: not served
    assert cat.names == ("alpha", "beta", "gamma")
    refs = [cat.get(n) for n in cat.names]
    assert [r.int_id for r in refs] == [1, 2, 3]
    assert refs[2].path == str((tmp_path / "gamma").resolve())
    assert cat.get("big") is None and cat.get("gone") is None
    assert not AdapterCatalog.from_config({}, "", 16)


@pytest.mark.parametrize("adapters, adapter_dir", [
    ({"bad name": "/x"}, ""),
    ({}, "/definitely/not/a/folder"),
])
def test_catalog_refuses_bad_configuration(adapters, adapter_dir, tmp_path: Path) -> None:
    build_tiny_adapter(tmp_path / "x", seed=1)
    adapters = {k: str(tmp_path / "x") for k in adapters}
    with pytest.raises(AdapterError):
        AdapterCatalog.from_config(adapters, adapter_dir, 16)


async def test_sim_adapter_cache_loads_once_and_evicts_lru() -> None:
    cache = SimAdapters(slots=2, load_ms=30.0, time_scale=1.0)
    await asyncio.gather(*(cache.acquire("a") for _ in range(5)))   # one shared load
    assert (cache.loads, cache.loaded) == (1, ("a",))
    await cache.acquire("b")
    await cache.acquire("a")          # a is now the most recent
    await cache.acquire("c")          # evicts b
    assert cache.loaded == ("a", "c") and cache.evictions == 1 and cache.loads == 3
    assert cache.load_s == pytest.approx(0.03, abs=0.02)


async def test_sim_node_serves_its_adapters_and_reports_them(tiny_adapters: Path) -> None:
    node = NodeServer(NodeConfig(engine={"kind": "sim"},
                                 serving={"port": 0, "node_id": "lora-sim"},
                                 lora={"adapter_dir": str(tiny_adapters), "max_loras": 1}),
                      SimEngine(SimEngineConfig(model_name="sim", time_scale=1.0,
                                                max_loras=1, adapter_load_ms=40.0)))
    await node.start()
    try:
        assert node.registration().models[0].adapters == ("alpha", "beta")
        assert node.load_report().loaded_adapters == ()
        async with MeshClient(f"127.0.0.1:{node.port}") as client:
            listed = await client.list_models(timeout=10)
            assert list(listed.models[0].adapters) == ["alpha", "beta"]
            resp = await client.generate(build_request("hi", max_tokens=3, adapter="alpha"),
                                         timeout=10)
            assert resp.usage.completion_tokens == 3
            report = node.load_report()
            assert report.loaded_adapters == ("alpha",) and report.adapter_load_s > 0.02
            await client.generate(build_request("hi", max_tokens=3, adapter="beta"), timeout=10)
            assert node.load_report().loaded_adapters == ("beta",)   # one slot: LRU
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.generate(build_request("hi", max_tokens=3, adapter="zeta"),
                                      timeout=10)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert "alpha, beta" in (e.value.details() or "")
    finally:
        await node.stop()
