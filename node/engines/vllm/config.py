"""``VllmEngineConfig``: what the node needs to start one vLLM engine."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class VllmEngineConfig:
    """What the node needs to start one vLLM engine (one GPU or one TP group).

    ``model`` is a local folder (or anything vLLM resolves); with ``load_format="dummy"`` any
    folder holding a config.json and tokenizer works (random weights of that shape).
    ``served_name`` defaults to the folder name. ``max_model_len`` None lets vLLM take the
    model's own limit. ``extra`` holds further ``vllm.AsyncEngineArgs`` fields, passed verbatim
    and winning over the fields above (an escape hatch; prefer a typed field for anything used
    routinely).
    """

    model: str
    served_name: str | None = None
    aliases: tuple[str, ...] = ()
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"  # "dummy": random weights, any local model folder's shapes
    enforce_eager: bool = False
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    stream_interval: int = 1   # vLLM's: an output every N tokens (first and last at once)
    capacity_weight: float = 1.0
    # LoRA (lora.py): vLLM's enable_lora, max_loras (adapters in one batch), max_lora_rank,
    # max_cpu_loras (adapters the engine keeps loaded; 0 = max_loras)
    enable_lora: bool = False
    max_loras: int = 2
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    # Publish vLLM's KV-cache events to the node (kv_events.py): prefix-cache state for routers
    kv_events: bool = False
    # Disaggregated prefill/decode (kv_transfer.py): "both" (no KV connector), "prefill" or
    # "decode" (vLLM's NixlConnector); the NIXL side channel's host (what other nodes reach
    # this one at) and port (0: a free one at start)
    role: str = "both"
    kv_side_channel_host: str = "127.0.0.1"
    kv_side_channel_port: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @property
    def name(self) -> str:
        return self.served_name or Path(self.model.rstrip("/")).name or self.model
