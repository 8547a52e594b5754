"""The simulated engine's parameters (``SimEngineConfig``) and counters (``SimStats``); the
package docstring describes the model they parameterise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VOCAB_SIZE = 32_000


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
        if self.vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")

    @property
    def eos(self) -> int:
        """The EOS token id the simulator emits (see ``eos_token_id``)."""
        return self.vocab_size if self.eos_token_id < 0 else self.eos_token_id

    @classmethod
    def for_shape(cls, shape: str, **overrides: Any) -> SimEngineConfig:
        """Calibrated defaults for ``"0.5b"``, ``"7b"`` (measured through a node) or
        ``"0.5b-h200"``, ``"7b-h200"`` (the bare engine); see the package docstring."""
        shapes: dict[str, dict[str, Any]] = {
            "0.5b": {},
            "7b": {
                "model_name": "sim-qwen2.5-7b",
                "kv_capacity_tokens": 1_910_000,
                "step_a_ms": 4.74,
                "step_b_decode_ms": 0.0109,
                "step_b_prefill_ms": 0.0241,
            },
            # Fitted on the bare engine (no node around it): decode step = elapsed / 256 of B
            # requests decoding together, B = 1..512; prefill = the slope of one request's
            # TTFT over 128..8192 prompt tokens (the package docstring: calibration).
            "0.5b-h200": {
                "step_a_ms": 2.742,
                "step_b_decode_ms": 0.03205,
                "step_b_prefill_ms": 0.0063,
            },
            "7b-h200": {
                "model_name": "sim-qwen2.5-7b",
                "kv_capacity_tokens": 1_910_000,
                "step_a_ms": 4.799,
                "step_b_decode_ms": 0.01107,
                "step_c_decode_ms": 3.636e-5,
                "step_b_prefill_ms": 0.02367,
            },
        }
        if shape.lower() not in shapes:
            raise ValueError(f"unknown shape {shape!r}; known: {sorted(shapes)}")
        return cls(**{**shapes[shape.lower()], **overrides})


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
