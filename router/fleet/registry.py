"""Fleet membership as soft state, and the reads the request path and operators make of it.

Who calls it: the ControlPlane servicer (register / heartbeat / deregister / stream_closed),
a sweeper task (``expire``), the dispatcher (``resolve``, ``candidate_source``, ``charge``)
and GetFleet / ListModels (``fleet``, ``models``). Single-threaded: everything runs on one
event loop, so there are no locks.

Membership rules
- A node joins with a Registration on its Connect stream and stays while it heartbeats. It
  leaves at once on Deregistration or when that stream closes, and when its lease expires
  (no heartbeat for ``lease_ttl_s``). Only the stream that registered a node can change it:
  a late close of an old stream never removes a reconnected node.
- Heartbeat ``seq`` must increase per registration: duplicates and out-of-order ones are
  ignored. A report older than ``freshness_s`` makes the node STALE: routable, but scored
  from this router's counts only. A draining report (or drain) makes it DRAINING.
- A new ``incarnation`` for a known node id (the node restarted) resets the router's
  accounting for it (its ``CreditLedger``); the same incarnation reconnecting keeps it (the
  node's per-router counters are cumulative per incarnation).

Reads on the request path go through the per-node candidate cache (``candidates`` module);
``snapshot(model)`` gives operators an immutable ``ModelSnapshot``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from gpumesh.router import errors
from gpumesh.router.fleet.candidates import (
    Index,
    LazyCandidates,
    Slot,
    build_candidate,
    build_index,
)
from gpumesh.router.fleet.entries import (
    ModelSnapshot,
    ModelSummary,
    NodeEntry,
    NodeView,
    Report,
    node_state,
)
from gpumesh.router.fleet.ledger import Credit, CreditLedger
from gpumesh.router.fleet.peers import Clock, PeerShare
from gpumesh.router.fleet.predictions import PredictionTracker
from gpumesh.router.fleet.speed import ModelSpeeds, estimate_step_s
from gpumesh.router.scheduling.types import Candidate, NodeState
from gpumesh.types import LoadReport, Registration

log = logging.getLogger(__name__)


class Registry:
    def __init__(self, router_id: str, *, lease_ttl_s: float, freshness_s: float,
                 max_concurrency_default: int = 0, known_model_retention_s: float = 60.0,
                 peer_share_half_life_s: float = 10.0, step_from_report: bool = True,
                 clock: Clock = time.monotonic, fleet_rebuild_s: float = -1.0) -> None:
        self.router_id = router_id
        self.step_from_report = step_from_report   # RouterConfig.membership.step_from_report
        self.lease_ttl_s = lease_ttl_s
        self.freshness_s = freshness_s
        self.max_concurrency_default = max_concurrency_default
        self.known_model_retention_s = known_model_retention_s
        self.clock = clock
        # Until one lease has passed since start (fleet_rebuild_s), nodes may still be
        # re-registering (a restarted router): an unknown model is then UNAVAILABLE with a
        # retry hint.
        self.started_at = clock()
        self.fleet_rebuild_s = lease_ttl_s if fleet_rebuild_s < 0 else fleet_rebuild_s
        # This router's share of all routers' dispatches (0 = off: peers ignored).
        self.peers = PeerShare(router_id, peer_share_half_life_s, clock)
        self.speeds = ModelSpeeds()
        # observed / predicted times per node -> Candidate.prediction_scale (fleet.predictions)
        self.predictions = PredictionTracker(clock=clock)
        self._typical: dict[str, tuple[float, float]] = {}   # model -> (when, typical scale)
        self._nodes: dict[str, NodeEntry] = {}
        self._ledgers: dict[str, CreditLedger] = {}
        self._index = Index()
        self._gone_models: dict[str, float] = {}
        self._listeners: list[Callable[[frozenset[str]], None]] = []
        self._removal_listeners: list[Callable[[NodeEntry], None]] = []

    # --- listeners (wiring: the dispatcher pumps its queues, transport closes channels)

    def add_listener(self, cb: Callable[[frozenset[str]], None]) -> None:
        """``cb(models)`` after any change that may free capacity or change candidates."""
        self._listeners.append(cb)

    def add_removal_listener(self, cb: Callable[[NodeEntry], None]) -> None:
        self._removal_listeners.append(cb)

    def _notify(self, models: Iterable[str]) -> None:
        ms = frozenset(models)
        for cb in self._listeners:
            cb(ms)

    # --- control plane

    def register(self, reg: Registration, stream_id: int) -> None:
        now = self.clock()
        old = self._nodes.get(reg.node_id)
        ledger = self._ledgers.get(reg.node_id)
        if ledger is None or ledger.incarnation != reg.incarnation:
            if ledger is not None:
                log.info("node %s restarted (incarnation %s -> %s): accounting reset",
                         reg.node_id, ledger.incarnation, reg.incarnation)
            self._ledgers[reg.node_id] = CreditLedger(reg.incarnation,
                                                      self._releaser(reg.node_id))
        self._nodes[reg.node_id] = NodeEntry(reg, stream_id, now)
        log.info("node %s registered at %s serving %s", reg.node_id, reg.address,
                 [m.name for m in reg.models])
        self._rebuild()
        affected = {m.name for m in reg.models}
        if old is not None:
            affected |= {m.name for m in old.registration.models}
        self._notify(affected)

    def heartbeat(self, node_id: str, stream_id: int, seq: int, sent_unix_ms: int,
                  load: LoadReport, router_ids: tuple[str, ...] = ()) -> bool:
        """Applies a heartbeat (every router's account in ``load.router_accounts``); False
        when ignored (unknown node, other stream, old seq). ``router_ids``: the routers the
        node reports to (validated by the caller)."""
        entry = self._nodes.get(node_id)
        if entry is None or entry.stream_id != stream_id:
            return False
        if entry.report is not None and seq <= entry.report.seq:
            return False
        now = self.clock()
        ours = next((a for a in load.router_accounts if a.router_id == self.router_id), None)
        self.peers.observe(node_id, load.router_accounts)
        self._ledgers[node_id].on_report(ours)
        step_s, running_avg = estimate_step_s(load, entry.report, now, self.step_from_report)
        self.speeds.observe(entry.registration.models, step_s,
                            load.prefill_capacity_tokens_per_s)
        report = Report(seq, sent_unix_ms, now, load, ours, step_s, running_avg, router_ids)
        was_draining = entry.draining
        # An ordered drain ends when the node, having reported draining, reports it no longer
        # drains (an operator undrained it through another router).
        ordered = entry.drain_ordered and not (
            entry.report is not None and entry.report.load.draining and not load.draining)
        self._nodes[node_id] = replace(entry, report=report, last_seen=now,
                                       drain_ordered=ordered,
                                       drain_reason=entry.drain_reason if ordered else "")
        if was_draining != self._nodes[node_id].draining:
            self._rebuild()   # capacity sums change
        else:
            self._replace_in_snapshots(self._nodes[node_id])
        self._ledgers[node_id].housekeep(now)
        self._notify(m.name for m in entry.registration.models)
        return True

    def deregister(self, node_id: str, stream_id: int, reason: str = "") -> None:
        self._remove(node_id, stream_id, f"deregistered ({reason})" if reason else "deregistered")

    def stream_closed(self, node_id: str, stream_id: int) -> None:
        self._remove(node_id, stream_id, "control stream closed")

    def drain(self, node_id: str, reason: str = "") -> None:
        """Stops routing to a node (operator drain); it stays listed until it leaves."""
        entry = self._nodes.get(node_id)
        if entry is not None and not entry.drain_ordered:
            self._nodes[node_id] = replace(entry, drain_ordered=True, drain_reason=reason)
            self._rebuild()
            self._notify(m.name for m in entry.registration.models)

    def undrain(self, node_id: str) -> None:
        """Undoes ``drain`` (a node that reports draining itself stays DRAINING)."""
        entry = self._nodes.get(node_id)
        if entry is not None and entry.drain_ordered:
            self._nodes[node_id] = replace(entry, drain_ordered=False, drain_reason="")
            self._rebuild()
            self._notify(m.name for m in entry.registration.models)

    def expire(self) -> list[str]:
        """Removes nodes whose lease expired; returns their ids. Called by a sweeper."""
        now = self.clock()
        gone = [e for e in self._nodes.values() if now - e.last_seen > self.lease_ttl_s]
        for e in gone:
            # WARNING: a live node that goes silent (stalled, partitioned) leaves the fleet
            self._remove(e.node_id, e.stream_id,
                         f"lease expired (no heartbeat for {now - e.last_seen:.1f}s, lease "
                         f"{self.lease_ttl_s}s)", level=logging.WARNING)
        cutoff = now - self.known_model_retention_s
        for name in [n for n, t in self._gone_models.items() if t < cutoff]:
            del self._gone_models[name]
        for node_id in [n for n in self._ledgers if n not in self._nodes]:
            ledger = self._ledgers[node_id]
            if ledger.in_flight == 0:
                del self._ledgers[node_id]   # a node coming back starts a fresh ledger
        for ledger in list(self._ledgers.values()):
            ledger.housekeep(now)   # blind credits past their time bound (the timer path)
        return [e.node_id for e in gone]

    def _remove(self, node_id: str, stream_id: int, why: str, level: int = logging.INFO) -> None:
        entry = self._nodes.get(node_id)
        if entry is None or entry.stream_id != stream_id:
            return
        del self._nodes[node_id]
        self.peers.forget(node_id)
        self.predictions.forget(node_id)
        log.log(level, "node %s removed: %s", node_id, why)
        self._rebuild()
        for cb in self._removal_listeners:
            cb(entry)
        self._notify(m.name for m in entry.registration.models)

    def _releaser(self, node_id: str) -> Callable[[], None]:
        def released() -> None:
            entry = self._nodes.get(node_id)
            if entry is not None:
                self._notify(m.name for m in entry.registration.models)
        return released

    # --- snapshots and index (rebuilt on change only)

    def _rebuild(self) -> None:
        old = self._index
        self._index = build_index(self._nodes.values(), self._ledgers, old)
        now = self.clock()
        for name in old.snapshots:
            if name not in self._index.snapshots:
                self._gone_models[name] = now
        for name in self._index.snapshots:
            self._gone_models.pop(name, None)

    def _replace_in_snapshots(self, entry: NodeEntry) -> None:
        """A node's entry changed (heartbeat): O(1), its slots take it in place."""
        for slot in self._index.slots.get(entry.node_id, ()):
            slot.entry = entry
            slot.valid_until = -math.inf

    # --- request path

    def resolve(self, model: str) -> str:
        """Canonical model name for a name or alias; empty -> the only model served.

        Raises RouterError: NOT_FOUND (unknown, listing served models), INVALID_ARGUMENT
        (empty with several served), UNAVAILABLE (none served, or its nodes all left, or
        unknown within one lease of this router's start: the fleet is still rebuilding)."""
        index = self._index
        if not model:
            if len(index.snapshots) == 1:
                return next(iter(index.snapshots))
            if not index.snapshots:
                raise errors.no_models()
            raise errors.model_required(index.snapshots)
        name = index.by_name.get(model)
        if name is not None:
            return name
        if not index.snapshots:   # no node at all: transient, whatever the name
            raise errors.no_models()
        if model in self._gone_models:
            raise errors.no_healthy_node(model, {"*": "every node serving it has left"})
        age = self.clock() - self.started_at
        if age < self.fleet_rebuild_s:
            raise errors.fleet_rebuilding(model, age,
                                          min(0.5, max(0.1, self.fleet_rebuild_s - age)))
        raise errors.model_not_found(model, index.snapshots)

    def snapshot(self, model: str) -> ModelSnapshot | None:
        """The model's nodes now, as an immutable value (operators, tests)."""
        m = self._index.snapshots.get(model)
        return None if m is None else ModelSnapshot(m.model, m.spec,
                                                    tuple(s.entry for s in m.slots))

    def ledger(self, node_id: str) -> CreditLedger:
        return self._ledgers[node_id]

    def entry(self, node_id: str) -> NodeEntry | None:
        return self._nodes.get(node_id)

    def state_of(self, e: NodeEntry, now: float) -> tuple[NodeState, float]:
        return node_state(e, now, self.freshness_s)

    def candidates(self, model: str) -> list[Candidate]:
        """The model's live nodes as frozen candidates, read now (leases checked here too,
        so a decision never uses an expired node even between sweeps)."""
        return self.candidate_source(model).all()

    def candidate_source(self, model: str, exclude: frozenset[str] = frozenset()
                         ) -> LazyCandidates:
        """The model's candidates for one decision, built lazily from the per-node cache
        (``at(i)`` for a sample, ``all()`` for every live node); ``exclude``: node ids left
        out (a retry's failed nodes)."""
        snap = self._index.snapshots.get(model)
        slots = snap.slots if snap is not None else ()
        now = self.clock()
        typical = self._typical_scale(model, slots, now)
        return LazyCandidates(lambda s, t: self._build(s, t, typical), slots, now, exclude)

    def _typical_scale(self, model: str, slots: Sequence[Slot], now: float) -> float:
        """The model's typical prediction scale (``PredictionTracker.typical_scale``), kept
        for a second: what its nodes without recent samples are predicted with."""
        hit = self._typical.get(model)
        if hit is not None and now - hit[0] < 1.0:
            return hit[1]
        if len(self._typical) > 4096:
            self._typical.clear()
        v = self.predictions.typical_scale(s.entry.node_id for s in slots)
        self._typical[model] = (now, v)
        return v

    def _build(self, s: Slot, now: float, typical: float = 1.0) -> Candidate | None:
        return build_candidate(s, now, lease_ttl_s=self.lease_ttl_s,
                               freshness_s=self.freshness_s,
                               max_concurrency_default=self.max_concurrency_default,
                               peer_factor=self.peers.factor, speeds=self.speeds,
                               prediction_scale=self.predictions.scale(s.entry.node_id,
                                                                       typical, now))

    def charge(self, node_id: str, tokens: int, *, blind: bool = False, hold_s: float = 0.0,
               slot_until_finish: bool = True) -> Credit:
        return self._ledgers[node_id].charge(tokens, self.clock(), blind=blind, hold_s=hold_s,
                                             slot_until_finish=slot_until_finish)

    # --- reads for operators

    def models(self) -> list[ModelSummary]:
        now = self.clock()
        out = []
        for name, m in sorted(self._index.snapshots.items()):
            snap = ModelSnapshot(m.model, m.spec, tuple(s.entry for s in m.slots))
            live = [e for e in snap.nodes if now - e.last_seen <= self.lease_ttl_s]
            healthy = [e for e in live if not e.draining]
            weight = sum(m.capacity_weight for e in healthy for m in e.registration.models
                         if m.name == name)
            tp = max((m.tensor_parallel_size for e in live for m in e.registration.models
                      if m.name == name), default=snap.spec.tensor_parallel_size)
            out.append(ModelSummary(name, snap.spec.aliases, snap.spec.max_context_length, tp,
                                    weight, snap.spec.adapters,
                                    node_ids=tuple(e.node_id for e in live)))
        return out

    def fleet(self) -> list[NodeView]:
        now = self.clock()
        out = []
        for e in sorted(self._nodes.values(), key=lambda e: e.node_id):
            state, age = self.state_of(e, now)
            out.append(NodeView(e, state, age, self._ledgers[e.node_id].in_flight))
        return out

    def __len__(self) -> int:
        return len(self._nodes)
