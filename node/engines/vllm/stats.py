"""The one adapter over vLLM's per-step stats: ``LoadStatLogger`` turns them into the node's
``EngineLoad``; ``stat_logger_factory`` hands it to vLLM as a ``StatLoggerBase``."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gpumesh.node.engines.base import OUTPUT_WINDOW_S, EngineLoad, WindowMean
from gpumesh.node.engines.vllm.kv_transfer import KvTransferTotals
from gpumesh.profile_fit import OnlineStepFit


class LoadStatLogger:
    """Turns vLLM's per-step stats into an ``EngineLoad`` (the one adapter over unstable types).

    vLLM calls ``record`` on the event loop's output-handler task after every engine step that
    produced output (``disable_log_stats=False``), so updates are single-threaded and cheap.
    Counts and KV usage are the last step's; token rates are sums over the last ``rate_window_s``
    seconds; the prefix cache hit rate is over the last ``prefix_window_requests`` requests
    that queried the cache (it keeps its value while idle, like vLLM's own logger).
    Prompt tokens/s counts tokens actually computed by prefill (prefix cache hits excluded).

    Prefill capacity (``EngineLoad.prefill_capacity_tokens_per_s``) is measured, not
    configured: consecutive ``record`` calls are grouped into spans of at least
    ``capacity_span_s`` wall-clock seconds (a step lasts from the previous call to this one;
    a span absorbs the output handler's bursts, when it catches up with queued steps and calls
    come back to back), and a span's prompt tokens over its length is one sample. The figure
    is the maximum sample over the last ``capacity_windows`` windows of ``capacity_window_s``
    that saw prefill (windows without prefill are skipped, so it holds while idle and one
    outlier ages out). Decode steps and idle gaps inside a span only lower a sample, so it is
    a lower bound of what the engine can prefill, and far closer to it than the observed
    prompt rate, which follows arrivals. 0 until a span with prefill has ended. O(1) per call.

    Decode step time (``EngineLoad.decode_step_s``): the engine core sends its stats after
    every step, with or without request outputs, so each ``record`` call with scheduler
    stats ends one step, and the interval since the previous call is that step's length
    when the previous step left requests running (otherwise the engine sat idle in between).
    The figure is the mean of the intervals of the last ``step_window_s`` seconds (3 s: a
    wave of requests that start and finish together fits in it, so equal nodes report equal
    steps); the output handler's bursts (queued steps recorded back to back after one long
    interval) cancel out in the mean. It keeps its value while idle; 0 until one step is
    timed.

    Step model (``EngineLoad.step_model``): the same step ends, with the decode tokens
    (generated tokens) and prefill tokens (prompt tokens computed) of the step, feed a
    ``gpumesh.profile_fit.OnlineStepFit``: a least-squares fit of the engine's linear step
    model over its recent busy spans of at least ``fit_span_s``, None until it has 8.
    """

    def __init__(
        self,
        rate_window_s: float = 3.0,
        prefix_window_requests: int = 256,
        clock: Callable[[], float] = time.monotonic,
        capacity_span_s: float = 0.05,
        capacity_window_s: float = 10.0,
        capacity_windows: int = 6,
        step_window_s: float = 3.0,
        fit_span_s: float = 0.25,
    ) -> None:
        self._clock = clock
        self._fit = OnlineStepFit(span_s=fit_span_s)
        self._step_busy = False   # the step that just ended had a predecessor still running
        # decode step time: the timed steps of the last step_window_s
        self._step_last_t: float | None = None
        self._steps = WindowMean(step_window_s)
        self._outputs = WindowMean(OUTPUT_WINDOW_S)   # output tokens of finished requests
        self._window = rate_window_s
        # prefill capacity: the open span, the open window's best sample, older windows' best
        self._cap_span_s = capacity_span_s
        self._cap_window_s = capacity_window_s
        self._cap_last_t: float | None = None   # time of the previous record() call
        self._cap_span_t0 = 0.0                  # start of the open span
        self._cap_span_tokens = 0
        self._cap_win_t0 = 0.0
        self._cap_win_best = 0.0
        self._cap_past: deque[float] = deque(maxlen=max(capacity_windows - 1, 1))
        self._cap_past_best = 0.0
        self._prefix_window = prefix_window_requests
        self._running = 0
        self._waiting = 0
        self._kv = 0.0
        # (t, generation tokens, prompt tokens computed) per recorded iteration
        self._rates: deque[tuple[float, int, int]] = deque()
        self._gen_sum = 0
        self._prompt_sum = 0
        # (requests, queries, hits) per scheduler update with prefix-cache queries
        self._prefix: deque[tuple[int, int, int]] = deque()
        self._prefix_req = 0
        self._prefix_q = 0
        self._prefix_h = 0
        self.records = 0
        self.kv_capacity_tokens = 0  # blocks x block size, once vLLM has sized its KV cache
        self.kv_transfers = KvTransferTotals()   # what the KV connector moved (kv_transfer.py)

    # -- vLLM StatLoggerBase interface (duck-typed; see stat_logger_factory) ---------------

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        self.records += 1
        if scheduler_stats is not None:
            self._observe_step(self._clock())
            self._running = int(getattr(scheduler_stats, "num_running_reqs", 0))
            self._waiting = int(getattr(scheduler_stats, "num_waiting_reqs", 0)) + int(
                getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)
            )
            self._kv = min(max(float(getattr(scheduler_stats, "kv_cache_usage", 0.0)), 0.0), 1.0)
            pc = getattr(scheduler_stats, "prefix_cache_stats", None)
            if pc is not None:
                self._observe_prefix(pc)
            kvc = getattr(scheduler_stats, "kv_connector_stats", None)
            if kvc:
                self.kv_transfers = self.kv_transfers.add(kvc)
        if iteration_stats is not None:
            gen = int(getattr(iteration_stats, "num_generation_tokens", 0))
            pts = getattr(iteration_stats, "prompt_token_stats", None)
            prompt = int(getattr(pts, "computed", 0)) if pts is not None else 0
            now = self._clock()
            if scheduler_stats is not None:   # one step ended: what it scheduled
                self._fit.step(now, self._step_busy, gen, prompt)
            for done in getattr(iteration_stats, "finished_requests", ()) or ():
                self._outputs.add(now, float(getattr(done, "num_generation_tokens", 0)))
            if gen or prompt:
                self._rates.append((now, gen, prompt))
                self._gen_sum += gen
                self._prompt_sum += prompt
            self._observe_capacity(now, prompt)
            self._expire(now)

    def _observe_step(self, now: float) -> None:
        """One engine step ended at ``now`` (before ``_running`` takes this step's count)."""
        last = self._step_last_t
        self._step_last_t = now
        self._step_busy = last is not None and self._running > 0
        if self._step_busy and last is not None:
            self._steps.add(now, now - last)
        else:
            self._steps.expire(now)

    @property
    def decode_step_s(self) -> float:
        return self._steps.mean

    def _observe_capacity(self, now: float, prompt: int) -> None:
        last = self._cap_last_t
        self._cap_last_t = now
        if last is None:  # the first step's start is unknown
            self._cap_span_t0 = now
            return
        if self._cap_span_tokens == 0 and prompt == 0:
            self._cap_span_t0 = now  # spans start at a step that prefills (its start = last)
            return
        if self._cap_span_tokens == 0:
            self._cap_span_t0 = last
        self._cap_span_tokens += prompt
        span = now - self._cap_span_t0
        if span < self._cap_span_s:
            return
        sample = self._cap_span_tokens / span
        self._cap_span_tokens = 0
        self._cap_span_t0 = now
        if now - self._cap_win_t0 >= self._cap_window_s:
            if self._cap_win_best > 0:
                self._cap_past.append(self._cap_win_best)
                self._cap_past_best = max(self._cap_past)  # once per window: O(windows)
            self._cap_win_t0 = now
            self._cap_win_best = 0.0
        self._cap_win_best = max(self._cap_win_best, sample)

    @property
    def prefill_capacity_tokens_per_s(self) -> float:
        return max(self._cap_win_best, self._cap_past_best)

    def _observe_prefix(self, pc: Any) -> None:
        if getattr(pc, "reset", False):
            self._prefix.clear()
            self._prefix_req = self._prefix_q = self._prefix_h = 0
        req = int(getattr(pc, "requests", 0))
        if req == 0:
            return
        q, h = int(getattr(pc, "queries", 0)), int(getattr(pc, "hits", 0))
        self._prefix.append((req, q, h))
        self._prefix_req += req
        self._prefix_q += q
        self._prefix_h += h
        while len(self._prefix) > 1 and self._prefix_req > self._prefix_window:
            r0, q0, h0 = self._prefix.popleft()
            self._prefix_req -= r0
            self._prefix_q -= q0
            self._prefix_h -= h0

    def _expire(self, now: float) -> None:
        horizon = now - self._window
        while self._rates and self._rates[0][0] < horizon:
            _, g, p = self._rates.popleft()
            self._gen_sum -= g
            self._prompt_sum -= p

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass

    # -- ours -----------------------------------------------------------------------------

    def mark_idle(self) -> None:
        """Forget the running/waiting counts (the engine stopped: no more stats will come)."""
        self._running = 0
        self._waiting = 0

    def snapshot(self) -> EngineLoad:
        self._expire(self._clock())
        return EngineLoad(
            num_running=self._running,
            num_waiting=self._waiting,
            kv_cache_usage=self._kv,
            prefix_cache_hit_rate=(self._prefix_h / self._prefix_q) if self._prefix_q else 0.0,
            generation_tokens_per_s=self._gen_sum / self._window,
            prompt_tokens_per_s=self._prompt_sum / self._window,
            kv_capacity_tokens=self.kv_capacity_tokens,
            prefill_capacity_tokens_per_s=self.prefill_capacity_tokens_per_s,
            decode_step_s=self.decode_step_s,
            output_tokens_mean=self._outputs.mean,
            step_model=self._fit.model(),
            stats_at=self._step_last_t or 0.0,
        )


def stat_logger_factory(sink: LoadStatLogger) -> Callable[[Any, int], Any]:
    """A per-engine StatLoggerFactory whose logger forwards to ``sink``.

    The subclass of vLLM's ``StatLoggerBase`` is made here (vllm imported lazily) and only
    forwards, so ``LoadStatLogger`` stays testable without vLLM.
    """
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Forwarder(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index
            self.vllm_config = vllm_config

        def record(self, scheduler_stats: Any, iteration_stats: Any,
                   mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            sink.record(scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)

        def log_engine_initialized(self) -> None:
            # The KV cache is sized by now (vLLM's own logger reads num_gpu_blocks here too).
            cache = getattr(self.vllm_config, "cache_config", None)
            blocks = getattr(cache, "num_gpu_blocks", None) or 0
            sink.kv_capacity_tokens = int(blocks) * int(getattr(cache, "block_size", 0) or 0)

    return _Forwarder
