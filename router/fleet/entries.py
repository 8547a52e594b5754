"""The registry's value types: what it knows about each node, and the views it hands out.

All frozen; the registry replaces an entry wholesale when it changes. Times are the
registry's clock (seconds, monotonic) unless the name says ``_unix_ms``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpumesh.router.scheduling.types import NodeState
from gpumesh.types import LoadReport, ModelSpec, Registration, RouterAccount


@dataclass(frozen=True)
class Report:
    """A node's last accepted heartbeat and what the registry derived from it.

    ``load`` is the report as the node sent it (every router's account in
    ``load.router_accounts``, GPUs in ``load.gpus``); ``account`` is this router's (None when
    the node sent none for it). ``step_s``: the node's decode step time in seconds
    (``speed.estimate_step_s``; 0 = never measured). ``running_avg``: ``num_running`` averaged
    over reports, the input of the next estimate."""

    seq: int
    sent_unix_ms: int
    received_at: float
    load: LoadReport
    account: RouterAccount | None = None
    step_s: float = 0.0
    running_avg: float = 0.0
    router_ids: tuple[str, ...] = ()   # the routers the node reported live streams to


@dataclass(frozen=True)
class NodeEntry:
    registration: Registration
    stream_id: int
    last_seen: float             # registration or last accepted heartbeat (the lease)
    report: Report | None = None
    drain_ordered: bool = False
    drain_reason: str = ""       # the operator's reason for drain_ordered

    @property
    def node_id(self) -> str:
        return self.registration.node_id

    @property
    def draining(self) -> bool:
        """An operator drain, or the node's last report says it drains."""
        return self.drain_ordered or (self.report is not None and self.report.load.draining)


def node_state(e: NodeEntry, now: float, freshness_s: float) -> tuple[NodeState, float]:
    """The node's state at ``now`` and its report's age in seconds (inf: never reported)."""
    age = now - e.report.received_at if e.report is not None else math.inf
    if e.draining:
        return NodeState.DRAINING, age
    if age > freshness_s:
        return NodeState.STALE, age
    return NodeState.HEALTHY, age


@dataclass(frozen=True)
class ModelSnapshot:
    """Nodes serving one model (canonical name), in node-id order: an immutable value."""

    model: str
    spec: ModelSpec
    nodes: tuple[NodeEntry, ...]


@dataclass(frozen=True)
class ModelSummary(ModelSpec):
    """A model as the whole fleet serves it: ``capacity_weight`` is the sum over its healthy
    (not draining) nodes, ``node_ids`` those nodes."""

    node_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeView:
    """A node for GetFleet / status."""

    entry: NodeEntry
    state: NodeState
    report_age_s: float
    router_in_flight: int
