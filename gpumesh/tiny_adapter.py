"""A tiny random-weight LoRA adapter for the tiny model (:mod:`gpumesh.tiny_model`), in PEFT's
on-disk format, built in well under a second without PEFT.

``build_tiny_adapter(out_dir, seed)`` writes the two files vLLM's ``LoRARequest`` loads:

- ``adapter_config.json``: ``peft_type`` LORA, rank ``rank`` (default 8), ``lora_alpha``
  2 x rank, target modules ``q_proj`` / ``v_proj`` of every layer, no bias, no dropout.
- ``adapter_model.safetensors``: ``base_model.model.model.layers.<i>.self_attn.<m>.lora_A.weight``
  (rank x in) and ``...lora_B.weight`` (out x rank), random from ``torch.manual_seed(seed)``.
  Unlike a freshly initialised PEFT adapter (B = 0, a no-op), B is random too, so the adapter
  visibly changes what the model generates.

The output is a pure function of ``seed`` and ``rank``. The shapes follow the tiny model's
config (hidden 128, 2 heads of 64, 1 KV head, 2 layers); ``base_model_dir`` is written into
the config as ``base_model_name_or_path`` when given.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpumesh import tiny_model

__all__ = ["ADAPTER_FILES", "build_tiny_adapter"]

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
TARGET_MODULES = ("q_proj", "v_proj")


def build_tiny_adapter(out_dir: str | Path, seed: int = 0, rank: int = 8,
                       base_model_dir: str | Path | None = None) -> Path:
    """Writes the adapter into ``out_dir`` (created; files overwritten) and returns its path.
    Blocking (torch, ~0.1 s): call it via ``asyncio.to_thread`` from async code."""
    import torch
    from safetensors.torch import save_file

    if rank < 1:
        raise ValueError("rank must be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hidden = tiny_model._HIDDEN
    head_dim = hidden // tiny_model._HEADS
    out_dims = {"q_proj": tiny_model._HEADS * head_dim, "v_proj": tiny_model._KV_HEADS * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(tiny_model._LAYERS):
        for module in TARGET_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(rank, hidden, generator=gen) * 0.5
            b = torch.randn(out_dims[module], rank, generator=gen) * 0.5
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": str(base_model_dir) if base_model_dir else None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n",
                                             encoding="utf-8")
    return out
