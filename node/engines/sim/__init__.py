"""SIMULATOR of a vLLM GPU engine (``kind = "sim"``), for fleet-scale benchmarks on a CPU box.

This is *not* an inference engine: no model runs. Like llm-d's inference simulator, it
reproduces the timing and the load signals of vLLM's v1 scheduler so the router, heartbeats
and benchmarks see realistic behaviour, and it streams deterministic fake tokens.

Model of the GPU (one asyncio task per engine runs continuous-batching steps):

- Every step schedules, vLLM v1 style, the running requests first (a decode token each, or
  the next chunk of a chunked prefill) and then admits waiting requests while
  ``max_num_seqs`` and the ``max_num_batched_tokens`` budget allow.
- Step time (simulated seconds) =
  ``(step_a_ms + step_b_decode_ms * decode_tokens + step_b_prefill_ms * prefill_tokens) / speed / 1000``,
  plus ``step_c_decode_ms`` x decode_tokens^2 and the attention terms of an engine profile
  (``step_b_decode_context_ms`` x the decoding sequences' lengths summed,
  ``step_c_prefill_ms`` x the (token, earlier token) pairs the prefill chunks attend over),
  each 0 unless set (``SimEngineConfig.from_profile``, gpumesh.profiles).
  Tokens sampled in a step appear when the step ends (the first token when a request's last
  prefill chunk ends).
- KV cache: ``kv_capacity_tokens`` in blocks of ``kv_block_size``; a step only schedules the
  tokens whose blocks it can allocate. A waiting request that does not fit stays waiting,
  holding no block (admission allocates its first chunk, shared prefix blocks included,
  all or nothing); when a running request cannot grow, the newest running request is
  preempted (its KV is freed and it recomputes prompt + generated tokens when readmitted,
  vLLM's RECOMPUTE mode), and no new request is admitted in that step. A request whose
  prompt and maximum output exceed the KV cache even alone is refused when added.
- Disaggregated serving (``transfer.py``, driven by the fleet simulator): a prefill leg keeps
  its KV after it finishes until released; a decode leg takes KV blocks for its whole prompt,
  waits for the transfer, then computes only its last prompt token.
- ``front_end_tokens_per_s`` (0 = none): the node's front-end ceiling. A real node's vLLM
  front end (output processing, detokenising, the gRPC servicer) is one Python process and
  tops out at a host-dependent output-token rate whatever the GPU does; a step that samples
  ``decode_tokens`` then lasts at least ``decode_tokens / front_end_tokens_per_s``. It is a
  CPU limit, so ``speed`` does not scale it. Off by default, so that recorded benchmarks keep
  their meaning.
- ``speed`` scales a heterogeneous GPU (2 = twice as fast). ``time_scale`` slows the whole
  simulation uniformly in wall-clock time (10 = every step takes 10x longer in real time)
  so that large fleets fit on a few cores; ``time_scale = 0`` runs steps back to back
  (simulated time only in :attr:`SimEngine.stats`; for tests).

Units: ``load()`` rates (``generation_tokens_per_s``, ``prompt_tokens_per_s``) are per
WALL-CLOCK second, i.e. simulated rates divided by ``time_scale``, so the router's formulas see
the wall-clock behaviour they act on; ``decode_step_s`` is the mean wall-clock length (the
simulated step x ``time_scale``) of the steps of the last ``STEP_WINDOW_S``.
:attr:`SimEngine.stats` reports simulated seconds.

Prefill capacity (``load().prefill_capacity_tokens_per_s``): what a step that spends its whole
``max_num_batched_tokens`` budget B on prefill does, from the step model above::

    B / ((step_a_ms + step_b_prefill_ms * B) / speed / 1000) / time_scale   tokens/s

(per wall-clock second; with ``time_scale = 0`` the simulated rate). It is a constant of the
model, unlike ``prompt_tokens_per_s``, which is what arrived and was prefilled (throughput,
not capacity).

Calibration: the defaults are a Qwen2.5-0.5B shape on one H200 under vLLM with CUDA graphs;
``SimEngineConfig.for_shape("7b")`` gives the 7B shape. The measurements and fits behind them
are in docs/benchmarks-gpu.md ("Simulator calibration"). ``for_shape("0.5b-h200")`` and
``for_shape("7b-h200")`` are fitted on the bare engine instead (decode steps of B requests
decoding together, B = 1..512, and the prefill slope of one request's TTFT; the 7B shape adds
``step_c_decode_ms`` x decode_tokens^2 to the step): the fleet simulator's default, checked
against those measurements in tests/bench/test_sim_calibration.py.

Not modelled: attention cost growing with context length unless the attention terms are set
(the built-in GPU shapes leave them at 0), CUDA-graph vs eager steps, prefix
caching (hit rate is always 0), GPU samples (``EngineLoad.gpus`` is empty), and, unless
``front_end_tokens_per_s`` is set, the real node's front-end ceiling (with many streams per
node the simulator is then optimistic).

Outputs are deterministic: a request's token ids come from its own RNG, seeded by
``sampling.seed`` when given, else by the prompt (temperature 0, like greedy decoding), else
by ``seed`` + a CRC of the request id; they do not depend on batching or timing. Output
length is ``max_tokens`` unless the seeded EOS draw (``eos_probability``, default 0) or a
stop string ends it.
"""

from gpumesh.node.engines.sim.config import SimEngineConfig, SimStats
from gpumesh.node.engines.sim.engine import SimEngine

__all__ = ["SimEngine", "SimEngineConfig", "SimStats"]
