"""The request path's view of the fleet: per-model node slots, each caching its ``Candidate``.

The registry keeps a name/alias -> model index and, per model, a tuple of ``Slot`` (one per
node serving it), both replaced when membership changes (``build_index``), never per request.
A slot holds the node's current entry (replaced in place on heartbeat / drain) and its cached
``Candidate``, rebuilt (``build_candidate``) only when something it reads changed: a heartbeat
or drain (the entry is replaced), a dispatch / first token / finish / report on the node's
ledger (its ``version`` moves), or a time boundary (the report going stale, the lease ending,
a blind credit's time bound: ``valid_until``). So a decision costs O(1) per node it looks at
and a heartbeat O(1); a membership change rebuilds the index in O(nodes), keeping the slots
of unchanged nodes.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from gpumesh.router.fleet.entries import NodeEntry, node_state
from gpumesh.router.fleet.ledger import CreditLedger
from gpumesh.router.fleet.speed import ModelSpeeds
from gpumesh.router.scheduling.types import Candidate, NodeState
from gpumesh.types import ModelSpec


class Slot:
    """One node serving one model: its current entry and its cached Candidate."""

    __slots__ = ("cand", "entry", "ledger", "spec", "valid_until", "version")

    def __init__(self, entry: NodeEntry, spec: ModelSpec, ledger: CreditLedger) -> None:
        self.entry = entry
        self.spec = spec
        self.ledger = ledger
        self.cand: Candidate | None = None
        self.valid_until = -math.inf     # -inf: not built; cand None when built = lease over
        self.version = -1


@dataclass(frozen=True)
class ModelSlots:
    """One model's slots in node-id order: replaced wholesale when membership changes; its
    slots' entries and cached candidates move in place (heartbeats, dispatches)."""

    model: str
    spec: ModelSpec
    slots: tuple[Slot, ...]


@dataclass
class Index:
    by_name: dict[str, str] = field(default_factory=dict)         # name or alias -> model
    snapshots: dict[str, ModelSlots] = field(default_factory=dict)
    slots: dict[str, tuple[Slot, ...]] = field(default_factory=dict)   # node id -> its slots


def build_index(nodes: Iterable[NodeEntry], ledgers: Mapping[str, CreditLedger],
                old: Index) -> Index:
    """The index over ``nodes``. A model's spec merges its nodes' aliases and takes the
    largest context; a real model name always wins over another model's alias. Slots of nodes
    whose entry, spec and ledger are unchanged since ``old`` are kept (with their cache)."""
    by_model: dict[str, list[tuple[NodeEntry, ModelSpec]]] = {}
    specs: dict[str, ModelSpec] = {}
    by_name: dict[str, str] = {}
    for e in sorted(nodes, key=lambda e: e.node_id):
        for m in e.registration.models:
            by_model.setdefault(m.name, []).append((e, m))
            prev = specs.get(m.name)
            specs[m.name] = m if prev is None else replace(
                prev, aliases=tuple(dict.fromkeys(prev.aliases + m.aliases)),
                max_context_length=max(prev.max_context_length, m.max_context_length),
                adapters=tuple(dict.fromkeys(prev.adapters + m.adapters)))
    for name, spec in specs.items():
        for alias in spec.aliases:
            by_name.setdefault(alias, name)
    for name in specs:
        by_name[name] = name
    snapshots: dict[str, ModelSlots] = {}
    node_slots: dict[str, list[Slot]] = {}
    old_slots = {(slot.entry.node_id, m): slot for m, ms in old.snapshots.items()
                 for slot in ms.slots}
    for n, model_spec in specs.items():
        slots = []
        for e, spec in by_model[n]:   # linear in the models listed (never per pair)
            slot = old_slots.get((e.node_id, n))
            if (slot is None or slot.entry is not e or slot.spec != spec
                    or slot.ledger is not ledgers[e.node_id]):
                slot = Slot(e, spec, ledgers[e.node_id])
            slots.append(slot)
            node_slots.setdefault(e.node_id, []).append(slot)
        snapshots[n] = ModelSlots(n, model_spec, tuple(slots))
    return Index(by_name, snapshots, {k: tuple(v) for k, v in node_slots.items()})


