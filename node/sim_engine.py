"""SIMULATOR of a vLLM GPU engine (``kind = "sim"``), for fleet-scale benchmarks on a CPU box.

This is *not* an inference engine: no model runs. Like llm-d's inference simulator, it
reproduces the timing and the load signals of vLLM's v1 scheduler so the router, heartbeats
and benchmarks see realistic behaviour, and it streams deterministic fake tokens.

Model of the GPU (one asyncio task per engine runs continuous-batching steps):

- Every step schedules, vLLM v1 style, the running requests first (a decode token each, or
  the next chunk of a chunked prefill) and then admits waiting requests while
  ``max_num_seqs`` and the ``max_num_batched_tokens`` budget allow.
- Step time (simulated seconds) =
  ``(step_a_ms + step_b_decode_ms * decode_tokens + step_b_prefill_ms * prefill_tokens) / speed / 1000``.
  Tokens sampled in a step appear when the step ends (the first token when a request's last
  prefill chunk ends).
- KV cache: ``kv_capacity_tokens`` in blocks of ``kv_block_size``; a step only schedules the
  tokens whose blocks it can allocate. A waiting request that does not fit stays waiting;
  when a running request cannot grow, the newest running request is preempted (its KV is
  freed and it recomputes prompt + generated tokens when readmitted, vLLM's RECOMPUTE
  mode), and no new request is admitted in that step.
- ``front_end_tokens_per_s`` (0 = none): the node's front-end ceiling. A real node's vLLM
  front end (output processing, detokenising, the gRPC servicer) is one Python process and
  tops out at a host-dependent output-token rate whatever the GPU does; a step that samples
  ``decode_tokens`` then lasts at least ``decode_tokens / front_end_tokens_per_s``. It is a
  CPU limit, so ``speed`` does not scale it.
- ``speed`` scales a heterogeneous GPU (2 = twice as fast). ``time_scale`` slows the whole
  simulation uniformly in wall-clock time (10 = every step takes 10x longer in real time)
  so that large fleets fit on a few cores; ``time_scale = 0`` runs steps back to back
  (simulated time only in :attr:`SimEngine.stats`; for tests).

Units: ``load()`` rates (``generation_tokens_per_s``, ``prompt_tokens_per_s``) are per
WALL-CLOCK second, i.e. simulated rates divided by ``time_scale``, so the router's formulas see
the wall-clock behaviour they act on; ``decode_step_s`` is the mean wall-clock length (the
simulated step x ``time_scale``) of the steps of the last 3 s. :attr:`SimEngine.stats`
reports simulated seconds.

Prefill capacity (``load().prefill_capacity_tokens_per_s``): what a step that spends its whole
``max_num_batched_tokens`` budget B on prefill does, from the step model above::

    B / ((step_a_ms + step_b_prefill_ms * B) / speed / 1000) / time_scale   tokens/s

(per wall-clock second; with ``time_scale = 0`` the simulated rate). The 0.5B defaults give
16384 / 102.6 ms = 159,700 tokens/s simulated. It is a constant of the model, unlike
``prompt_tokens_per_s``, which is what arrived and was prefilled (throughput, not capacity).

Calibration (defaults = the 0.5B shape). Two sources, both vLLM 0.26.0 on H200 with CUDA
graphs and dummy weights:

- 0.5B decode (``step_a_ms``, ``step_b_decode_ms``): measured through the mesh, 2026-11-29,
  nvidia-h200-x2 (``deploy/gpu/run_mesh_gpu.sh``, docs/benchmarks-gpu.md): a vLLM CUDA node,
  32-token prompts, 256 output tokens, closed loop at concurrency 1 / 32 / 128 / 256. Step time
  = TPOT p50; batch = the running requests the node's heartbeats reported meanwhile (at
  concurrency 256 only ~89 were running: the node's Python front end, not the GPU, limits it to
  ~27k output tokens/s). Points (batch, ms): (1, 2.0), (23, 3.1), (89, 4.8), (114, 5.1),
  (123, 4.9); least-squares line ``a = 2.29 ms, b_decode = 0.0242 ms/token`` (residuals
  <= 0.36 ms). The earlier fit of the offline table below (``a = 2.776``, ``b = 0.03177``)
  predicted 6.8 ms at batch 128 where the streaming engine takes ~5 ms.
- everything else from ``/work/shared/gpu/README.md``, "Calibration data for a simulated
  engine" (``calibrate.sh``, one H200, 2026-11-29), except:
- 7B decode (``step_a_ms = 4.74``, ``step_b_decode_ms = 0.0109``): the line through the
  offline table's batch-1 step (4.75 ms) and the step measured through the mesh at the batch
  a node actually runs: TPOT p50 6.0-6.5 ms (median 6.1, six runs) at 117-123 running
  requests (heartbeats), 1 GPU, concurrency 256, docs/benchmarks-gpu.md (second session,
  2026-11-29, phases p7 and ab7). The old least-squares line through the offline table
  (``a = 4.073``, ``b = 0.02912``) predicted 7.6 ms there, 24 % slow; the new line
  under-predicts the offline table above batch 128 (7.5 vs 10.2 ms at 256), a batch no
  7B node reached through the mesh (its front end admits ~120 at once; the rest wait).
- The front-end ceiling (``front_end_tokens_per_s``, off by default so the recorded policy
  benchmarks keep their meaning): the node process sat at 1.00-1.04 cores in every
  saturated GPU run (``CpuSampler``, docs/benchmarks-gpu.md) while producing ~17-18k output
  tokens/s per node on the second session's host (0.5B at 20-26 % GPU utilisation, 7B at
  85-88 %), and 21-27k on the first session's host. Set it to 17500 to model that host.
  Prefill: slope of a least-squares line through the one-request TTFT table (128..8192
  tokens): 0.5B ``b_prefill = 0.00612 ms/token``, 7B ``0.0241 ms/token``. The table's
  intercepts (17.5 ms / 7.9 ms) include the per-call overhead of offline ``LLM.generate`` and
  are not charged to the simulated step; a prefill step pays ``a`` only. (Through the mesh,
  one request's TTFT was 12 ms at 32 prompt tokens and 27 ms at 1024 and 1900: front-end
  overhead dominates, so these did not move the slope.)
  KV capacity at gpu_memory_utilization 0.85: 0.5B 10.2 M tokens (the mesh's nodes logged
  10,260,096 at max_model_len 2048), 7B 1.91 M tokens (the mesh's 7B nodes logged 1,933,760
  and 1,947,840), block 16; scheduler defaults
  max_num_seqs 1024, max_num_batched_tokens 16384, max_model_len 8704.

Not modelled: attention cost growing with context length, CUDA-graph vs eager steps, prefix
caching (hit rate is always 0), GPU samples (``EngineLoad.gpus`` is empty), and, unless
``front_end_tokens_per_s`` is set, the real node's front-end ceiling (above ~120 streams per
node the simulator is then optimistic).

Outputs are deterministic: a request's token ids come from its own RNG, seeded by
``sampling.seed`` when given, else by the prompt (temperature 0, like greedy decoding), else
by ``seed`` + a CRC of the request id; they do not depend on batching or timing. Output
length is ``max_tokens`` unless the seeded EOS draw (``eos_probability``, default 0) or a
stop string ends it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import zlib
from array import array
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from gpumesh.node.engine import (
    EngineError,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    Finish,
    ModelSpec,
    PromptTooLong,
    WindowMean,
)

log = logging.getLogger(__name__)
# Window of decode_step_s (wall seconds): the mean length of the steps that ended in it.
# 3 s, as a vLLM node's (node.vllm_engine._LoadStatLogger): long enough to span a wave of
# requests that start and finish together, so equal nodes report equal steps.
STEP_WINDOW_S = 3.0

VOCAB_SIZE = 32_000
EOS_TOKEN_ID = VOCAB_SIZE  # outside the sampled range, so it is never drawn by accident


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
    step_a_ms: float = 2.29  # 0.5B, measured through the mesh (module docstring)
    step_b_decode_ms: float = 0.0242
    step_b_prefill_ms: float = 0.00612
    front_end_tokens_per_s: float = 0.0  # node front-end ceiling (module docstring); 0 = none
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
        """Calibrated defaults for ``"0.5b"`` or ``"7b"`` (see the module docstring)."""
        shapes: dict[str, dict[str, Any]] = {
            "0.5b": {},
            "7b": {
                "model_name": "sim-qwen2.5-7b",
                "kv_capacity_tokens": 1_910_000,
                "step_a_ms": 4.74,
                "step_b_decode_ms": 0.0109,
                "step_b_prefill_ms": 0.0241,
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


# --- deterministic text -------------------------------------------------------------------

_SYLLABLES = ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "an", "el", "or", "us", "in", "ve")
_MULTIBYTE = (" café", " naïve", " über", " 東京", " 日本語", " →", " 🙂", " Ωmega", " żółw", " ½")


def _build_words() -> tuple[str, ...]:
    words: list[str] = []
    n = len(_SYLLABLES)
    for i in range(1024):
        if i % 41 == 7:
            words.append(_MULTIBYTE[(i // 41) % len(_MULTIBYTE)])
            continue
        w = _SYLLABLES[i % n] + _SYLLABLES[(i // n) % n]
        if i % 3 == 0:
            w += _SYLLABLES[(i * 7) % n]
        words.append(("." if i % 97 == 5 else "") + " " + w)
    return tuple(words)


WORDS = _build_words()
_NWORDS = len(WORDS)


def detokenize(token_ids: Sequence[int], eos: int = EOS_TOKEN_ID) -> str:
    """The simulator's text for generated ids (EOS renders as nothing)."""
    return "".join([WORDS[t % _NWORDS] for t in token_ids if t != eos])


