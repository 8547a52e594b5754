"""The engine seam: what the node's servicers need from an inference engine.

Two implementations: ``gpumesh.node.engines.vllm.VllmEngine`` (vLLM's AsyncLLM; that package
is the only one that imports vllm) and ``gpumesh.node.engines.sim.SimEngine`` (a labelled
simulator for fleet-scale benchmarks). The servicers, heartbeats and accounting are shared,
so both report load through the same code path. The served model is a
:class:`gpumesh.types.ModelSpec`; GPU samples are :class:`gpumesh.types.GpuSample`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from gpumesh.types import GpuSample, ModelSpec, StepModel


class Finish(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class Sampling:
    """Validated sampling parameters (the servicer validates; engines trust them)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class AdapterRef:
    """A LoRA adapter the node serves (``gpumesh.node.adapters``): its request name, its
    folder (PEFT format) and its stable id (>= 1; vLLM's ``lora_int_id``)."""

    name: str
    path: str
    int_id: int


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    adapter: AdapterRef | None = None   # generate with this LoRA adapter (loaded on demand)
    # Disaggregated prefill/decode: vLLM's KV-transfer parameters (a JSON object) for an
    # engine with a KV connector (gpumesh.node.engines.vllm.kv_transfer); None = none
    kv_transfer_params: Mapping[str, Any] | None = field(default=None, hash=False)


@dataclass(frozen=True)
class EngineOutput:
    """One engine step's new output for a request (a delta).

    ``text`` is the detokenized delta (never splits a multi-byte character; stop strings
    already removed). ``finish`` is set on the last output only.
    """

    token_ids: tuple[int, ...]
    text: str
    finish: Finish | None = None
    # On the last output of a request that asked for a KV transfer: the parameters a decode
    # engine continues from (vLLM's RequestOutput.kv_transfer_params)
    kv_transfer_params: Mapping[str, Any] | None = field(default=None, hash=False)


@dataclass(frozen=True)
class EngineLoad:
    """The engine's own view of its load, from its scheduler (vLLM: a StatLoggerBase).

    Counts are instantaneous; rates are over a recent window (a few seconds).
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    prefix_cache_hit_rate: float = 0.0  # 0..1
    generation_tokens_per_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    gpus: tuple[GpuSample, ...] = field(default_factory=tuple)
    kv_capacity_tokens: int = 0  # KV-cache capacity in tokens; 0 = unknown
    # Prompt tokens/s the engine can prefill when busy (capacity, per wall-clock second; not
    # the observed, arrival-limited prompt_tokens_per_s); 0 = unknown.
    prefill_capacity_tokens_per_s: float = 0.0
    # Mean wall-clock seconds of the engine's recent steps while it had running requests (its
    # decode step time); 0 = not measured yet.
    decode_step_s: float = 0.0
    # Mean output tokens of the requests the engine finished in the last OUTPUT_WINDOW_S
    # (the newest kept when none finished since); 0 = none finished yet.
    output_tokens_mean: float = 0.0
    # LoRA adapters loaded in the engine now, and the mean seconds of its recent adapter
    # loads (0 = none yet)
    loaded_adapters: tuple[str, ...] = ()
    adapter_load_s: float = 0.0
    # The step model fitted to the engine's own recent steps (gpumesh.profile_fit.
    # OnlineStepFit); None = not yet, or an engine that does not fit one
    step_model: StepModel | None = None
    # time.monotonic() of the scheduler snapshot above (0 = unknown): with several front-end
    # processes on one engine, vLLM sends each step's stats to one of them, and the node
    # reports the freshest (gpumesh.node.frontends)
    stats_at: float = 0.0


# The window of EngineLoad.output_tokens_mean: long enough that one long generation does not
# swing it, short enough to follow a change of traffic.
OUTPUT_WINDOW_S = 30.0


class WindowMean:
    """The mean of the values added in the last ``window_s`` seconds, the newest always kept
    (so an engine that stopped stepping keeps its last figure). Both engines time their
    decode steps with it. O(1) amortised per call; 0.0 before the first value."""

    def __init__(self, window_s: float) -> None:
        self._window = window_s
        self._items: deque[tuple[float, float]] = deque()
        self._sum = 0.0

    def add(self, t: float, value: float) -> None:
        self._items.append((t, value))
        self._sum += value
        self.expire(t)

    def expire(self, now: float) -> None:
        items, horizon = self._items, now - self._window
        while len(items) > 1 and items[0][0] < horizon:
            self._sum -= items.popleft()[1]

    @property
    def mean(self) -> float:
        return max(self._sum, 0.0) / len(self._items) if self._items else 0.0


class KvEventSink(Protocol):
    """Receives an engine's prefix-cache block events in order, on the node's event loop:
    hashes of full 16-token blocks (``gpumesh.kvblocks``) stored in or evicted from its KV
    cache, or the whole cache cleared. Engines that emit them have
    ``set_kv_event_sink(sink) -> bool`` (``gpumesh.node.cache.KvPublisher`` is the sink)."""

    def stored(self, hashes: Sequence[int]) -> None: ...

    def removed(self, hashes: Sequence[int]) -> None: ...

    def cleared(self) -> None: ...


class EngineError(Exception):
    """An engine failure the servicer maps to a gRPC status (see node.errors)."""


class PromptTooLong(EngineError):
    """The prompt (plus max_tokens) does not fit the context window -> OUT_OF_RANGE."""


class InvalidRequest(EngineError):
    """The engine rejected the request as malformed (e.g. a token id out of vocabulary)
    -> INVALID_ARGUMENT."""


class EngineUnavailable(EngineError):
    """The engine is not serving yet (still starting) or any more (shut down) -> UNAVAILABLE,
    so clients and routers retry elsewhere or later."""


class AdapterLoadFailed(EngineError):
    """A served LoRA adapter could not be loaded (its files missing, unreadable or not for
    this model) -> FAILED_PRECONDITION."""


class EngineOverloaded(EngineError):
    """The engine refused the request for lack of capacity -> RESOURCE_EXHAUSTED."""


@runtime_checkable
class Engine(Protocol):
    """Contract between the node servicer and an engine.

    - ``generate`` yields deltas; cancelling the task that iterates it aborts the request in
      the engine (running count drops). ``abort`` does the same by id.
    - ``load`` is cheap and non-blocking (called by the heartbeat loop, every <= 250 ms).
    - ``tokenize`` / ``render_chat`` may take milliseconds (a long prompt); the node calls
      them only through ``PromptEncoder``: on its one worker thread, or inline on the event
      loop for a short prompt, never two calls at once. So they must not touch the event loop
      (no asyncio), and need not be safe for concurrent calls. Errors: ``EngineError``
      (``EngineUnavailable`` while starting or after shutdown).
    """

    kind: str  # "vllm" | "sim"

    @property
    def model(self) -> ModelSpec: ...

    async def start(self) -> None: ...

    def tokenize(self, text: str) -> list[int]: ...

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def load(self) -> EngineLoad: ...

    async def shutdown(self) -> None: ...
