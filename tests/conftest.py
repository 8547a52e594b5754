"""Session-wide fixtures: the tiny model and one real vLLM CPU engine shared by all tests.

The engine starts once per session (~20-30 s on CPU); tests that use it must leave it idle
(every request finished or aborted) when they end.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

# vLLM's CPU backend: 1 GiB of KV cache, one OpenMP thread pinned to core 0 (the machine is
# shared). Set before anything imports vllm.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TINY_MODEL = REPO_ROOT / "models" / "tiny"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """A local model folder vLLM can load: $GPUMESH_TINY_MODEL if it holds a model (used
    as is), else the tiny random model built (once, idempotently) into models/tiny."""
    from gpumesh.tiny_model import build_tiny_model

    override = os.environ.get("GPUMESH_TINY_MODEL")
    if override and (Path(override) / "config.json").is_file():
        return Path(override)
    return build_tiny_model(override or DEFAULT_TINY_MODEL)


@pytest.fixture(scope="session")
def tiny_adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of two tiny random LoRA adapters for the tiny model (PEFT format, rank 8):
    ``alpha`` (seed 1) and ``beta`` (seed 2), a node's ``adapter_dir``."""
    from gpumesh.tiny_adapter import build_tiny_adapter

    root = tmp_path_factory.mktemp("adapters")
    build_tiny_adapter(root / "alpha", seed=1)
    build_tiny_adapter(root / "beta", seed=2)
    return root


@pytest.fixture(scope="session")
async def vllm_engine(tiny_model_dir: Path) -> AsyncIterator[object]:
    """One started ``VllmEngine`` on the tiny model for the whole session.

    max_model_len 512 and 16 KV blocks (2048 tokens on CPU, 128-token blocks): KV usage is
    visible per request, and at most 4 full-length requests fit at once. stream_interval 3:
    the engine hands over tokens 3 at a time (the node processes in tests/node keep vLLM's
    default of 1, so both paths are exercised).
    """
    pytest.importorskip("vllm")
    from gpumesh.node.engines.vllm import VllmEngine, VllmEngineConfig

    engine = VllmEngine(VllmEngineConfig(
        model=str(tiny_model_dir), served_name="tiny", aliases=("tiny-alias",),
        max_model_len=512, num_gpu_blocks_override=16, enforce_eager=True, stream_interval=3,
    ))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()
