"""What a valid engine profile is (``gpumesh.profiles``): the TOML layout (which key of which
table holds which ``EngineProfile`` attribute) and the checks every profile passes when it is
built or loaded: every number finite and in range, every string bounded, the step model
costing something, each sample complete. A ``ProfileError`` names the offending TOML key
(``step.a_ms``, ``samples[3].batch``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpumesh.profiles import EngineProfile

PLATFORMS = ("cpu", "cuda")
SAMPLE_KINDS = ("decode", "prefill")


class ProfileError(ValueError):
    """A profile that cannot be used; the message starts with the offending key."""


# table -> {TOML key: EngineProfile attribute}
TOML_LAYOUT: dict[str, dict[str, str]] = {
    "engine": {k: k for k in ("name", "platform", "model", "vllm_version", "measured",
                              "source")},
    "scheduler": {k: k for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len")},
    "kv": {"capacity_tokens": "kv_capacity_tokens", "block_size": "kv_block_size",
           "prefix_caching": "prefix_caching", "bytes_per_token": "kv_bytes_per_token"},
    "step": {k: k for k in ("a_ms", "b_decode_ms", "c_decode_ms", "b_prefill_ms",
                            "b_decode_context_ms", "c_prefill_ms")},
    "front_end": {"tokens_per_s": "front_end_tokens_per_s",
                  "request_overhead_ms": "request_overhead_ms",
                  "cpu_request_ms": "front_end_cpu_request_ms",
                  "cpu_output_ms": "front_end_cpu_output_ms",
                  "cpu_message_ms": "front_end_cpu_message_ms",
                  "cpu_prompt_token_ms": "front_end_cpu_prompt_token_ms"},
    "router": {"cpu_request_ms": "router_cpu_request_ms",
               "cpu_message_ms": "router_cpu_message_ms",
               "cpu_prompt_token_ms": "router_cpu_prompt_token_ms"},
}

_INTS: dict[str, int] = {  # attribute -> minimum
    "max_num_seqs": 1, "max_num_batched_tokens": 1, "max_model_len": 1,
    "kv_capacity_tokens": 1, "kv_block_size": 1, "kv_bytes_per_token": 0,
}
_FLOATS = ("a_ms", "b_decode_ms", "c_decode_ms", "b_prefill_ms", "b_decode_context_ms",
           "c_prefill_ms", "front_end_tokens_per_s", "request_overhead_ms",
           "front_end_cpu_request_ms", "front_end_cpu_output_ms", "front_end_cpu_message_ms",
           "front_end_cpu_prompt_token_ms", "router_cpu_request_ms", "router_cpu_message_ms",
           "router_cpu_prompt_token_ms")
_MAX_INT = 1 << 40


def _check_int(key: str, v: Any, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProfileError(f"{key}: must be an integer, got {v!r}")
    if not lo <= v <= _MAX_INT:
        raise ProfileError(f"{key}: must be in [{lo}, {_MAX_INT}], got {v}")


def _check_float(key: str, v: Any, lo: float = 0.0) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ProfileError(f"{key}: must be a number, got {v!r}")
    if not math.isfinite(v) or v < lo or v > 1e12:
        raise ProfileError(f"{key}: must be finite and in [{lo}, 1e12], got {v}")


def _check_str(key: str, v: Any) -> None:
    if not isinstance(v, str) or len(v) > 512:
        raise ProfileError(f"{key}: must be a string of at most 512 characters, got {v!r}")


def validate(p: EngineProfile) -> None:
    """Raise ``ProfileError`` naming the first bad key of ``p`` (TOML key names)."""
    from gpumesh.profiles import Sample  # (profiles imports this module)

    toml_key = {attr: f"{table}.{key}" for table, pairs in TOML_LAYOUT.items()
                for key, attr in pairs.items()}
    for attr in ("name", "model", "vllm_version", "measured", "source"):
        _check_str(toml_key[attr], getattr(p, attr))
    if not p.name:
        raise ProfileError("engine.name: must not be empty")
    if p.platform not in PLATFORMS:
        raise ProfileError(f"engine.platform: must be one of {PLATFORMS}, got {p.platform!r}")
    for attr, lo in _INTS.items():
        _check_int(toml_key[attr], getattr(p, attr), lo)
    for attr in _FLOATS:
        _check_float(toml_key[attr], getattr(p, attr))
    if not isinstance(p.prefix_caching, bool):
        raise ProfileError(f"kv.prefix_caching: must be true or false, got {p.prefix_caching!r}")
    if p.a_ms + p.b_decode_ms + p.b_prefill_ms + p.c_decode_ms <= 0:
        raise ProfileError("step.a_ms: the step model must cost something (all terms are 0)")
    if p.kv_capacity_tokens < p.kv_block_size:
        raise ProfileError("kv.capacity_tokens: must hold at least one block (kv.block_size)")
    for i, s in enumerate(p.samples):
        key = f"samples[{i}]"
        if not isinstance(s, Sample):
            raise ProfileError(f"{key}: must be a Sample, got {type(s).__name__}")
        if s.kind not in SAMPLE_KINDS:
            raise ProfileError(f"{key}.kind: must be one of {SAMPLE_KINDS}, got {s.kind!r}")
        _check_float(f"{key}.measured_ms", s.measured_ms)
        _check_float(f"{key}.fit_ms", s.fit_ms)
        if s.measured_ms <= 0:
            raise ProfileError(f"{key}.measured_ms: must be > 0, got {s.measured_ms}")
        _check_int(f"{key}.batch", s.batch, 1 if s.kind == "decode" else 0)
        _check_int(f"{key}.prompt_tokens", s.prompt_tokens, 1 if s.kind == "prefill" else 0)
        _check_int(f"{key}.cached_tokens", s.cached_tokens, 0)
        _check_int(f"{key}.context_tokens", s.context_tokens, 0)
        if s.cached_tokens > s.prompt_tokens:
            raise ProfileError(f"{key}.cached_tokens: must be <= prompt_tokens")
        if not isinstance(s.held_out, bool):
            raise ProfileError(f"{key}.held_out: must be true or false, got {s.held_out!r}")
