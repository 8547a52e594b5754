"""The ``AsyncEngineArgs`` fields the node builds for a ``VllmEngineConfig`` (the engine's and a
shared engine core's), with the node's CUDA-graph policy."""

from __future__ import annotations

from typing import Any

from gpumesh.node.engines.vllm.compat import current_platform
from gpumesh.node.engines.vllm.config import VllmEngineConfig
from gpumesh.node.engines.vllm.kv_transfer import default_kv_transfer_config
from gpumesh.node.engines.vllm.worker import WORKER_SETUP

# On CUDA the node asks vLLM for full CUDA graphs on every batch, mixed prefill + decode
# included (vLLM's default, FULL_AND_PIECEWISE, runs full graphs on pure-decode batches only and
# leaves attention outside the graph otherwise). Why: a node fed by a router is refilled
# whenever a stream ends, so most of its steps mix a prefill into the decodes
# (docs/benchmarks-gpu.md compares the modes). Where the attention backend cannot capture
# mixed batches vLLM lowers the mode itself (to FULL_AND_PIECEWISE or FULL_DECODE_ONLY). An
# engine_args compilation_config replaces this one.
CUDA_COMPILATION_CONFIG: dict[str, Any] = {"cudagraph_mode": "FULL"}


def engine_kwargs(c: VllmEngineConfig) -> dict[str, Any]:
    """``AsyncEngineArgs`` fields for ``c`` (the engine's and a SharedEngineCore's)."""
    kwargs: dict[str, Any] = {
        "model": c.model,
        "served_model_name": [c.name, *c.aliases],
        "tokenizer": c.tokenizer,
        "dtype": c.dtype,
        "max_model_len": c.max_model_len,
        "tensor_parallel_size": c.tensor_parallel_size,
        "gpu_memory_utilization": c.gpu_memory_utilization,
        "load_format": c.load_format,
        "enforce_eager": c.enforce_eager,
        "num_gpu_blocks_override": c.num_gpu_blocks_override,
        "enable_prefix_caching": c.enable_prefix_caching,
        "stream_interval": c.stream_interval,
        "disable_log_stats": False,  # our stat logger needs the per-step stats
        "enable_log_requests": False,
    }
    if c.enable_lora:
        kwargs.update(enable_lora=True, max_loras=c.max_loras, max_lora_rank=c.max_lora_rank,
                      max_cpu_loras=c.max_cpu_loras or c.max_loras)
    platform = current_platform()
    if platform.is_cpu():
        kwargs["worker_extension_cls"] = WORKER_SETUP
    elif platform.is_cuda() and not c.enforce_eager:
        kwargs["compilation_config"] = dict(CUDA_COMPILATION_CONFIG)
    # the role's KV connector; an engine_args kv_transfer_config replaces it
    kv = default_kv_transfer_config(c.role, platform.is_cpu())
    if kv is not None:
        kwargs["kv_transfer_config"] = kv
    kwargs.update(c.extra)
    return kwargs
