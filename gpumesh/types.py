"""Value types that cross the node <-> router boundary, shared by both sides (no proto types).

:mod:`gpumesh.wire` is the one place that converts them to and from their protobuf messages;
everything else in gpumesh works on these frozen dataclasses. Units are in the field names
(``_s`` seconds, ``_per_s`` per second, ``_bytes`` bytes, ``_tokens`` tokens); fractions are
in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """A model a node serves (``control.proto`` ``ServedModel``).

    ``max_context_length``: prompt + output tokens the engine accepts (0 = unknown).
    ``capacity_weight``: relative capacity, 1.0 = one reference GPU (a TP=2 node or a faster
    GPU declares more)."""

    name: str
    aliases: tuple[str, ...] = ()
    max_context_length: int = 0
    tensor_parallel_size: int = 1
    capacity_weight: float = 1.0
    # LoRA adapters of this model the node can serve (loaded on demand), by request name.
    adapters: tuple[str, ...] = ()


@dataclass(frozen=True)
class GpuSample:
    """One GPU's utilisation (0..1) and memory, as pynvml read it."""

    index: int
    utilization: float
    memory_used_bytes: int
    memory_total_bytes: int


@dataclass(frozen=True)
class RouterAccount:
    """What one router process sent a node, as the node counted it; cumulative since the
    node's incarnation started, so a lost heartbeat loses nothing.

    ``finished_requests``: of the admitted, those that have ended (any way); ``None`` when the
    reporter does not count it (a stock vLLM worker's adapter)."""

    router_id: str
    admitted_requests: int = 0
    admitted_prompt_tokens: int = 0
    first_token_requests: int = 0
    first_token_prompt_tokens: int = 0
    finished_requests: int | None = None

    # The counting, in one place for whoever keeps the account (the node's admission ledger,
    # the router's client of a stock vLLM worker, a merge over a node's front ends).

    def admit(self, prompt_tokens: int, requests: int = 1) -> RouterAccount:
        """This account plus ``requests`` admitted of ``prompt_tokens`` (negative: an admission
        taken back, a request the worker refused)."""
        return RouterAccount(self.router_id, self.admitted_requests + requests,
                             self.admitted_prompt_tokens + prompt_tokens,
                             self.first_token_requests, self.first_token_prompt_tokens,
                             self.finished_requests)

    def first_token(self, prompt_tokens: int) -> RouterAccount:
        """This account plus one request of ``prompt_tokens`` past its first token."""
        return RouterAccount(self.router_id, self.admitted_requests,
                             self.admitted_prompt_tokens, self.first_token_requests + 1,
                             self.first_token_prompt_tokens + prompt_tokens,
                             self.finished_requests)

    def finish(self) -> RouterAccount:
        """This account plus one finished request (``finished_requests`` counted from 0)."""
        return RouterAccount(self.router_id, self.admitted_requests,
                             self.admitted_prompt_tokens, self.first_token_requests,
                             self.first_token_prompt_tokens, (self.finished_requests or 0) + 1)

    def merged(self, other: RouterAccount) -> RouterAccount:
        """The sum of two counts of the same router (a node's front ends, each counting its
        own requests); ``finished_requests`` None counts as 0."""
        return RouterAccount(self.router_id, self.admitted_requests + other.admitted_requests,
                             self.admitted_prompt_tokens + other.admitted_prompt_tokens,
                             self.first_token_requests + other.first_token_requests,
                             self.first_token_prompt_tokens + other.first_token_prompt_tokens,
                             (self.finished_requests or 0) + (other.finished_requests or 0))


@dataclass(frozen=True)
class StepModel:
    """A node's step model fitted online to its own recent steps (``control.proto``
    ``StepModel``; ``gpumesh.profile_fit.OnlineStepFit``): a step of D decode and P prefill
    tokens lasts ``a_ms + b_decode_ms * D + b_prefill_ms * P`` ms (the ``[step]`` of an
    engine profile, linear). ``spans``: the observations fitted; ``rms_error``: their root
    mean square relative error."""

    a_ms: float = 0.0
    b_decode_ms: float = 0.0
    b_prefill_ms: float = 0.0
    spans: int = 0
    rms_error: float = 0.0


@dataclass(frozen=True)
class LoadReport:
    """One node's load at one instant: what a heartbeat carries (``control.proto``
    ``LoadReport`` documents every field)."""

    num_running: int = 0
    num_waiting: int = 0
    pending_prefill_tokens: int = 0      # prompt tokens admitted, not yet prefilled
    kv_cache_usage: float = 0.0          # 0..1
    prefix_cache_hit_rate: float = 0.0   # 0..1, recent window
    generation_tokens_per_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    in_flight: int = 0                   # requests inside the node's servicer
    draining: bool = False
    kv_capacity_tokens: int = 0          # 0 = unknown
    prefill_capacity_tokens_per_s: float = 0.0  # 0 = unknown
    decode_step_s: float = 0.0           # 0 = unknown
    output_tokens_mean: float = 0.0      # of the requests finished recently; 0 = unknown
    loaded_adapters: tuple[str, ...] = ()  # LoRA adapters loaded in the engine now
    adapter_load_s: float = 0.0          # mean seconds of a recent adapter load; 0 = unknown
    step_model: StepModel | None = None  # fitted online; None = not yet (or not fitted)
    engine_epoch: int = 0                # engine start / prefix-cache reset count; 0 = unknown
    gpus: tuple[GpuSample, ...] = ()
    router_accounts: tuple[RouterAccount, ...] = ()


@dataclass(frozen=True)
class Registration:
    """A node's membership request (``control.proto`` ``Registration``).

    ``incarnation`` changes every process start; ``max_concurrency`` 0 = the router's default;
    ``frontend_addresses``: each front-end process's own address for a node with several
    (empty: one process). ``kind`` is "gpumesh" for nodes that register themselves and
    "vllm-grpc" for stock vLLM gRPC workers the router adopts (never sent on the wire)."""

    node_id: str
    address: str
    models: tuple[ModelSpec, ...]
    incarnation: str
    engine: str = ""
    gpu_model: str = ""
    max_concurrency: int = 0
    frontend_addresses: tuple[str, ...] = ()
    kind: str = "gpumesh"
    role: str = "both"   # "both" | "prefill" | "decode" (disaggregated prefill/decode)