# Whitespace then up to four non-space characters: ~1 token per short word, ~4 chars per
# token in longer ones, so a benchmark's prompt lengths come out close to what a BPE gives.
_PIECE = re.compile(r"\s*\S{1,4}|\s+")


class _Tokenizer:
    __slots__ = ("_memo", "_vocab")

    def __init__(self, vocab_size: int = VOCAB_SIZE) -> None:
        self._memo: dict[str, int] = {}
        self._vocab = vocab_size

    def encode(self, text: str) -> list[int]:
        memo = self._memo
        out: list[int] = []
        for piece in _PIECE.findall(text):
            tid = memo.get(piece)
            if tid is None:
                tid = zlib.crc32(piece.encode()) % self._vocab
                if len(memo) < 200_000:
                    memo[piece] = tid
            out.append(tid)
        return out


# --- the scheduler ------------------------------------------------------------------------


class _Req:
    __slots__ = (
        "blocks",
        "computed",
        "eos_p",
        "finish",
        "hold",
        "id",
        "max_out",
        "out",
        "prompt_len",
        "rng",
        "sent",
        "stop",
        "text",
        "text_sent",
        "waiter",
    )

    def __init__(self, rid: str, prompt_len: int, max_out: int, rng: random.Random,
                 eos_p: float, stop: tuple[str, ...]) -> None:
        self.id = rid
        self.prompt_len = prompt_len
        self.max_out = max_out
        self.rng = rng
        self.eos_p = eos_p
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1  # chars held back for stops
        self.out: list[int] = []  # generated ids
        self.sent = 0  # ids delivered
        self.text = ""  # full text, kept only when there are stop strings
        self.text_sent = 0
        self.computed = 0  # tokens whose KV is computed
        self.blocks = 0
        self.finish: Finish | None = None
        self.waiter: asyncio.Future[None] | None = None


