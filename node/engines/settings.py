"""The node's ``[engine]`` section: which engine, which model, and how vLLM is started
(gpumesh.node.app.build_engine; gpumesh calibrate reads the same section)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from gpumesh.config import SECTION, KeyValues, StrList


class EngineSettings(BaseModel):
    """The engine behind the node and the model it serves."""

    model_config = SECTION

    kind: Literal["vllm", "sim"] = Field(
        "vllm", description="vllm (a real engine; needs model) or sim (the simulator).")
    model: str = Field("", description="Model folder (vllm) or name (sim).")
    served_name: str = Field("", description="Name clients ask for; empty: the model folder's "
                                             "name.")
    aliases: StrList = Field((), description="More names the model answers to.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs of one tensor-parallel group.")
    max_model_len: int = Field(0, ge=0, description="Context length; 0 = the model's own.")
    dtype: str = Field("auto", description="vLLM dtype (auto, bfloat16, float16, ...).")
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1, allow_inf_nan=False,
        description="Fraction of GPU memory vLLM may use.")
    load_format: str = Field("auto", description="vLLM load format; dummy: random weights "
                                                 "from config.json.")
    tokenizer: str = Field("", description="Tokenizer path or name; empty: the model's.")
    enforce_eager: bool = Field(False, description="No CUDA graphs (faster start, slower steps).")
    num_gpu_blocks_override: int = Field(0, ge=0,
                                         description="KV blocks; 0 = what memory allows.")
    stream_interval: int = Field(
        1, ge=1, description="vLLM emits a request's output every N tokens (the first and the "
                             "last at once): less front-end CPU per token; streams then get "
                             "N-token chunks.")
    engine_args: KeyValues = Field(
        default_factory=dict,
        description="Extra vLLM AsyncEngineArgs fields, passed through (a table).")
    sim: KeyValues = Field(
        default_factory=dict,
        description="Simulator parameters (SimEngineConfig fields: speed, time_scale, "
                    "kv_capacity_tokens, step_a_ms, ...; a table).")
