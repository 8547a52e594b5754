"""Static facts about the engine and the model that GetModelInfo and GetServerInfo report."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumesh.node.engines.base import Engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLimits:
    """What the engine's own config says about its scheduler (0 = unknown)."""

    max_num_seqs: int = 0
    kv_block_size: int = 0
    kv_capacity_tokens: int = 0
    vocab_size: int = 0
    eos_token_id: int | None = None


def engine_limits(engine: Engine) -> EngineLimits:
    """Duck-typed read of ``engine.config`` (the simulator's ``SimEngineConfig`` carries all of
    it; the vLLM engine's config none of it)."""
    cfg = getattr(engine, "config", None)
    eos = getattr(cfg, "eos", None)
    return EngineLimits(
        max_num_seqs=int(getattr(cfg, "max_num_seqs", 0) or 0),
        kv_block_size=int(getattr(cfg, "kv_block_size", 0) or 0),
        kv_capacity_tokens=int(getattr(cfg, "kv_capacity_tokens", 0) or 0),
        vocab_size=int(getattr(cfg, "vocab_size", 0) or 0),
        eos_token_id=int(eos) if isinstance(eos, int) else None)


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def model_file_facts(model_path: str) -> dict[str, Any]:
    """GetModelInfo fields read from a local model folder's ``config.json`` (empty when there
    is none). Blocking file I/O: call through ``asyncio.to_thread``."""
    p = Path(model_path) / "config.json" if model_path else None
    if p is None or not p.is_file():
        return {}
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        log.warning("unreadable %s; GetModelInfo answers without it", p, exc_info=True)
        return {}
    facts: dict[str, Any] = {
        "vocab_size": int(cfg.get("vocab_size") or 0),
        "model_type": str(cfg.get("model_type") or ""),
        "architectures": [str(a) for a in cfg.get("architectures") or []],
        "eos_token_ids": _ids(cfg.get("eos_token_id")),
    }
    for key in ("bos_token_id", "pad_token_id"):
        if isinstance(cfg.get(key), int):
            facts[key] = cfg[key]
    return facts
