"""The simulated engine's scheduler: vLLM v1's continuous batching over a paged KV cache, one
step at a time, the step-time model and the load signals (the package docstring describes
them). No asyncio and no clock of its own: whoever drives it passes the time in.

Driving it (``SimEngine`` does this on the event loop's clock; the fleet simulator
``gpumesh_bench.sim`` on a virtual clock)::

    sched.add(req)                              # the admission path: queue a request
    step = sched.begin_step()                   # None when idle; else what the step runs
    ... the step lasts step.duration_s ...
    firsts, done = sched.end_step(step, now)    # tokens appear; requests finish
    sched.load_at(now)                          # the EngineLoad a heartbeat carries
"""

from __future__ import annotations

from collections import deque

from gpumesh.node.engines.base import OUTPUT_WINDOW_S, EngineLoad, Finish, WindowMean
from gpumesh.node.engines.sim.config import SimEngineConfig, SimStats
from gpumesh.node.engines.sim.prefix_cache import PrefixCache
from gpumesh.node.engines.sim.request import SimRequest, SimStep, attention_context
from gpumesh.node.engines.sim.text import check_stop
from gpumesh.node.engines.sim.transfer import KvTransfers
from gpumesh.types import StepModel

# Window of decode_step_s (seconds of the driver's clock): the mean length of the steps that
# ended in it. The same as a vLLM node's (gpumesh.node.engines.vllm.stats): long enough to
# span a wave of requests that start and finish together, so equal nodes report equal steps.
STEP_WINDOW_S = 3.0


