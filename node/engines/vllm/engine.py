"""``VllmEngine``: the node's Engine over vLLM's ``AsyncLLM`` (see the package docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from gpumesh.node.engines.base import (
    EngineError,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    EngineUnavailable,
    Finish,
    KvEventSink,
    PromptTooLong,
)
from gpumesh.node.engines.vllm.compat import (
    cache_vllm_envs,
    engine_error,
    import_entry_points,
    refresh_vllm_envs,
    sampling_params,
    vllm_error_types,
)
from gpumesh.node.engines.vllm.config import VllmEngineConfig
from gpumesh.node.engines.vllm.engine_args import engine_kwargs
from gpumesh.node.engines.vllm.lora import LoraAdapters
from gpumesh.node.engines.vllm.kv_events import (
    KvEventSubscriber,
    KvEventTranslator,
    kv_events_config,
    new_endpoint,
)
from gpumesh.node.engines.vllm.kv_transfer import (
    KvTransferTotals,
    apply_side_channel,
    request_extra_args,
)
from gpumesh.node.engines.vllm.lifetime import install as die_with_node
from gpumesh.node.engines.vllm.shared_core import (
    FrontendSlot,
    SharedEngineCore,
    launch_shared_core,
)
from gpumesh.node.engines.vllm.stats import LoadStatLogger, stat_logger_factory
from gpumesh.node.engines.vllm.worker import prepare_cpu_workers
from gpumesh.types import ModelSpec

if TYPE_CHECKING:
    from gpumesh.node.gpu import GpuSampler

logger = logging.getLogger(__name__)

_FINISH = {"stop": Finish.STOP, "length": Finish.LENGTH, "abort": Finish.ABORT}


def _shutdown_when_built(build: asyncio.Future[Any]) -> None:
    if not build.cancelled() and build.exception() is None:
        build.result().shutdown()


class VllmEngine:
    """``gpumesh.node.engines.base.Engine`` over vLLM's ``AsyncLLM``. One instance, one engine, one loop.

    Life cycle: construct (cheap) -> ``await start()`` (~20 s on CPU: config, child process,
    weights, KV cache) -> generate/abort/load -> ``await shutdown()``.
    """

    kind = "vllm"

    def __init__(self, config: VllmEngineConfig, gpu_sampler: GpuSampler | None = None, *,
                 frontends: int = 1, frontend: FrontendSlot | None = None) -> None:
        """``frontends`` > 1: ``start()`` launches a ``SharedEngineCore`` for that many front
        ends and joins it as front end 0; ``peer_slots`` then holds the others' slots, for the
        node to hand to its other front-end processes (gpumesh.node.frontends). ``frontend``: join an
        engine core launched elsewhere. Neither: a core of its own (one front end)."""
        if frontends < 1 or (frontend is not None and frontends != 1):
            raise ValueError("frontends must be >= 1, and 1 when joining with frontend=")
        # KV events (kv_events.py): the engine core publishes on a private endpoint, the main
        # front end subscribes once a sink is attached (set_kv_event_sink)
        self._kv_endpoint = new_endpoint() if config.kv_events and frontend is None else ""
        self._kv_subscriber: KvEventSubscriber | None = None
        self._config = config
        self._frontends = frontends
        self._frontend = frontend
        self._core: SharedEngineCore | None = None
        self.peer_slots: list[FrontendSlot] = []
        self._gpu_sampler = gpu_sampler
        self._stats = LoadStatLogger()
        self._loras = LoraAdapters()   # LoRA adapters, loaded on demand (lora.py)
        self._llm: Any = None
        self._tokenizer: Any = None
        self._max_model_len = config.max_model_len or 0
        self._shut = False
        self._sampler_task: asyncio.Task[None] | None = None
        self._kv_transfer = False            # a KV connector is configured (kv_transfer.py)
        self.kv_side_channel: tuple[str, int] | None = None   # NIXL's (host, port) once started

    @property
    def kv_transfers(self) -> KvTransferTotals:
        """What this engine's KV connector moved since start (zeros without one)."""
        return self._stats.kv_transfers

    @property
    def gpu_model(self) -> str:
        """The GPU's NVML name (the node registers it), "" without a sampler or NVML."""
        return getattr(self._gpu_sampler, "device_name", "") or ""

    @property
    def vllm_config(self) -> Any:
        """vLLM's ``VllmConfig`` of the started engine (scheduler, cache and model configs as
        vLLM resolved them); ``EngineUnavailable`` before ``start()``."""
        return self._engine().vllm_config

    # -- Engine protocol -----------------------------------------------------------------

    @property
    def model(self) -> ModelSpec:
        """The served model; ``max_context_length`` is vLLM's ``max_model_len`` once started."""
        return ModelSpec(
            name=self._config.name,
            aliases=tuple(self._config.aliases),
            max_context_length=self._max_model_len or 2048,
            tensor_parallel_size=self._config.tensor_parallel_size,
            capacity_weight=self._config.capacity_weight,
        )

    async def start(self) -> None:
        """Build the engine. Idempotent. Raises ``EngineError`` if vLLM fails to start.

        Does not block the event loop (the slow construction runs in a worker thread), so
        the node can serve health checks (NOT_SERVING) meanwhile. Cancelling ``start()``
        shuts the half-built engine down once its construction finishes.
        """
        if self._llm is not None:
            return
        # The first vllm import takes seconds, and some vllm modules keep an import-time
        # exception (with its frames) alive: importing in a worker thread keeps the loop
        # responsive and keeps this frame, and with it the engine, out of those tracebacks.
        AsyncEngineArgs, AsyncLLM, serving = await asyncio.to_thread(import_entry_points)
        if self._kv_endpoint and "kv_events_config" not in self._config.extra:
            self._config = dataclasses.replace(self._config, extra={
                **self._config.extra, "kv_events_config": kv_events_config(self._kv_endpoint)})
        # the engine core and its workers end when this process ends, however it ends
        die_with_node()
        kwargs = engine_kwargs(self._config)
        kv_config = kwargs.get("kv_transfer_config")
        self._kv_transfer = kv_config is not None
        await asyncio.to_thread(refresh_vllm_envs)
        if self._frontend is None:
            # before the engine core starts (this one's or a shared one): it reads these
            self.kv_side_channel = apply_side_channel(
                kv_config, self._config.kv_side_channel_host, self._config.kv_side_channel_port)
        if self._frontends > 1 and self._core is None:
            self._core, slots = await launch_shared_core(self._config, self._frontends)
            self._frontend, self.peer_slots = slots[0], slots[1:]
        args = AsyncEngineArgs(**kwargs)
        factory = stat_logger_factory(self._stats)
        t0 = time.monotonic()
        # Building the engine blocks for the whole engine-core start-up (tens of seconds:
        # config, child process, weights, KV cache, warm-up), so it runs in a worker thread.
        # AsyncLLM supports construction without a running loop: its output handler and
        # ZMQ sockets bind to the loop lazily, on first use, which is then this loop.
        # usage_context = the OpenAI server's, so unset scheduler limits take `vllm serve`'s
        # defaults for the hardware instead of the bare-engine fallback, whose lower
        # max_num_seqs would cap the requests a large GPU runs at once.
        if self._frontend is None:
            build = asyncio.ensure_future(
                asyncio.to_thread(AsyncLLM.from_engine_args, args, usage_context=serving,
                                  stat_loggers=[factory])
            )
        else:
            # One client of an engine core started elsewhere (SharedEngineCore): the config
            # says which of how many front ends this is, as vLLM's API-server processes do.
            slot = self._frontend
            args._api_process_count = slot.count
            args._api_process_rank = slot.index

            def build_client() -> Any:
                return AsyncLLM.from_vllm_config(
                    args.create_engine_config(usage_context=serving), usage_context=serving,
                    stat_loggers=[factory], client_addresses=dict(slot.addresses),
                    client_count=slot.count, client_index=slot.index)

            build = asyncio.ensure_future(asyncio.to_thread(build_client))
        try:
            llm = await asyncio.shield(build)
        except asyncio.CancelledError:
            # The thread cannot be interrupted; stop whatever it builds once it is done.
            build.add_done_callback(_shutdown_when_built)
            self._stop_core_later(build)
            raise
        except Exception as e:  # vLLM raises many types here; one boundary, one mapping
            self._stop_core_later(build)
            raise EngineError(f"vLLM failed to start for {self._config.model}: {e}") from e
        try:
            await prepare_cpu_workers(llm, args)
        except Exception as e:  # the engine is up but unusable: stop it, one mapping
            await asyncio.to_thread(llm.shutdown)
            self._stop_core_later(build)
            raise EngineError(f"vLLM worker set-up failed for {self._config.model}: {e}") from e
        self._llm = llm
        self._shut = False
        # Start the output handler now (as AsyncLLM does when built on a loop) so an engine
        # core that dies before the first request is noticed.
        run_handler = getattr(llm, "_run_output_handler", None)
        if callable(run_handler):
            run_handler()
        self._max_model_len = int(self._llm.model_config.max_model_len)
        self._tokenizer = self._llm.get_tokenizer()
        if self._kv_subscriber is not None:
            self._kv_subscriber.start()
        cache_vllm_envs()
        if self._gpu_sampler is not None and self._sampler_task is None:
            # One reading now, so the first heartbeat (sent once start() returns) carries GPU
            # samples and the registration its gpu_model; then one a second.
            await self._gpu_sampler.sample()
            self._sampler_task = asyncio.create_task(self._gpu_sampler.run(1.0))
        sched = getattr(getattr(llm, "vllm_config", None), "scheduler_config", None)
        logger.info(
            "vLLM engine ready: model=%s max_model_len=%d max_num_seqs=%s "
            "max_num_batched_tokens=%s in %.1fs",
            self._config.name, self._max_model_len, getattr(sched, "max_num_seqs", "?"),
            getattr(sched, "max_num_batched_tokens", "?"), time.monotonic() - t0,
        )

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` as vLLM would tokenize a text prompt (special tokens added)."""
        return list(self._tok().encode(text))

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Apply the model's chat template to (role, content) pairs, generation prompt added."""
        tok = self._tok()
        try:
            text = tok.apply_chat_template(
                [{"role": r, "content": c} for r, c in messages],
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception as e:  # no template, or a template that rejects the roles
            raise EngineError(f"chat template failed: {e}") from e
        # The template already wrote any BOS/special tokens it wants.
        return list(tok.encode(text, add_special_tokens=False))

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream deltas for ``request``; the last one carries ``finish``.

        Closing or cancelling the iteration aborts the request in vLLM. Errors come out as
        ``EngineError``: ``PromptTooLong`` (over the context window), ``InvalidRequest``
        (vLLM validation, e.g. a token id out of vocabulary), ``EngineOverloaded`` (vLLM's
        queue limits), else plain ``EngineError``.
        """
        from vllm.inputs import tokens_input

        engine_errors = vllm_error_types()[0]

        llm = self._engine()
        n = len(request.prompt_token_ids)
        if n >= self._max_model_len:
            raise PromptTooLong(
                f"prompt has {n} tokens; the model's context window is {self._max_model_len}"
            )
        params = sampling_params(request)
        if request.kv_transfer_params is not None:
            params.extra_args = request_extra_args(request.kv_transfer_params, self._kv_transfer)
        # An already-rendered engine input: vLLM skips its (deprecated) raw-prompt path.
        prompt = tokens_input(list(request.prompt_token_ids))
        lora = None
        if request.adapter is not None:   # loaded first (timed); AdapterLoadFailed on failure
            lora = await self._loras.request_for(llm, request.adapter)
        try:
            async with contextlib.aclosing(
                llm.generate(prompt, params, request.request_id, lora_request=lora)
            ) as stream:
                async for out in stream:
                    c = out.outputs[0]
                    finish = None
                    kv_params = None
                    if out.finished:
                        if c.finish_reason == "error":
                            raise EngineError(f"vLLM failed request {request.request_id}")
                        # Anything else vLLM may add later ends the stream like a stop.
                        finish = _FINISH.get(c.finish_reason or "", Finish.STOP)
                        if request.kv_transfer_params is not None:
                            kv_params = getattr(out, "kv_transfer_params", None)
                    if not c.token_ids and not c.text and finish is None:
                        continue
                    yield EngineOutput(tuple(c.token_ids), c.text, finish, kv_params)
        except engine_errors as e:
            raise engine_error(e) from e

    async def abort(self, request_id: str) -> None:
        """Abort by the request id given to ``generate``; its stream ends with ``ABORT``."""
        if self._llm is None:
            return
        await self._llm.abort(request_id)

    def load(self) -> EngineLoad:
        """Latest scheduler snapshot plus the latest GPU sample; O(1), no I/O."""
        snap = self._stats.snapshot()
        if self._config.enable_lora:
            snap = dataclasses.replace(snap, loaded_adapters=self._loras.loaded,
                                       adapter_load_s=self._loras.load_s)
        if self._gpu_sampler is not None:
            return dataclasses.replace(snap, gpus=self._gpu_sampler.latest)
        return snap

    async def reset_prefix_cache(self) -> bool:
        """Empties the engine's prefix cache (vLLM's ``reset_prefix_cache``: refused, False,
        while a request holds KV blocks). On success the KV event sink hears ``cleared`` at
        once (kv_events.py), so routers stop counting on the dropped prefixes."""
        if self._llm is None:
            return False
        ok = bool(await self._llm.reset_prefix_cache())
        if ok and self._kv_subscriber is not None:
            self._kv_subscriber.translator.reset()
        return ok

    def set_kv_event_sink(self, sink: KvEventSink) -> bool:
        """Mirrors the engine's KV events into ``sink`` (kv_events.py) from the start (or
        now); False when the engine was configured without KV events."""
        if not self._kv_endpoint:
            return False
        if self._kv_subscriber is None:
            self._kv_subscriber = KvEventSubscriber(self._kv_endpoint, KvEventTranslator(sink))
            if self._llm is not None:
                self._kv_subscriber.start()
        return True

    async def shutdown(self) -> None:
        """Abort what is left and stop the engine core process. Idempotent."""
        if self._kv_subscriber is not None:
            await self._kv_subscriber.close()
            self._kv_subscriber = None
        if self._sampler_task is not None:
            self._sampler_task.cancel()
            await asyncio.gather(self._sampler_task, return_exceptions=True)
            self._sampler_task = None
        if self._llm is None:
            return
        self._shut = True
        llm = self._llm
        # Stop vLLM's output handler first: otherwise it sees the engine core vanish and
        # logs an EngineDeadError traceback for what is an orderly stop.
        handler = getattr(llm, "output_handler", None)
        if isinstance(handler, asyncio.Task) and not handler.done():
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        # Joins the engine core process (seconds): blocking, so off the loop.
        await asyncio.to_thread(llm.shutdown)
        if self._core is not None:  # a shared core: its other front ends have stopped
            await asyncio.to_thread(self._core.shutdown)
            self._core = None
        # Drop it now: AsyncLLM.__del__ shuts down again, which fails noisily if it only
        # runs at interpreter exit.
        self._llm = None
        self._stats.mark_idle()
        logger.info("vLLM engine stopped: model=%s", self._config.name)

    # -- internals -------------------------------------------------------------------------

    def _stop_core_later(self, build: asyncio.Future[Any]) -> None:
        """Start-up failed or was cancelled: stop a shared core this engine launched once its
        client's construction (which cannot be interrupted) is over."""
        core, self._core = self._core, None
        if core is not None:  # (blocking: off the loop)
            loop = asyncio.get_running_loop()
            build.add_done_callback(lambda _: loop.run_in_executor(None, core.shutdown))

    def _engine(self) -> Any:
        if self._llm is None:
            raise EngineUnavailable("engine shut down" if self._shut else "engine still starting")
        return self._llm

    def _tok(self) -> Any:
        if self._tokenizer is None:
            raise EngineUnavailable("engine shut down" if self._shut else "engine still starting")
        return self._tokenizer