def build_candidate(s: Slot, now: float, *, lease_ttl_s: float, freshness_s: float,
                    max_concurrency_default: int, peer_factor: float,
                    speeds: ModelSpeeds, prediction_scale: float = 1.0) -> Candidate | None:
    """Rebuilds a slot's cached candidate as of ``now`` (None: lease over).
    ``prediction_scale``: the node's observed / predicted TTFT ratio (``fleet.predictions``;
    it moves with an observation, which comes with a credit change on the node's ledger, so
    the cached candidate is rebuilt before the next decision reads it, and, for a node
    without recent samples, with its model's typical scale, read at the next rebuild: at
    least every ``freshness_s``, when the node's report ages).

    A fresh report is passed on with the node's step time; where the node has measured no
    step or prefill capacity of its own, the model's reference speed scaled by its weight
    fills in (``ModelSpeeds.fill``). A STALE node gets no report: scorers use this router's
    counts only."""
    e = s.entry
    ledger = s.ledger
    ledger.housekeep(now)   # before reading: a release may call back into the router
    lease_end = e.last_seen + lease_ttl_s
    if now > lease_end:
        s.cand, s.valid_until, s.version = None, math.inf, ledger.version
        return None   # until the next heartbeat replaces the entry
    state, age = node_state(e, now, freshness_s)
    tokens, requests = ledger.unreported()
    report = e.report
    fresh = report is not None and state is not NodeState.STALE
    valid_until = min(lease_end, ledger.next_expiry)
    if fresh and state is NodeState.HEALTHY and report is not None:
        valid_until = min(valid_until, report.received_at + freshness_s)
    if fresh and report is not None:
        load, step_s = report.load, report.step_s
        if step_s <= 0 or load.prefill_capacity_tokens_per_s <= 0:
            load, step_s = speeds.fill(load, step_s, s.spec)
    else:
        load, step_s = None, 0.0
    c = Candidate(
        node_id=e.node_id, address=e.registration.address, state=state,
        capacity_weight=s.spec.capacity_weight,
        max_concurrency=e.registration.max_concurrency or max_concurrency_default,
        report=load, report_age_s=age,
        kv_cache_usage=report.load.kv_cache_usage if report is not None else 0.0,
        router_in_flight=ledger.in_flight,
        outstanding_prompt_tokens=ledger.pending_tokens,
        outstanding_requests=ledger.pending_requests,
        unreported_prompt_tokens=tokens, unreported_requests=requests,
        decode_delta=ledger.decode_delta(), peer_factor=peer_factor, step_s=step_s,
        adapters=s.spec.adapters, prediction_scale=prediction_scale,
        role=e.registration.role)
    s.cand, s.valid_until, s.version = c, valid_until, ledger.version
    return c


class LazyCandidates:
    """A model's candidates for one decision, read lazily (``at``) so that a sampled decision
    builds only the candidates it looks at. Index order = node-id order. Valid for the
    decision it was made for (it holds that decision's clock reading). ``build`` rebuilds a
    slot's candidate (the registry's ``build_candidate`` with its settings)."""

    __slots__ = ("_build", "_exclude", "_now", "_slots")

    def __init__(self, build: Callable[[Slot, float], Candidate | None],
                 slots: tuple[Slot, ...], now: float, exclude: frozenset[str]) -> None:
        self._build = build
        self._slots = slots
        self._now = now
        self._exclude = exclude

    def __len__(self) -> int:
        return len(self._slots)

    def at(self, i: int) -> Candidate | None:
        """The i-th node's candidate; None when its lease is over or it is excluded."""
        s = self._slots[i]
        if self._exclude and s.entry.registration.node_id in self._exclude:
            return None
        if s.version == s.ledger.version and self._now < s.valid_until:
            return s.cand
        return self._build(s, self._now)

    def index_of(self, node_id: str) -> int | None:
        """The index of ``node_id`` (binary search over the node-id order), None if absent."""
        slots = self._slots
        i = bisect.bisect_left(slots, node_id, key=lambda s: s.entry.registration.node_id)
        if i < len(slots) and slots[i].entry.registration.node_id == node_id:
            return i
        return None

    def all(self) -> list[Candidate]:
        out = []
        now, build, exclude = self._now, self._build, self._exclude
        for s in self._slots:
            if exclude and s.entry.registration.node_id in exclude:
                continue
            if s.version == s.ledger.version and now < s.valid_until:
                c = s.cand
            else:
                c = build(s, now)
            if c is not None:
                out.append(c)
        return out
