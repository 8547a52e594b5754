"""LoRA adapters on vLLM's ``AsyncLLM``: load on demand, know which are loaded, time the loads.

``LoraAdapters.request_for(llm, ref)`` returns the ``LoRARequest`` a generate call takes,
loading the adapter first (``AsyncLLM.add_lora``, into the engine's LRU adapter cache of
``max_cpu_loras``) when the engine does not hold it, so the load is timed and a load failure
is this request's ``AdapterLoadFailed`` (FAILED_PRECONDITION), not an engine error mid-step.
Concurrent first requests for one adapter share one load. After each load the loaded set is
read back from the engine (``list_loras``: its cache evicts by itself), so ``loaded`` is what
the engine holds, not a guess. ``max_loras`` (adapters in one batch) is the engine's own
scheduling limit: requests beyond it wait in vLLM's queue.

``load_s`` is the mean wall-clock seconds of the last ``LOAD_WINDOW`` loads (0 before the
first): the router charges it to this node for requests whose adapter it does not hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from gpumesh.node.engines.base import AdapterLoadFailed, AdapterRef

log = logging.getLogger(__name__)

LOAD_WINDOW = 8


class LoraAdapters:
    """One engine's adapters (module doc). Event-loop only."""

    def __init__(self) -> None:
        self._by_id: dict[int, str] = {}
        self._loaded: frozenset[int] = frozenset()
        self._loading: dict[int, asyncio.Future[None]] = {}
        self._loads: deque[float] = deque(maxlen=LOAD_WINDOW)

    @property
    def loaded(self) -> tuple[str, ...]:
        """Names of the adapters the engine held at the last look, sorted."""
        return tuple(sorted(self._by_id[i] for i in self._loaded if i in self._by_id))

    @property
    def load_s(self) -> float:
        return sum(self._loads) / len(self._loads) if self._loads else 0.0

    @staticmethod
    def lora_request(ref: AdapterRef) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(ref.name, ref.int_id, ref.path)

    async def request_for(self, llm: Any, ref: AdapterRef) -> Any:
        """The adapter's ``LoRARequest``, loaded in the engine. Raises AdapterLoadFailed."""
        req = self.lora_request(ref)
        self._by_id[ref.int_id] = ref.name
        if ref.int_id in self._loaded:
            return req
        pending = self._loading.get(ref.int_id)
        if pending is None:
            pending = asyncio.ensure_future(self._load(llm, req))
            self._loading[ref.int_id] = pending
            pending.add_done_callback(lambda _: self._loading.pop(ref.int_id, None))
        await asyncio.shield(pending)
        return req

    async def _load(self, llm: Any, req: Any) -> None:
        t0 = time.monotonic()
        try:
            ok = await llm.add_lora(req)
        except Exception as e:  # vLLM raises many types for bad adapter files; one mapping
            raise AdapterLoadFailed(f"adapter {req.lora_name!r} from {req.lora_path}: "
                                    f"{type(e).__name__}: {e}") from e
        if ok is False:
            raise AdapterLoadFailed(f"adapter {req.lora_name!r}: the engine refused it")
        took = time.monotonic() - t0
        self._loads.append(took)
        try:
            self._loaded = frozenset(await llm.list_loras())
        except Exception:  # the load worked; the set is refreshed at the next load
            log.debug("list_loras failed", exc_info=True)
            self._loaded = self._loaded | {req.lora_int_id}
        log.info("adapter %s loaded in %.3f s (%d held)", req.lora_name, took,
                 len(self._loaded))
