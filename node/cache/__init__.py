"""The node's prefix-cache state for routers: the engine's KV block events (vLLM's KV events,
or the simulator's) mirrored per model and streamed to every router as batched deltas with a
sequence number, and a snapshot on (re)connect or when a router saw a gap (``publisher``)."""

from gpumesh.node.cache.publisher import KvPublisher, KvSubscription

__all__ = ["KvPublisher", "KvSubscription"]
