"""The simulated engine's parameters (``SimEngineConfig``) and counters (``SimStats``); the
package docstring describes the model they parameterise."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumesh.profiles import EngineProfile, ProfileError, builtin_names, builtin_profile
from gpumesh.sim_tokenizer import SIM_VOCAB_SIZE as VOCAB_SIZE


@dataclass(frozen=True)
class SimEngineConfig:
    """Parameters of one simulated engine. Times in ms, capacities in tokens."""

    model_name: str = "sim-qwen2.5-0.5b"
    aliases: tuple[str, ...] = ()
    max_context_length: int = 8704
    capacity_weight: float = 1.0
    speed: float = 1.0  # GPU speed factor: step time is divided by it
    time_scale: float = 1.0  # wall-clock seconds per simulated second; 0 = no sleeping
    kv_capacity_tokens: int = 10_200_000
    kv_block_size: int = 16
    step_a_ms: float = 2.29  # the 0.5B shape (package docstring: calibration)
    step_b_decode_ms: float = 0.0242
    step_b_prefill_ms: float = 0.00612
    # quadratic decode term (ms per decode token squared): large batches of a big model cost
    # more than linearly (attention over many sequences); 0 = the linear model
    step_c_decode_ms: float = 0.0
    # attention terms (gpumesh.profiles): ms per context token the step's decoding sequences
    # hold, and per (prompt token, earlier token) pair its prefill chunks attend over; 0 = off
    step_b_decode_context_ms: float = 0.0
    step_c_prefill_ms: float = 0.0
    front_end_tokens_per_s: float = 0.0  # node front-end ceiling (package docstring); 0 = none
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 16384
    seed: int = 0
    eos_probability: float = 0.0  # per generated token, unless ignore_eos
    # Token ids are drawn from [0, vocab_size). A gateway that detokenizes the ids itself with
    # a real tokenizer (SMG over VllmEngine gRPC) needs them inside that tokenizer's vocab:
    # set vocab_size to it, and eos_token_id to its EOS (never drawn, only emitted by the EOS
    # draw). eos_token_id -1 = vocab_size (outside the sampled range).
    vocab_size: int = VOCAB_SIZE
    eos_token_id: int = -1
    rate_window_s: float = 5.0  # wall-clock window of the load() rates
    # LoRA adapters (adapters.py): adapters held at once (LRU), simulated ms to load one
    max_loras: int = 2
    adapter_load_ms: float = 20.0
    # vLLM's automatic prefix caching (prefix_cache.py): cached prompt blocks skip prefill
    prefix_caching: bool = True
    # bytes of KV cache per token (the profile's kv.bytes_per_token): what moving a prompt's
    # KV to another engine transfers (the fleet simulator's disaggregated serving); 0 =
    # unknown. The 0.5B shape: 2 x 24 layers x 2 KV heads x 64 x 2 bytes (bfloat16)
    kv_bytes_per_token: int = 12288

    def __post_init__(self) -> None:
        if self.speed <= 0:
            raise ValueError("speed must be > 0")
        if self.time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        if self.front_end_tokens_per_s < 0:
            raise ValueError("front_end_tokens_per_s must be >= 0 (0 = no ceiling)")
        if self.kv_block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("kv_block_size, max_num_seqs, max_num_batched_tokens must be >= 1")
        if self.kv_capacity_tokens // self.kv_block_size * self.kv_block_size < self.max_context_length:
            # vLLM refuses to start in this case too: one full-length request must always fit.
            raise ValueError("kv_capacity_tokens must hold at least max_context_length tokens")
        if not 0.0 <= self.eos_probability <= 1.0:
            raise ValueError("eos_probability must be in [0, 1]")
        if self.kv_bytes_per_token < 0:
            raise ValueError("kv_bytes_per_token must be >= 0 (0 = unknown)")
        if self.vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")

    @property
    def eos(self) -> int:
        """The EOS token id the simulator emits (see ``eos_token_id``)."""
        return self.vocab_size if self.eos_token_id < 0 else self.eos_token_id

    @classmethod
    def from_profile(cls, profile: EngineProfile, **overrides: Any) -> SimEngineConfig:
        """A simulated engine that performs as ``profile`` says (gpumesh.profiles): its step
        model, scheduler limits, KV cache, prefix caching and front-end ceiling.
        ``model_name`` is ``"sim-"`` + the profile model's last path part (the profile's name
        without a model); ``overrides`` win over everything. The profile's
        ``request_overhead_ms`` has no counterpart here: the simulator models the steps."""
        model = Path(profile.model.rstrip("/")).name if profile.model else profile.name
        fields: dict[str, Any] = {
            "model_name": f"sim-{model}",
            "max_context_length": profile.max_model_len,
            "kv_capacity_tokens": profile.kv_capacity_tokens,
            "kv_block_size": profile.kv_block_size,
            "prefix_caching": profile.prefix_caching,
            "kv_bytes_per_token": profile.kv_bytes_per_token,
            "step_a_ms": profile.a_ms,
            "step_b_decode_ms": profile.b_decode_ms,
            "step_c_decode_ms": profile.c_decode_ms,
            "step_b_prefill_ms": profile.b_prefill_ms,
            "step_b_decode_context_ms": profile.b_decode_context_ms,
            "step_c_prefill_ms": profile.c_prefill_ms,
            "front_end_tokens_per_s": profile.front_end_tokens_per_s,
            "max_num_seqs": profile.max_num_seqs,
            "max_num_batched_tokens": profile.max_num_batched_tokens,
        }
        return cls(**{**fields, **overrides})

    @classmethod
    def for_shape(cls, shape: str, **overrides: Any) -> SimEngineConfig:
        """``from_profile`` of the built-in profile ``shape`` (``gpumesh.profiles.builtin_names``:
        ``"0.5b"``, ``"7b"`` measured through a node, ``"0.5b-h200"``, ``"7b-h200"`` on the
        bare engine, ...); ``ValueError`` for an unknown one."""
        try:
            profile = builtin_profile(shape)
        except ProfileError as e:
            raise ValueError(f"unknown shape {shape!r}; known: {builtin_names()}") from e
        return cls.from_profile(profile, **overrides)


@dataclass(frozen=True)
class SimStats:
    """Cumulative counters, in SIMULATED seconds (wall-clock = simulated * time_scale)."""

    steps: int
    busy_s: float
    generated_tokens: int
    prefill_tokens: int
    preemptions: int
    finished: int
    aborted: int