class SimScheduler(KvTransfers):
    """The requests of one simulated engine, its KV blocks, its step model and its load
    signals (module docstring: how to drive it). ``SimEngine`` adds the Engine protocol and
    the step loop on an event loop; ``KvTransfers`` the legs of disaggregated serving."""

    def __init__(self, config: SimEngineConfig) -> None:
        self.config = cfg = config
        self._vocab = cfg.vocab_size
        self._eos = cfg.eos
        self._reqs: dict[str, SimRequest] = {}
        self._running: list[SimRequest] = []
        self._waiting: deque[SimRequest] = deque()
        self._init_transfers()
        self._block = cfg.kv_block_size
        self._total_blocks = cfg.kv_capacity_tokens // cfg.kv_block_size
        self._free_blocks = self._total_blocks
        # vLLM's automatic prefix caching (free blocks include its evictable ones)
        self.prefix: PrefixCache | None = (
            PrefixCache(cfg.kv_block_size) if cfg.prefix_caching else None)
        self._gen = 0
        self._preempt = 0
        self._finished = 0
        self._aborted = 0
        self._steps = 0
        self._busy = 0.0
        self._prefill = 0
        self._samples: deque[tuple[float, int, int]] = deque()  # (t, gen, prefill)
        # the lengths of the steps of the last STEP_WINDOW_S (driver's clock)
        self._step_log = WindowMean(STEP_WINDOW_S)
        self._out_log = WindowMean(OUTPUT_WINDOW_S)   # output tokens of finished requests
        self._prefill_capacity = self.prefill_capacity_tokens_per_s()

    # --- driving ---------------------------------------------------------------------

    def add(self, req: SimRequest) -> None:
        """The admission path: the request joins the waiting queue (the next step may admit
        it). The caller has checked its id is new and its prompt fits the context. Raises
        ValueError (adding nothing) when its prompt and its longest output could not fit the
        KV cache even alone: it could never finish (vLLM rejects such a request too)."""
        if -(-(req.prompt_len + req.max_out) // self._block) > self._total_blocks:
            raise ValueError(
                f"request {req.id!r}: {req.prompt_len} prompt + {req.max_out} output tokens "
                f"exceed the KV cache of {self._total_blocks * self._block} tokens")
        self._reqs[req.id] = req
        self._waiting.append(req)

    @property
    def idle(self) -> bool:
        """No request running or waiting."""
        return not self._running and not self._waiting

    def begin_step(self) -> SimStep | None:
        """Schedules the next step (None when there is nothing to run) and counts it."""
        if not self._running and not self._waiting:
            return None
        scheduled, n_dec, n_pre = self._schedule()
        if not scheduled and not self._running:
            # every running request was preempted (no admission in that step): admit now
            scheduled, n_dec, n_pre = self._schedule()
        if not scheduled:  # cannot happen: a request alone always fits (add); never spin
            return None
        c = self.config
        if c.step_b_decode_context_ms or c.step_c_prefill_ms:
            dt = self.step_time_s(n_dec, n_pre, *attention_context(scheduled))
        else:
            dt = self.step_time_s(n_dec, n_pre)
        self._steps += 1
        self._busy += dt
        self._prefill += n_pre
        return SimStep(scheduled, n_dec, n_pre, dt)

    def end_step(self, step: SimStep, now: float, measured_s: float | None = None
                 ) -> tuple[list[SimRequest], list[SimRequest]]:
        """Ends ``step`` at ``now`` (driver's clock, seconds): its tokens appear. Returns the
        requests that got their first token in it and those that finished in it.
        ``measured_s``: the step's length on the driver's clock (default its duration)."""
        firsts, done = self._apply(step.scheduled)
        self._step_log.add(now, step.duration_s if measured_s is None else measured_s)
        for r in done:
            self._out_log.add(now, len(r.out))
        if not self._samples or now - self._samples[-1][0] >= 0.25:
            self._sample(now)
        return firsts, done

    # --- load signals ------------------------------------------------------------------

    def load_at(self, now: float | None) -> EngineLoad:
        """The engine's load as of ``now`` (driver's clock); ``now`` None: no clock running,
        the rates are 0."""
        gen_rate, prompt_rate = self._rates(now)
        return EngineLoad(
            num_running=len(self._running),
            num_waiting=len(self._waiting) + len(self._loading),
            kv_cache_usage=(self._total_blocks - self._free_blocks) / self._total_blocks,
            prefix_cache_hit_rate=self.prefix.hit_rate if self.prefix is not None else 0.0,
            generation_tokens_per_s=gen_rate,
            prompt_tokens_per_s=prompt_rate,
            kv_capacity_tokens=self._total_blocks * self._block,
            prefill_capacity_tokens_per_s=self._prefill_capacity,
            decode_step_s=self.decode_step_s(),
            output_tokens_mean=self._out_log.mean,
            step_model=self.step_model(),
        )

    def step_model(self) -> StepModel | None:
        """The linear step model this engine runs (wall-clock ms: its constants / speed x
        time_scale), reported as a live node reports its online fit (``LoadReport.
        step_model``); None before its first step, as a live node has fitted nothing yet."""
        if self._steps == 0:
            return None
        c = self.config
        k = (c.time_scale if c.time_scale > 0 else 1.0) / c.speed
        return StepModel(c.step_a_ms * k, c.step_b_decode_ms * k, c.step_b_prefill_ms * k,
                         self._steps, 0.0)

    def decode_step_s(self) -> float:
        """Mean length (driver's clock) of the steps of the last ``STEP_WINDOW_S`` (the last
        busy window while idle); 0 before a step."""
        return self._step_log.mean

    @property
    def stats(self) -> SimStats:
        return SimStats(self._steps, self._busy, self._gen, self._prefill, self._preempt,
                        self._finished, self._aborted)

    def _sample(self, now: float) -> None:
        s = self._samples
        s.append((now, self._gen, self._prefill))
        horizon = now - self.config.rate_window_s
        while len(s) > 2 and s[1][0] <= horizon:
            s.popleft()

    def _rates(self, now: float | None) -> tuple[float, float]:
        if now is None:
            return 0.0, 0.0
        if not self._samples or now - self._samples[-1][0] >= 0.25:
            self._sample(now)
        t0, g0, p0 = self._samples[0]
        span = now - t0
        if span <= 0:
            return 0.0, 0.0
        span = max(span, 1.0)  # a fresh window does not report a burst as a huge rate
        return (self._gen - g0) / span, (self._prefill - p0) / span

    # --- the model ---------------------------------------------------------------------

    def step_time_s(self, decode_tokens: int, prefill_tokens: int, decode_context: int = 0,
                    prefill_pairs: int = 0) -> float:
        """Simulated duration of one step (seconds), before ``time_scale``; the context
        arguments feed the attention terms (``gpumesh.profiles``: ``decode_context`` = the
        decoding sequences' lengths summed, ``prefill_pairs`` = the pairs its prefill
        chunks attend over)."""
        c = self.config
        ms = c.step_a_ms + c.step_b_decode_ms * decode_tokens + c.step_b_prefill_ms * prefill_tokens
        if c.step_c_decode_ms:
            ms += c.step_c_decode_ms * decode_tokens * decode_tokens
        if decode_context or prefill_pairs:
            ms += c.step_b_decode_context_ms * decode_context + c.step_c_prefill_ms * prefill_pairs
        gpu_s = ms / c.speed / 1000.0
        if c.front_end_tokens_per_s > 0:
            return max(gpu_s, decode_tokens / c.front_end_tokens_per_s)
        return gpu_s

    def prefill_capacity_tokens_per_s(self) -> float:
        """Prompt tokens per wall-clock second a full-budget prefill step does (package
        docstring); per simulated second when ``time_scale`` is 0."""
        c = self.config
        budget = c.max_num_batched_tokens
        rate = budget / self.step_time_s(0, budget)
        return rate / c.time_scale if c.time_scale > 0 else rate

    @property
    def free_kv_blocks(self) -> int:
        return self._free_blocks

    def _free(self, req: SimRequest) -> None:
        if req.cached:
            assert self.prefix is not None
            self._free_blocks += (req.blocks - len(req.cached)
                                  + self.prefix.release(req.cached))
            req.cached = []
        else:
            self._free_blocks += req.blocks
        req.blocks = 0
        req.upto = 0

    def _drop(self, req: SimRequest, finish: Finish) -> None:
        """Abort: free KV at once, unlink, wake the consumer."""
        if req.finish is not None:
            return
        req.finish = finish
        self._free(req)
        self._reqs.pop(req.id, None)
        self._loading.pop(req.id, None)
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

    def _schedule(self) -> tuple[list[tuple[SimRequest, int]], int, int]:
        cfg = self.config
        B = self._block
        budget = cfg.max_num_batched_tokens
        running = self._running
        scheduled: list[tuple[SimRequest, int]] = []
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
                    victim.remote = False  # its transferred KV is gone: recompute
                    self._waiting.appendleft(victim)
                    self._preempt += 1
                    preempted = True
                    if victim is req:
                        self_preempted = True
                        break
                if self_preempted:
                    break
                if self.prefix is not None:
                    self.prefix.make_room(self._free_blocks, need)
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
                if req.remote:  # a decode leg (transfer.py): 0 or 1 token
                    n = self._schedule_remote(req, scheduled)
                    if n < 0:
                        break  # KV full: it waits (holding no block)
                    budget -= n
                    n_dec += n
                    continue
                n = self._admit(req, budget)
                if n == 0:
                    break  # KV full: it waits (holding no block)
                waiting.popleft()
                running.append(req)
                scheduled.append((req, n))
                budget -= n
                n_pre += n
        return scheduled, n_dec, n_pre

    def _apply(self, scheduled: list[tuple[SimRequest, int]]
               ) -> tuple[list[SimRequest], list[SimRequest]]:
        firsts: list[SimRequest] = []
        done: list[SimRequest] = []
        gen = 0
        for req, n in scheduled:
            if req.finish is not None:
                continue  # aborted during the step
            req.computed += n
            if req.hashes and self.prefix is not None:
                self._cache_blocks(req)
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
                    check_stop(req, tid)
            gen += 1
            if len(out) == 1:
                firsts.append(req)
            if req.finish is None and len(out) >= req.max_out:
                req.finish = Finish.LENGTH
            if req.finish is not None:
                done.append(req)
                self._free_or_hold(req)
                del self._reqs[req.id]
                self._finished += 1
            w = req.waiter
            if w is not None and not w.done():
                w.set_result(None)
        self._gen += gen
        if done:
            self._running = [r for r in self._running if r.finish is None]
        return firsts, done

    def _admit(self, req: SimRequest, budget: int) -> int:
        """Allocates the KV of a waiting request's first chunk (at most ``budget`` tokens),
        all or nothing as vLLM's ``allocate_slots``: its cached leading prompt blocks are
        shared with it (they skip prefill; at least the last prompt token is computed) and
        empty blocks taken for the rest of the chunk. Returns the chunk's tokens, or 0 when
        the KV cannot take it now; then nothing changed, so a waiting request never holds a
        block (one that did could keep the KV from ever fitting the requests ahead of it)."""
        assert req.blocks == 0 and not req.cached, "a waiting request holds no KV block"
        B = self._block
        cache = self.prefix
        hashes = req.hashes if cache is not None else ()
        k = taken = 0
        if hashes:
            assert cache is not None
            k = min(cache.match(hashes), (req.prompt_len - 1) // B)
        if k > 0:
            assert cache is not None
            refs = cache._refs
            taken = sum(1 for h in hashes[:k] if refs[h] == 0)  # evictable ones leave "free"
            # the rest of the prompt's first chunk must fit beside the shared blocks
            rest = min(req.prompt_len - k * B, self.config.max_num_batched_tokens)
            if -(-rest // B) > self._free_blocks - taken:
                return 0
        n = req.prompt_len + len(req.out) - k * B
        if n > budget:  # noqa: PLR1730
            n = budget
        need = -(-(k * B + n) // B) - k
        if need + taken > self._free_blocks:
            return 0
        if hashes:
            assert cache is not None
            if k > 0:
                hit = hashes[:k]
                self._free_blocks -= cache.acquire(hit)
                req.cached = list(hit)
                req.upto = k
            cache.record_lookup(req.prompt_len, k * B)
        if cache is not None:
            cache.make_room(self._free_blocks, need)
        req.computed = k * B
        req.blocks = k + need
        self._free_blocks -= need
        return n

    def _cache_blocks(self, req: SimRequest) -> None:
        """Caches the prompt blocks ``req`` has now fully computed (vLLM caches each full
        block as soon as its KV is written)."""
        cache = self.prefix
        assert cache is not None
        full = min(req.computed, req.prompt_len) // self._block
        for i in range(req.upto, min(full, len(req.hashes))):
            h = req.hashes[i]
            if cache.insert(h):
                req.cached.append(h)
        if full > req.upto:
            req.upto = full
