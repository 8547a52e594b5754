"""``SimEngine``: the simulated engine (the package docstring describes its model)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import zlib
from array import array
from collections.abc import AsyncIterator, Sequence

from gpumesh.kvblocks import block_hashes
from gpumesh.node.engines.base import (
    EngineError,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    Finish,
    KvEventSink,
    PromptTooLong,
)
from gpumesh.node.engines.sim.adapters import SimAdapters
from gpumesh.node.engines.sim.config import SimEngineConfig
from gpumesh.node.engines.sim.scheduler import SimRequest, SimScheduler
from gpumesh.node.engines.sim.text import detokenize
from gpumesh.sim_tokenizer import SimTokenizer
from gpumesh.types import ModelSpec

log = logging.getLogger(__name__)


class SimEngine(SimScheduler):
    """A labelled simulator implementing :class:`gpumesh.node.engines.base.Engine` (see the
    package docstring)."""

    kind = "sim"

    def __init__(self, config: SimEngineConfig | None = None) -> None:
        super().__init__(config or SimEngineConfig())
        cfg = self.config
        self._spec = ModelSpec(
            name=cfg.model_name,
            aliases=tuple(cfg.aliases),
            max_context_length=cfg.max_context_length,
            tensor_parallel_size=1,
            capacity_weight=cfg.capacity_weight,
        )
        self._tok = SimTokenizer(cfg.vocab_size)
        # LoRA adapters: a simulated cache with a modelled load time (adapters.py)
        self.adapters = SimAdapters(cfg.max_loras, cfg.adapter_load_ms, cfg.time_scale)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

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
        return self._tok.render_chat(messages)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Queue the request at the first iteration (as vLLM's AsyncLLM does) and yield deltas.

        Errors (PromptTooLong, duplicate id, engine not running) raise from that first
        iteration. Deltas that pile up while the consumer is busy are merged into one output,
        like vLLM's RequestOutputCollector; a prompt consumer sees one output per step.
        """
        if request.adapter is not None:   # a simulated load first when it is not held
            await self.adapters.acquire(request.adapter.name)
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
        try:
            now: float | None = asyncio.get_running_loop().time()
        except RuntimeError:
            now = None
        load = self.load_at(now)
        if self.adapters.loads:
            load = dataclasses.replace(load, loaded_adapters=self.adapters.loaded,
                                       adapter_load_s=self.adapters.load_s)
        return load

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

    def set_kv_event_sink(self, sink: KvEventSink) -> bool:
        """Reports the prefix cache's block events (stored / removed / cleared) to ``sink``
        from now on; False when prefix caching is off (no events)."""
        if self.prefix is None:
            return False
        self.prefix.sink = sink
        if self.prefix.cached_blocks:
            sink.stored(self.prefix.hashes())
        return True

    # --- requests ------------------------------------------------------------------------

    def _add(self, request: EngineRequest) -> SimRequest:
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
        hashes = (tuple(block_hashes(request.prompt_token_ids, self._block))
                  if self.prefix is not None else ())
        req = SimRequest(rid, n_prompt, min(s.max_tokens, room), random.Random(seed),
                         0.0 if s.ignore_eos else self.config.eos_probability, tuple(s.stop),
                         hashes)
        self.add(req)
        assert self._wake is not None
        self._wake.set()
        return req

    # --- the step loop -----------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        wake = self._wake
        scale = self.config.time_scale
        max_lag = 0.05  # wall s: beyond this behind schedule, stop catching up (CPU overload)
        t = loop.time()
        while True:
            step = self.begin_step()
            if step is None:
                wake.clear()
                await wake.wait()
                t = loop.time()
                continue
            dt = step.duration_s
            if scale > 0:
                t += dt * scale
                delay = t - loop.time()
                if delay < -max_lag:
                    t = loop.time()
                await asyncio.sleep(max(0.0, delay))
            else:
                await asyncio.sleep(0)
            self.end_step(step, loop.time(), dt * scale if scale > 0 else dt)
