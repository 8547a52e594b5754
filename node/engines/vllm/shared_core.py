"""One vLLM engine core shared by several front-end processes (``gpumesh.node.frontends``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpumesh.node.engines.base import EngineError
from gpumesh.node.engines.vllm.compat import import_entry_points
from gpumesh.node.engines.vllm.config import VllmEngineConfig
from gpumesh.node.engines.vllm.engine_args import engine_kwargs
from gpumesh.node.engines.vllm.lifetime import install as die_with_node

logger = logging.getLogger(__name__)


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
    single node process at one core.

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

        AsyncEngineArgs, _, serving = import_entry_points()
        die_with_node()  # the engine core and its workers end with this process
        args = AsyncEngineArgs(**engine_kwargs(self._config))
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


async def launch_shared_core(config: VllmEngineConfig,
                             count: int) -> tuple[SharedEngineCore, list[FrontendSlot]]:
    """Launch a ``SharedEngineCore`` for ``count`` front ends off the event loop; returns it
    and its slots. Cancelling stops the core once its launch (which cannot be interrupted)
    is over. Raises ``EngineError``."""
    core = SharedEngineCore(config, count)
    launch = asyncio.ensure_future(asyncio.to_thread(core.launch))
    try:
        return core, await asyncio.shield(launch)
    except asyncio.CancelledError:
        loop = asyncio.get_running_loop()
        launch.add_done_callback(lambda _: loop.run_in_executor(None, core.shutdown))
        raise
