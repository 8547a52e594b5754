"""SIMULATED LoRA adapters for the simulated engine: a bounded cache of loaded adapters and a
modelled load time, reported like a vLLM node's.

- At most ``slots`` adapters are held (``SimEngineConfig.max_loras``); loading one more evicts
  the least recently used (vLLM's adapter cache does the same).
- A request whose adapter is not held waits ``load_ms`` simulated milliseconds (x
  ``time_scale`` in wall-clock time; no wait at ``time_scale`` 0) before it enters the
  scheduler's queue; requests arriving meanwhile for the same adapter wait for that one load.
  Not modelled: a load stalling the other requests' steps (vLLM loads between steps), and
  ``max_loras`` as a per-batch limit (every held adapter may run in one step).
- ``loaded`` and ``load_s`` (mean seconds of the recent loads, wall-clock; simulated seconds
  at ``time_scale`` 0) go into the engine's ``load()`` and so into heartbeats.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque

LOAD_WINDOW = 8


class SimAdapters:
    """The simulated adapter cache (module doc). Event-loop only."""

    def __init__(self, slots: int, load_ms: float, time_scale: float) -> None:
        if slots < 1 or load_ms < 0:
            raise ValueError("slots must be >= 1 and load_ms >= 0")
        self.slots = slots
        self._load_s = load_ms / 1000.0
        self._scale = time_scale
        self._held: OrderedDict[str, None] = OrderedDict()
        self._loading: dict[str, asyncio.Future[None]] = {}
        self._loads: deque[float] = deque(maxlen=LOAD_WINDOW)
        self.loads = 0       # loads done (cumulative)
        self.evictions = 0

    @property
    def loaded(self) -> tuple[str, ...]:
        return tuple(sorted(self._held))

    @property
    def load_s(self) -> float:
        return sum(self._loads) / len(self._loads) if self._loads else 0.0

    async def acquire(self, name: str) -> None:
        """Returns once ``name`` is held (loading it first when it is not)."""
        if name in self._held:
            self._held.move_to_end(name)
            return
        pending = self._loading.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self._load(name))
            self._loading[name] = pending
            pending.add_done_callback(lambda _: self._loading.pop(name, None))
        await asyncio.shield(pending)

    async def _load(self, name: str) -> None:
        wall = self._load_s * self._scale
        await asyncio.sleep(wall)
        self._held[name] = None
        self._held.move_to_end(name)
        while len(self._held) > self.slots:
            self._held.popitem(last=False)
            self.evictions += 1
        self.loads += 1
        self._loads.append(wall if self._scale > 0 else self._load_s)
