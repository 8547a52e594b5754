"""vLLM's KV-cache events for the node: the engine publishes them, the node subscribes.

With ``VllmEngineConfig.kv_events`` the engine starts with vLLM's ``kv_events_config``
(``enable_kv_cache_events``, the ZMQ publisher bound to a private ``ipc://`` endpoint), and
``KvEventSubscriber`` reads its batches (``[topic, seq, msgpack(KVEventBatch)]``) on the
node's event loop. ``KvEventTranslator`` turns them into the node's block events
(``gpumesh.node.cache``): the engine's block hash depends on its per-process seed and its
block size (128 tokens on CPU, 16 on CUDA by default), so each stored engine block's token ids
are re-hashed with ``gpumesh.kvblocks`` in 16-token blocks, chained from the gpumesh hash of
the engine block's parent. A removed engine block removes the gpumesh blocks it was stored as.

Not mirrored: blocks on another medium than the GPU's (CPU offload tiers), and blocks with
extra hash keys (a LoRA adapter, multimodal inputs, a cache salt): a router's text hash
cannot match them, so they are left out (with their descendants). A gap in the batches' seq
(ZMQ dropped some at its high-water mark) clears the mirror: blocks are then learned again as
they are stored, and never reported held when they might not be.

A prefix-cache reset (``VllmEngine.reset_prefix_cache``) clears the mirror at once
(``KvEventTranslator.reset``): vLLM queues its AllBlocksCleared but publishes it only with
its next scheduler step, so an idle engine would otherwise be indexed as holding blocks it
dropped until its next request. The AllBlocksCleared that follows clears again (anything
mirrored in between was stored before the reset).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import tempfile
from collections.abc import Sequence
from typing import Any

from gpumesh.kvblocks import BLOCK_SIZE, block_hashes
from gpumesh.node.engines.base import KvEventSink

log = logging.getLogger(__name__)

TOPIC = "gpumesh-kv"


def new_endpoint() -> str:
    """A private ipc:// endpoint for one engine's publisher."""
    name = f"gpumesh-kv-{os.getpid()}-{secrets.token_hex(4)}.sock"
    return "ipc://" + os.path.join(tempfile.gettempdir(), name)


def kv_events_config(endpoint: str) -> Any:
    """vLLM's ``KVEventsConfig`` publishing on ``endpoint`` (an AsyncEngineArgs field)."""
    from vllm.config.kv_events import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                          topic=TOPIC)


class KvEventTranslator:
    """Engine block events -> gpumesh 16-token block events into ``sink`` (module doc)."""

    def __init__(self, sink: KvEventSink) -> None:
        self.sink = sink
        # engine block hash -> the gpumesh hashes it was stored as (its last = chain tip)
        self._blocks: dict[Any, tuple[int, ...]] = {}
        self._seq = -1
        self.gaps = 0

    def reset(self) -> None:
        """The engine's prefix cache was just reset: the mirror holds nothing (module doc)."""
        self._blocks.clear()
        self.sink.cleared()

    def batch(self, seq: int, events: Sequence[Any]) -> None:
        if self._seq >= 0 and seq != self._seq + 1:
            self.gaps += 1
            log.warning("KV events %d..%d lost: mirror cleared", self._seq + 1, seq - 1)
            self._blocks.clear()
            self.sink.cleared()
        self._seq = seq
        for ev in events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                self._stored(ev)
            elif kind == "BlockRemoved":
                self._removed(ev)
            elif kind == "AllBlocksCleared":
                self._blocks.clear()
                self.sink.cleared()

    def _stored(self, ev: Any) -> None:
        if (getattr(ev, "medium", None) not in (None, "GPU") or getattr(ev, "lora_name", None)
                or any(getattr(ev, "extra_keys", None) or ())):
            return
        size = int(ev.block_size)
        if size % BLOCK_SIZE:
            return   # our 16-token blocks cannot tile the engine's
        parent_key = ev.parent_block_hash
        if parent_key is None:
            parent = 0
        else:
            chain = self._blocks.get(parent_key)
            if not chain:
                return   # parent not mirrored (filtered, or before a gap): nor is this
            parent = chain[-1]
        tokens = list(ev.token_ids)
        out: list[int] = []
        for i, key in enumerate(ev.block_hashes):
            part = tokens[i * size:(i + 1) * size]
            if len(part) < size:
                break
            ours = tuple(block_hashes(part, BLOCK_SIZE, seed=parent))
            self._blocks[key] = ours
            out.extend(ours)
            parent = ours[-1]
        if out:
            self.sink.stored(out)

    def _removed(self, ev: Any) -> None:
        if getattr(ev, "medium", None) not in (None, "GPU"):
            return
        gone: list[int] = []
        for key in ev.block_hashes:
            ours = self._blocks.pop(key, None)
            if ours:
                gone.extend(ours)
        if gone:
            self.sink.removed(gone)


class KvEventSubscriber:
    """Reads the engine's published batches into a ``KvEventTranslator`` until closed."""

    def __init__(self, endpoint: str, translator: KvEventTranslator) -> None:
        self.endpoint = endpoint
        self.translator = translator
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="vllm-kv-events")

    async def _run(self) -> None:
        import msgspec
        import zmq
        import zmq.asyncio
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        sock.connect(self.endpoint)
        try:
            while True:
                _, seq_bytes, payload = await sock.recv_multipart()
                try:
                    batch = decoder.decode(payload)
                except msgspec.DecodeError:
                    log.warning("undecodable KV event batch dropped", exc_info=True)
                    continue
                self.translator.batch(int.from_bytes(seq_bytes, "big"), batch.events)
        finally:
            sock.close(0)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        path = self.endpoint.removeprefix("ipc://")
        if path != self.endpoint:
            with contextlib.suppress(OSError):
                os.unlink(path)