class SimEngine:
    """A labelled simulator implementing :class:`node.engine.Engine` (see module docstring)."""

    kind = "sim"

    def __init__(self, config: SimEngineConfig | None = None) -> None:
        self.config = cfg = config or SimEngineConfig()
        self._spec = ModelSpec(
            name=cfg.model_name,
            aliases=tuple(cfg.aliases),
            max_context_length=cfg.max_context_length,
            tensor_parallel_size=1,
            capacity_weight=cfg.capacity_weight,
        )
        self._tok = _Tokenizer(cfg.vocab_size)
        self._vocab = cfg.vocab_size
        self._eos = cfg.eos
        self._reqs: dict[str, _Req] = {}
        self._running: list[_Req] = []
        self._waiting: deque[_Req] = deque()
        self._block = cfg.kv_block_size
        self._total_blocks = cfg.kv_capacity_tokens // cfg.kv_block_size
        self._prefill_capacity = self.prefill_capacity_tokens_per_s()
        self._free_blocks = self._total_blocks
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        # counters
        self._steps = 0
        self._busy = 0.0
        self._gen = 0
        self._prefill = 0
        self._preempt = 0
        self._finished = 0
        self._aborted = 0
        self._samples: deque[tuple[float, int, int]] = deque()  # (wall t, gen, prefill)
        # the wall-clock lengths of the steps of the last STEP_WINDOW_S
        self._step_log = WindowMean(STEP_WINDOW_S)

    # --- Engine protocol ---------------------------------------------------------------

    @property
    def model(self) -> ModelSpec:
        return self._spec

    async def start(self) -> None:
        if self._task is not None:
            return
        if self._closed:
            raise EngineError("engine is shut down")
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name=f"sim-engine:{self._spec.name}")

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        parts = [f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages]
        parts.append("<|im_start|>assistant\n")
        return self._tok.encode("".join(parts))

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Queue the request at the first iteration (as vLLM's AsyncLLM does) and yield deltas.

        Errors (PromptTooLong, duplicate id, engine not running) raise from that first
        iteration. Deltas that pile up while the consumer is busy are merged into one output,
        like vLLM's RequestOutputCollector; a prompt consumer sees one output per step.
        """
        req = self._add(request)
        loop = asyncio.get_running_loop()
        try:
            while True:
                if req.sent == len(req.out) and req.finish is None:
                    fut = req.waiter = loop.create_future()
                    await fut
                ids = req.out[req.sent:]
                req.sent += len(ids)
                if req.stop:
                    end = len(req.text) if req.finish is not None else len(req.text) - req.hold
                    text = req.text[req.text_sent:end] if end > req.text_sent else ""
                    req.text_sent = max(req.text_sent, end)
                else:
                    text = detokenize(ids, self._eos)
                # Read finish once: the step loop may finish the request while this generator
                # is suspended at the yield, and that last delta must still be delivered.
                finish = req.finish
                yield EngineOutput(tuple(ids), text, finish)
                if finish is not None:
                    return
        finally:
            if req.finish is None:  # consumer cancelled or closed the stream
                self._drop(req, Finish.ABORT)

    async def abort(self, request_id: str) -> None:
        req = self._reqs.get(request_id)
        if req is not None:
            self._drop(req, Finish.ABORT)

    def load(self) -> EngineLoad:
        gen_rate, prompt_rate = self._rates()
        return EngineLoad(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_cache_usage=(self._total_blocks - self._free_blocks) / self._total_blocks,
            prefix_cache_hit_rate=0.0,
            generation_tokens_per_s=gen_rate,
            prompt_tokens_per_s=prompt_rate,
            kv_capacity_tokens=self._total_blocks * self._block,
            prefill_capacity_tokens_per_s=self._prefill_capacity,
            decode_step_s=self.decode_step_s(),
        )

    async def shutdown(self) -> None:
        self._closed = True
        for req in list(self._reqs.values()):
            self._drop(req, Finish.ABORT)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    # --- introspection (tests, benchmarks) -----------------------------------------------

    @property
    def stats(self) -> SimStats:
        return SimStats(self._steps, self._busy, self._gen, self._prefill, self._preempt,
                        self._finished, self._aborted)

    def step_time_s(self, decode_tokens: int, prefill_tokens: int) -> float:
        """Simulated duration of one step (seconds), before ``time_scale``."""
        c = self.config
        ms = c.step_a_ms + c.step_b_decode_ms * decode_tokens + c.step_b_prefill_ms * prefill_tokens
        gpu_s = ms / c.speed / 1000.0
        if c.front_end_tokens_per_s > 0:
            return max(gpu_s, decode_tokens / c.front_end_tokens_per_s)
        return gpu_s

    def prefill_capacity_tokens_per_s(self) -> float:
        """Prompt tokens per wall-clock second a full-budget prefill step does (module
        docstring); per simulated second when ``time_scale`` is 0."""
        c = self.config
        budget = c.max_num_batched_tokens
        rate = budget / self.step_time_s(0, budget)
        return rate / c.time_scale if c.time_scale > 0 else rate

    @property
    def free_kv_blocks(self) -> int:
        return self._free_blocks

    # --- requests ------------------------------------------------------------------------

    def _add(self, request: EngineRequest) -> _Req:
        if self._task is None or self._closed:
            raise EngineError("engine not running")
        rid = request.request_id
        if rid in self._reqs:
            raise EngineError(f"duplicate request id {rid!r}")
        n_prompt = len(request.prompt_token_ids)
        if n_prompt < 1:
            raise EngineError("empty prompt")
        room = self.config.max_context_length - n_prompt
        if room < 1:
            raise PromptTooLong(
                f"prompt of {n_prompt} tokens leaves no room in a context of "
                f"{self.config.max_context_length}")
        s = request.sampling
        if s.seed is not None:
            seed = s.seed
        elif s.temperature == 0.0:
            seed = zlib.crc32(array("q", request.prompt_token_ids).tobytes())
        else:
            seed = self.config.seed * 1_000_003 + zlib.crc32(rid.encode())
        req = _Req(rid, n_prompt, min(s.max_tokens, room), random.Random(seed),
                   0.0 if s.ignore_eos else self.config.eos_probability, tuple(s.stop))
        self._reqs[rid] = req
        self._waiting.append(req)
        assert self._wake is not None
        self._wake.set()
        return req

    def _free(self, req: _Req) -> None:
        self._free_blocks += req.blocks
        req.blocks = 0

    def _drop(self, req: _Req, finish: Finish) -> None:
        """Abort: free KV at once, unlink, wake the consumer."""
        if req.finish is not None:
            return
        req.finish = finish
        self._free(req)
        self._reqs.pop(req.id, None)
        if req in self._running:
            self._running.remove(req)
        else:
            try:
                self._waiting.remove(req)
            except ValueError:
                pass
        self._aborted += 1
        w = req.waiter
        if w is not None and not w.done():
            w.set_result(None)

    # --- the step loop -----------------------------------------------------------------

    def _schedule(self) -> tuple[list[tuple[_Req, int]], int, int]:
        cfg = self.config
        B = self._block
        budget = cfg.max_num_batched_tokens
        running = self._running
        scheduled: list[tuple[_Req, int]] = []
        n_dec = n_pre = 0
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.prompt_len + len(req.out) - req.computed
            if n > budget:  # noqa: PLR1730 - cheaper than min() in the hot loop
                n = budget
            need = -(-(req.computed + n) // B) - req.blocks
            if need > 0:
                self_preempted = False
                while need > self._free_blocks:
                    # RECOMPUTE preemption of the newest running request (vLLM v1, FCFS).
                    victim = running.pop()
                    self._free(victim)
                    victim.computed = 0
                    self._waiting.appendleft(victim)
                    self._preempt += 1
                    preempted = True
                    if victim is req:
                        self_preempted = True
                        break
                if self_preempted:
                    break
                self._free_blocks -= need
                req.blocks += need
            scheduled.append((req, n))
            budget -= n
            if n == 1 and req.out:
                n_dec += 1
            else:
                n_pre += n
            i += 1
        if not preempted:
            waiting = self._waiting
            while waiting and len(running) < cfg.max_num_seqs and budget > 0:
                req = waiting[0]
                n = req.prompt_len + len(req.out) - req.computed
                if n > budget:  # noqa: PLR1730
                    n = budget
                need = -(-(req.computed + n) // B) - req.blocks
                if need > self._free_blocks:
                    break  # KV full: it waits
                self._free_blocks -= need
                req.blocks += need
                waiting.popleft()
                running.append(req)
                scheduled.append((req, n))
                budget -= n
                n_pre += n
        return scheduled, n_dec, n_pre

    def _apply(self, scheduled: list[tuple[_Req, int]]) -> None:
        any_done = False
        gen = 0
        for req, n in scheduled:
            if req.finish is not None:
                continue  # aborted during the step
            req.computed += n
            out = req.out
            if req.computed < req.prompt_len + len(out):
                continue  # mid prefill (or mid recompute)
            rng = req.rng
            if req.eos_p and rng.random() < req.eos_p:
                out.append(self._eos)
                req.finish = Finish.STOP
            else:
                tid = int(rng.random() * self._vocab)
                if tid == self._eos:  # an in-vocab EOS is only ever the EOS draw's
                    tid = tid + 1 if tid + 1 < self._vocab else 0
                out.append(tid)
                if req.stop:
                    self._check_stop(req, tid)
            gen += 1
            if req.finish is None and len(out) >= req.max_out:
                req.finish = Finish.LENGTH
            if req.finish is not None:
                any_done = True
                self._free(req)
                del self._reqs[req.id]
                self._finished += 1
            w = req.waiter
            if w is not None and not w.done():
                w.set_result(None)
        self._gen += gen
        if any_done:
            self._running = [r for r in self._running if r.finish is None]

    @staticmethod
    def _check_stop(req: _Req, tid: int) -> None:
        start = max(0, len(req.text) - req.hold)
        req.text += WORDS[tid % _NWORDS]
        best = -1
        for s in req.stop:
            k = req.text.find(s, start)
            if k != -1 and (best == -1 or k < best):
                best = k
        if best != -1:
            req.text = req.text[:best]
            req.finish = Finish.STOP

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        wake = self._wake
        scale = self.config.time_scale
        max_lag = 0.05  # wall s: beyond this behind schedule, stop catching up (CPU overload)
        t = loop.time()
        while True:
            if not self._running and not self._waiting:
                wake.clear()
                await wake.wait()
                t = loop.time()
                continue
            scheduled, n_dec, n_pre = self._schedule()
            if not scheduled:  # cannot happen with a valid config; never spin
                wake.clear()
                await wake.wait()
                t = loop.time()
                continue
            dt = self.step_time_s(n_dec, n_pre)
            self._steps += 1
            self._busy += dt
            self._prefill += n_pre
            if scale > 0:
                t += dt * scale
                delay = t - loop.time()
                if delay < -max_lag:
                    t = loop.time()
                await asyncio.sleep(max(0.0, delay))
            else:
                await asyncio.sleep(0)
            self._apply(scheduled)
            now = loop.time()
            self._step_log.add(now, dt * scale if scale > 0 else dt)
            if not self._samples or now - self._samples[-1][0] >= 0.25:
                self._sample(now)

    def decode_step_s(self) -> float:
        """Mean wall-clock length of the steps of the last ``STEP_WINDOW_S`` (the last busy
        window while idle); per simulated second when ``time_scale`` is 0; 0 before a step."""
        return self._step_log.mean

    # --- rates -------------------------------------------------------------------------

    def _sample(self, now: float) -> None:
        s = self._samples
        s.append((now, self._gen, self._prefill))
        horizon = now - self.config.rate_window_s
        while len(s) > 2 and s[1][0] <= horizon:
            s.popleft()

    def _rates(self) -> tuple[float, float]:
        try:
            now = asyncio.get_running_loop().time()
        except RuntimeError:
            return 0.0, 0.0
        if not self._samples or now - self._samples[-1][0] >= 0.25:
            self._sample(now)
        t0, g0, p0 = self._samples[0]
        span = now - t0
        if span <= 0:
            return 0.0, 0.0
        span = max(span, 1.0)  # a fresh window does not report a burst as a huge rate
        return (self._gen - g0) / span, (self._prefill - p0) / span
