"""Measuring an engine profile (gpumesh.profiles) from a started ``VllmEngine``.

``gpumesh calibrate`` builds the engine exactly as ``gpumesh node`` does (same
``NodeConfig``, same ``build_engine``), starts it, and calls :func:`measure_profile`, which
sends requests through ``VllmEngine.generate`` (the node's own path into vLLM) and times them
on this process's clock:

- **decode**: ``B`` requests of ``decode_prompt_tokens`` random tokens each, sent together,
  each decoding ``decode_tokens`` tokens (``ignore_eos``) for every ``B`` in
  ``decode_batches`` (capped at the engine's ``max_num_seqs`` and at what its KV cache
  holds). The step time is the trimmed mean (10 % cut each side) of the intervals between a
  request's outputs after its first token, per token they carried (so the batch's prefill
  is left out), over the ``B`` requests; the sample is the median over ``repeats`` rounds.
- **prefill**: one request alone, ``max_tokens = 1``, for every prompt length in
  ``prefill_prompts`` (capped below ``max_model_len``); the sample is the median time to first
  token of ``repeats`` fresh random prompts (never a prefix-cache hit). Each round measures
  every shape once (a slow spell of the machine hits every shape alike).
- **long contexts**: decode samples of ``(batch, prompt tokens)`` in ``contexts``: the
  attention term ``b_decode_context_ms`` (each decode sample records its sequences' mean
  length over the measured steps as ``context_tokens``).
- **prefix-cache hit**: a fresh prompt of ``hit_prompt_tokens`` sent once, then a prompt
  with its first ``hit_prefix_tokens`` tokens and a new tail: the second's cached tokens are
  the full KV blocks of the shared part (vLLM caches whole blocks). Only with prefix caching.

One decode batch, one long-context decode sample and one prompt length (``held_out``) are
left out of the fit, and their
prediction error is the profile's check on data it was not fitted to. KV capacity, block size
and scheduler limits are read from the engine's resolved ``VllmConfig``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gpumesh.node.engines.base import EngineRequest, Sampling
from gpumesh.node.engines.vllm.compat import current_platform
from gpumesh.node.engines.vllm.engine import VllmEngine
from gpumesh.profile_fit import fit_samples
from gpumesh.profiles import EngineProfile, Sample

logger = logging.getLogger(__name__)


class CalibrationError(RuntimeError):
    """The engine did not give what a measurement needs (the message says what)."""


@dataclass(frozen=True)
class CalibrationPlan:
    """What :func:`measure_profile` sends (module docstring). Held-out points are a batch
    of ``decode_batches`` and a length of ``prefill_prompts`` (0 = hold none out)."""

    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    decode_prompt_tokens: int = 32
    decode_tokens: int = 64
    # (batch, prompt tokens) decode samples over long contexts (the attention term)
    contexts: tuple[tuple[int, int], ...] = ((16, 1024), (4, 1536), (8, 512))
    held_out_context: tuple[int, int] = (8, 512)
    prefill_prompts: tuple[int, ...] = (16, 128, 256, 512, 1024, 1536)
    hit_prompt_tokens: int = 1024
    hit_prefix_tokens: int = 768
    repeats: int = 5
    held_out_batch: int = 16
    held_out_prompt: int = 512
    seed: int = 1234

    def __post_init__(self) -> None:
        if not self.decode_batches or min(self.decode_batches) < 1:
            raise ValueError("decode_batches must be >= 1 each")
        if not self.prefill_prompts or min(self.prefill_prompts) < 1:
            raise ValueError("prefill_prompts must be >= 1 each")
        if self.decode_tokens < 4 or self.decode_prompt_tokens < 1 or self.repeats < 1:
            raise ValueError("need decode_tokens >= 4, decode_prompt_tokens >= 1, repeats >= 1")
        if not 0 < self.hit_prefix_tokens <= self.hit_prompt_tokens:
            raise ValueError("need 0 < hit_prefix_tokens <= hit_prompt_tokens")


@dataclass(frozen=True)
class EngineFacts:
    """What the started engine says about itself (its resolved ``VllmConfig``)."""

    platform: str
    vllm_version: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    kv_capacity_tokens: int
    prefix_caching: bool
    vocab_size: int


def engine_facts(engine: VllmEngine) -> EngineFacts:
    """Scheduler limits, KV cache and model facts of a started engine."""
    import vllm

    cfg = engine.vllm_config
    sched, cache, model = cfg.scheduler_config, cfg.cache_config, cfg.model_config
    block = int(cache.block_size)
    platform = current_platform()
    return EngineFacts(
        platform="cuda" if platform.is_cuda() else "cpu" if platform.is_cpu() else "other",
        vllm_version=str(vllm.__version__),
        max_num_seqs=int(sched.max_num_seqs),
        max_num_batched_tokens=int(sched.max_num_batched_tokens),
        max_model_len=int(model.max_model_len),
        block_size=block,
        kv_capacity_tokens=int(cache.num_gpu_blocks or 0) * block,
        prefix_caching=bool(cache.enable_prefix_caching),
        vocab_size=int(model.get_vocab_size()),
    )


class _Sender:
    """Sends token-id requests through the engine and times them (perf_counter, seconds)."""

    def __init__(self, engine: VllmEngine, vocab: int, seed: int) -> None:
        self._engine = engine
        self._rng = random.Random(seed)
        self._lo, self._hi = min(10, vocab - 2), vocab - 1
        self._n = 0

    def prompt(self, n: int) -> tuple[int, ...]:
        return tuple(self._rng.randrange(self._lo, self._hi) for _ in range(n))

    async def one(self, prompt: tuple[int, ...],
                  max_tokens: int) -> tuple[float, list[tuple[float, int]]]:
        """(sent, [(time, tokens) of every output that carried tokens]) of one request."""
        self._n += 1
        req = EngineRequest(f"calibrate-{self._n}", prompt,
                            Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        outs: list[tuple[float, int]] = []
        async for out in self._engine.generate(req):
            if out.token_ids:
                outs.append((time.perf_counter(), len(out.token_ids)))
        return t0, outs


def trimmed_mean(values: Sequence[float], cut: float = 0.1) -> float:
    """The mean of ``values`` without the lowest and highest ``cut`` of them (a pause of the
    machine, or another process's burst, moves a few intervals, not the figure)."""
    v = sorted(values)
    k = int(len(v) * cut)
    kept = v[k:len(v) - k] or v
    return sum(kept) / len(kept)


async def _decode_ms(s: _Sender, batch: int, plan: CalibrationPlan,
                     prompt_tokens: int = 0) -> float:
    """One decode step of ``batch`` requests decoding together, ms: the trimmed mean of the
    per-token intervals after each request's first token."""
    n = prompt_tokens or plan.decode_prompt_tokens
    runs = await asyncio.gather(*(s.one(s.prompt(n), plan.decode_tokens)
                                  for _ in range(batch)))
    steps = [(t - prev) * 1000 / k for _, outs in runs
             for (prev, _), (t, k) in zip(outs, outs[1:])]
    if not steps:
        raise CalibrationError(f"decode batch {batch}: no request produced two outputs")
    return trimmed_mean(steps)


async def _ttft_ms(s: _Sender, prompt: tuple[int, ...]) -> float:
    t0, outs = await s.one(prompt, 1)
    if not outs:
        raise CalibrationError("a prefill request produced no token")
    return (outs[0][0] - t0) * 1000


async def measure_profile(engine: VllmEngine, name: str, plan: CalibrationPlan | None = None,
                          *, model: str = "", quadratic: bool = True,
                          context: bool = True) -> EngineProfile:
    """Measure the started ``engine`` per ``plan`` (module docstring) and fit its profile.

    The engine must be idle and serve nothing else meanwhile. Takes a few minutes on vLLM
    CPU with the tiny model; the fit is ``gpumesh.profile_fit.fit_samples``."""
    plan = plan or CalibrationPlan()
    facts = engine_facts(engine)
    if facts.platform not in ("cpu", "cuda"):
        raise CalibrationError(f"vLLM runs on {facts.platform}; profiles describe cpu or cuda")
    if facts.kv_capacity_tokens < facts.block_size:
        raise CalibrationError("the engine reports no KV cache size")
    s = _Sender(engine, facts.vocab_size, plan.seed)
    max_prompt = facts.max_model_len - 1
    fits_kv = max(facts.kv_capacity_tokens // (plan.decode_prompt_tokens + plan.decode_tokens
                                               + facts.block_size), 1)
    batches = sorted({min(b, facts.max_num_seqs, fits_kv) for b in plan.decode_batches})
    prompts = sorted({min(p, max_prompt) for p in plan.prefill_prompts})
    # warm-up: the first requests of each shape pay one-off costs (compilation, allocation)
    await _decode_ms(s, batches[-1], plan)
    for p in prompts:
        await _ttft_ms(s, s.prompt(p))
    # Every shape is measured once per round, ``repeats`` rounds, and a sample is the median
    # of its rounds: a slow spell of the machine then hits every shape alike (the fit stays
    # consistent) instead of all the repeats of one.
    dec_ctx = plan.decode_prompt_tokens + (plan.decode_tokens + 1) // 2
    decodes = [Sample("decode", 1.0, batch=b, prompt_tokens=plan.decode_prompt_tokens,
                      context_tokens=dec_ctx, held_out=b == plan.held_out_batch)
               for b in batches]
    for b, p in plan.contexts:  # decode over long contexts (attention)
        p = min(p, max_prompt - plan.decode_tokens)
        b = min(b, facts.max_num_seqs,
                max(facts.kv_capacity_tokens // (p + plan.decode_tokens + facts.block_size), 1))
        if p > plan.decode_prompt_tokens:
            decodes.append(Sample("decode", 1.0, batch=b, prompt_tokens=p,
                                  context_tokens=p + (plan.decode_tokens + 1) // 2,
                                  held_out=(b, p) == plan.held_out_context))
    hit = min(plan.hit_prompt_tokens, max_prompt)
    shared = min(plan.hit_prefix_tokens, hit)
    cached = shared // facts.block_size * facts.block_size if facts.prefix_caching else 0
    prefills = [Sample("prefill", 1.0, prompt_tokens=p, held_out=p == plan.held_out_prompt)
                for p in prompts]
    if cached > 0:
        prefills.append(Sample("prefill", 1.0, prompt_tokens=hit, cached_tokens=cached))
    times: list[list[float]] = [[] for _ in decodes + prefills]
    for _ in range(plan.repeats):
        for i, d in enumerate(decodes):
            times[i].append(await _decode_ms(s, d.batch, plan, d.prompt_tokens))
        for i, p in enumerate(prefills, len(decodes)):
            prompt = s.prompt(p.prompt_tokens)
            if p.cached_tokens:   # its first `shared` tokens cached by a first request
                await _ttft_ms(s, prompt)
                prompt = prompt[:shared] + s.prompt(p.prompt_tokens - shared)
            times[i].append(await _ttft_ms(s, prompt))
    samples = [dataclasses.replace(x, measured_ms=round(statistics.median(t), 4))
               for x, t in zip(decodes + prefills, times)]
    for x in samples:
        logger.info("calibrate: %s batch %d, %d prompt tokens (%d cached): %.3f ms", x.kind,
                    x.batch, x.prompt_tokens, x.cached_tokens, x.measured_ms)
    base = EngineProfile(
        name=name, platform=facts.platform,
        model=model, vllm_version=facts.vllm_version,
        measured=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        source=_source(plan),
        max_num_seqs=facts.max_num_seqs, max_num_batched_tokens=facts.max_num_batched_tokens,
        max_model_len=facts.max_model_len, kv_capacity_tokens=facts.kv_capacity_tokens,
        kv_block_size=facts.block_size, prefix_caching=facts.prefix_caching, a_ms=1.0)
    return fit_samples(base, samples, quadratic=quadratic, context=context)


def _source(plan: CalibrationPlan) -> str:
    return (f"gpumesh calibrate: decode = trimmed mean inter-token time of B requests of "
            f"{plan.decode_prompt_tokens} prompt tokens decoding {plan.decode_tokens} "
            f"together; prefill = median TTFT of one request, max_tokens = 1; "
            f"{plan.repeats} repeats; held out: batch {plan.held_out_batch}, batch "
            f"{plan.held_out_context[0]} after {plan.held_out_context[1]} prompt tokens, "
            f"prompt {plan.held_out_prompt}")
