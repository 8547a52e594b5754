"""Fleet membership as soft state, and this router's own per-node accounting.

Who calls it: the ControlPlane servicer (register / heartbeat / deregister / stream_closed),
a sweeper task (``expire``), the dispatcher (``resolve``, ``candidates``, ``charge``) and
GetFleet / ListModels (``fleet``, ``models``). Single-threaded: everything runs on one event
loop, so there are no locks.

Membership rules
- A node joins with a Registration on its Connect stream and stays while it heartbeats. It
  leaves at once on Deregistration or when that stream closes, and when its lease expires
  (no heartbeat for ``lease_ttl_s``). Only the stream that registered a node can change it:
  a late close of an old stream never removes a reconnected node.
- Heartbeat ``seq`` must increase per registration: duplicates and out-of-order ones are
  ignored. A report older than ``freshness_s`` makes the node STALE: routable, but scored
  from this router's counts only. A draining report (or drain) makes it DRAINING.
- A new ``incarnation`` for a known node id (the node restarted) resets the router's
  accounting for it; the same incarnation reconnecting keeps it (the node's per-router
  counters are cumulative per incarnation).

Reads on the request path are a per-model list of node slots and a name/alias -> model index,
both replaced on membership change (never rebuilt per request); ``snapshot(model)`` gives
operators an immutable ``ModelSnapshot`` value. The request path's list holds one ``_Slot`` per
node: the node's current entry and its cached
``Candidate``, which is rebuilt only when something it reads changed -- a heartbeat or drain
(the entry is replaced), a dispatch / first token / finish / report on the node's ledger (its
``version`` moves), or a time boundary (the report going stale, the lease ending, a blind
credit's time bound: ``valid_until``). So a decision costs O(1) per node it looks at, and a
heartbeat O(1) (membership changes still rebuild the snapshots: O(nodes)).

Accounting (``NodeLedger``): each dispatch gets a per-node ordinal and a ``Credit`` holding its
prompt-token estimate. A credit is outstanding until the request's first token:
- proxy streams: released by the dispatcher at the first token it forwards, one by one;
- unary and lookaside (the router sees no first token): released oldest-first as the node's
  reported ``first_token_requests`` for this router grows, or at a time bound, or (unary) at
  completion. Never wholesale at a heartbeat.
A credit is "not yet in the last report" when its ordinal is above the report's
``admitted_requests`` (corrected for requests the node never admitted, e.g. rejected ones).

The decode term's D (``decode_delta``, see router/scheduling/scorers.py) is this router's
requests in flight now minus how many of them the last report held (the reported part capped
at 0: requests the node had ended before the report whose ends are still on the way to the
router are no change). A node that sends
``finished_requests`` says so itself (admitted - finished, bounded by this router's own
reported requests in flight: an earlier process's requests under the same router id and
lookaside requests are in the node's count but not in ours); without it (older nodes,
foreign engines) every in-flight request up to the cutoff is taken as held, so a finish seen
after a report counts as one since it -- twice when the report already had it.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from gpumesh.router import errors
from gpumesh.router.scheduling.types import Candidate, LoadSample, NodeState

log = logging.getLogger(__name__)

Clock = Callable[[], float]


# ---------------------------------------------------------------------------- value types


@dataclass(frozen=True)
class ModelSpec:
    name: str
    aliases: tuple[str, ...] = ()
    max_context_length: int = 0
    tensor_parallel_size: int = 1
    capacity_weight: float = 1.0


@dataclass(frozen=True)
class NodeRegistration:
    node_id: str
    address: str
    models: tuple[ModelSpec, ...]
    incarnation: str
    engine: str = ""
    gpu_model: str = ""
    max_concurrency: int = 0  # 0 = the router's default
    kind: str = "gpumesh"
    # the node's front-end processes' own addresses (several per engine; transport spreads)
    frontend_addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class AccountSample:
    """This router's cumulative counters as one node reported them (RouterAccount)."""

    admitted_requests: int = 0
    admitted_prompt_tokens: int = 0
    first_token_requests: int = 0
    first_token_prompt_tokens: int = 0
    # Of the admitted, those that ended (any way); None when the node does not report it (an
    # older node, a foreign engine's adapter): the ledger then infers D as before.
    finished_requests: int | None = None


# Time constant of the running-count average: a node's generation rate is its tokens over
# the last few seconds (simulator 5 s, vLLM node 3 s), and an exponential average with this
# constant has about the same mean age, so average running / rate is a step time.
STEP_AVERAGE_S = 2.0


def _with_step_time(load: LoadSample, previous: Report | None, now: float,
                    from_report: bool = True) -> tuple[LoadSample, float]:
    """``load`` with ``step_s``, the node's decode step time, and the new running average.

    The node's own timing (``decode_step_s``, the mean interval between its engine's recent
    steps) where it reports one and ``from_report``; otherwise inferred: each running request
    samples one token a step, so step = running / generation rate.
    The rate is an average over the node's last few seconds while num_running is the count
    at the report: their ratio swings several-fold when a node runs a few requests (one
    simulated node at ~3 running read 4-35 ms against a 7 ms step), so the running count is
    averaged over reports first. A node without a rate keeps the previous step (an idle
    node keeps its last measured speed); 0 = never measured."""
    if previous is None:
        avg = float(load.num_running)
        prev_step = 0.0
    else:
        w = 1.0 - math.exp(-max(now - previous.received_at, 0.0) / STEP_AVERAGE_S)
        avg = previous.running_avg + w * (load.num_running - previous.running_avg)
        prev_step = previous.load.step_s
    g = load.generation_tokens_per_s
    if from_report and load.decode_step_s > 0:
        step = load.decode_step_s
    else:
        step = avg / g if g > 0 and avg > 0 else prev_step
    return (load if step == load.step_s else replace(load, step_s=step)), avg


@dataclass(frozen=True)
class GpuStat:
    index: int
    utilization: float
    memory_used_bytes: int
    memory_total_bytes: int


@dataclass(frozen=True)
class Report:
    seq: int
    sent_unix_ms: int
    received_at: float           # registry clock
    load: LoadSample
    account: AccountSample | None = None   # ours; None when the node sent no account for us
    gpus: tuple[GpuStat, ...] = ()
    accounts: tuple[tuple[str, AccountSample], ...] = ()  # every router's, for display
    # The node's num_running averaged over reports (exponential, STEP_AVERAGE_S), for the
    # step time estimate (``_with_step_time``).
    running_avg: float = 0.0


@dataclass(frozen=True)
class NodeEntry:
    registration: NodeRegistration
    stream_id: int
    registered_at: float
    last_seen: float             # registration or last accepted heartbeat (lease)
    report: Report | None = None
    drain_ordered: bool = False

    @property
    def node_id(self) -> str:
        return self.registration.node_id


class _Slot:
    """One node serving one model, as the request path sees it: the node's current entry
    (replaced in place on heartbeat / drain) and its cached Candidate (see the module doc)."""

    __slots__ = ("cand", "entry", "ledger", "spec", "valid_until", "version")

    def __init__(self, entry: NodeEntry, spec: ModelSpec, ledger: NodeLedger) -> None:
        self.entry = entry
        self.spec = spec
        self.ledger = ledger
        self.cand: Candidate | None = None
        self.valid_until = -math.inf     # -inf: not built; cand None when built = lease over
        self.version = -1


@dataclass(frozen=True)
class ModelSnapshot:
    """Nodes serving one model (canonical name), in node-id order: an immutable value."""

    model: str
    spec: ModelSpec
    nodes: tuple[NodeEntry, ...]


@dataclass(frozen=True)
class _ModelSlots:
    """The request path's view of one model: replaced wholesale when membership changes; its
    slots' entries and cached candidates move in place (heartbeats, dispatches)."""

    model: str
    spec: ModelSpec
    slots: tuple[_Slot, ...]


class LazyCandidates:
    """A model's candidates for one decision, read lazily (``at``) so that a sampled decision
    builds only the candidates it looks at. Index order = node-id order. Valid for the
    decision it was made for (it holds that decision's clock reading)."""

    __slots__ = ("_exclude", "_now", "_reg", "_slots")

    def __init__(self, reg: Registry, slots: tuple[_Slot, ...], now: float,
                 exclude: frozenset[str]) -> None:
        self._reg = reg
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
        return self._reg._build(s, self._now)

    def all(self) -> list[Candidate]:
        out = []
        now, build, exclude = self._now, self._reg._build, self._exclude
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


@dataclass(frozen=True)
class ModelSummary:
    name: str
    aliases: tuple[str, ...]
    max_context_length: int
    tensor_parallel_size: int
    capacity_weight: float        # sum over healthy (not draining) nodes
    node_ids: tuple[str, ...]


@dataclass(frozen=True)
class NodeView:
    """A node for GetFleet / status."""

    entry: NodeEntry
    state: NodeState
    report_age_s: float
    router_in_flight: int


# ---------------------------------------------------------------------------- accounting


class Credit:
    """One dispatched request's claim on a node. ``blind`` = the router will not see its first
    token (unary, lookaside); ``holds_slot`` = it counts in router in-flight until
    ``finish`` (proxy and unary) rather than until its tokens are released (lookaside)."""

    __slots__ = (
        "blind",
        "expires_at",
        "ledger",
        "ordinal",
        "pending",
        "slot",
        "slot_until_finish",
        "tokens",
    )

    def __init__(self, ledger: NodeLedger, ordinal: int, tokens: int, blind: bool,
                 expires_at: float, slot_until_finish: bool) -> None:
        self.ledger = ledger
        self.ordinal = ordinal
        self.tokens = tokens
        self.blind = blind
        self.expires_at = expires_at
        self.pending = True          # tokens still counted (before first token)
        self.slot = True             # counted in router in-flight
        self.slot_until_finish = slot_until_finish

    def first_token(self) -> None:
        """The router forwarded this request's first token (proxy streams)."""
        self.ledger.first_token(self)

    def finish(self, admitted: bool = True) -> None:
        """The request ended (any outcome). ``admitted=False`` when the node refused it before
        admission, so its ordinal never appears in the node's admitted count."""
        self.ledger.finish(self, admitted)


class NodeLedger:
    """This router's counts for one node incarnation (see the module docstring)."""

    def __init__(self, incarnation: str, on_release: Callable[[], None] | None = None) -> None:
        self.incarnation = incarnation
        self.dispatched = 0
        self.in_flight = 0
        self._pending: dict[int, Credit] = {}   # ordinal order = dispatch order
        self._pending_tokens = 0
        self._rejected: list[int] = []          # ordinals the node never admitted, sorted
        self._rejected_below = 0                # pruned rejected ordinals <= cutoff
        self._cutoff = 0                        # ordinals <= cutoff are in the last report
        self._unreported_tokens = 0             # pending credits with ordinal > cutoff
        self._unreported_n = 0
        # The decode term's input (``decode_delta``): requests whose finish this router sees
        # (proxy, unary) still in flight, split by ordinal at the cutoff (above: not in the
        # last report whatever their phase; at or below: ``_live_reported``), how many of them
        # the last report held (``_held``), and lookaside credits (finish unseen) pending and
        # unreported.
        self._live_unreported: set[int] = set()
        self._live_reported = 0
        self._held = 0
        self._blind_slot_unreported = 0
        self._synced = False
        self._base_admitted = 0
        self._base_first = 0
        self._proxy_first_seen = 0
        self._blind_done = 0
        self._on_release = on_release
        # Bumped by every change a Candidate reads (the registry's per-node cache checks it).
        self.version = 0
        # No blind credit expires before this (a lower bound: may be early, never late).
        self.next_expiry = math.inf

    # --- dispatch side

    def charge(self, tokens: int, now: float, *, blind: bool, hold_s: float,
               slot_until_finish: bool = True) -> Credit:
        self.dispatched += 1
        c = Credit(self, self.dispatched, max(int(tokens), 0), blind, now + hold_s,
                   slot_until_finish)
        self._pending[c.ordinal] = c
        self._pending_tokens += c.tokens
        self._unreported_tokens += c.tokens     # a new ordinal is above any report's cutoff
        self._unreported_n += 1
        if slot_until_finish:
            self._live_unreported.add(c.ordinal)
        else:
            self._blind_slot_unreported += 1
        self.in_flight += 1
        self.version += 1
        if blind and c.expires_at < self.next_expiry:
            self.next_expiry = c.expires_at
        return c

    def first_token(self, c: Credit) -> None:
        if c.pending and not c.blind:
            self._proxy_first_seen += 1
        self._release_tokens(c)

    def finish(self, c: Credit, admitted: bool) -> None:
        if c.pending and not admitted:
            bisect.insort(self._rejected, c.ordinal)
        elif c.pending and c.blind:
            self._blind_done += 1   # a finished unary request had its first token
        self._release_tokens(c)
        self._release_slot(c)

    def _release_tokens(self, c: Credit) -> None:
        if c.pending:
            c.pending = False
            self.version += 1
            self._pending.pop(c.ordinal, None)
            self._pending_tokens -= c.tokens
            if c.ordinal > self._cutoff:
                self._unreported_tokens -= c.tokens
                self._unreported_n -= 1
                if not c.slot_until_finish:
                    self._blind_slot_unreported -= 1
            if not c.slot_until_finish:
                self._release_slot(c)

    def _release_slot(self, c: Credit) -> None:
        if c.slot:
            c.slot = False
            self.version += 1
            self.in_flight -= 1
            if c.slot_until_finish:
                if c.ordinal > self._cutoff:
                    self._live_unreported.discard(c.ordinal)
                else:
                    self._live_reported -= 1
            if self._on_release is not None:
                self._on_release()

    # --- report side

    def on_report(self, account: AccountSample | None) -> None:
        self.version += 1   # the cutoff (what counts as unreported) may move
        a = account or AccountSample()
        if not self._synced:
            # A node's counters are cumulative per incarnation and may predate this ledger
            # (router restarted with the same id): take the offset from the first report.
            self._synced = True
            self._base_admitted = max(0, a.admitted_requests - self.dispatched
                                      + len(self._rejected))
            self._base_first = max(0, a.first_token_requests - self._proxy_first_seen
                                   - self._blind_done)
        admitted = max(0, a.admitted_requests - self._base_admitted)
        cutoff = admitted + self._rejected_below
        i = 0
        while i < len(self._rejected) and self._rejected[i] <= cutoff:
            cutoff += 1
            i += 1
        self._rejected_below += i
        del self._rejected[:i]
        new_cutoff = max(self._cutoff, min(cutoff, self.dispatched))
        live = self._live_unreported
        for ordinal in range(self._cutoff + 1, new_cutoff + 1):   # now in a report
            c = self._pending.get(ordinal)
            if c is not None:
                self._unreported_tokens -= c.tokens
                self._unreported_n -= 1
                if not c.slot_until_finish:
                    self._blind_slot_unreported -= 1
            if ordinal in live:
                live.discard(ordinal)
                self._live_reported += 1
        self._cutoff = new_cutoff
        # How many of this router's requests still in flight the report holds. Without the
        # node's finished count: all of them up to the cutoff (a finish the router sees after
        # the report is taken to have come after it). With it: admitted - finished, the
        # node's own count, so a finish that reached the node before the report but this
        # router after it is not subtracted twice. Raw counters: an earlier process's
        # admissions under this router id are in both and cancel once its requests end; until
        # then (and for lookaside requests, whose finish this router never sees) the node
        # holds more than this router counts in flight, so the bound keeps the estimate
        # between the exact one and the inferred one.
        self._held = self._live_reported
        if a.finished_requests is not None:
            self._held = min(self._live_reported,
                             max(0, a.admitted_requests - a.finished_requests))
        # Blind credits: release oldest-first as the node's first-token count grows.
        blind_first = max(0, a.first_token_requests - self._base_first - self._proxy_first_seen)
        if self._blind_done < blind_first:
            for c in [c for c in self._pending.values() if c.blind]:
                if self._blind_done >= blind_first:
                    break
                self._blind_done += 1
                self._release_tokens(c)

    def housekeep(self, now: float) -> None:
        """Releases blind credits past their time bound. Cheap when none is due (``now`` before
        ``next_expiry``); the registry calls it when it reads the node and from its sweeper."""
        if now < self.next_expiry:
            return
        expired = [c for c in self._pending.values() if c.blind and c.expires_at <= now]
        self.next_expiry = min((c.expires_at for c in self._pending.values()
                                if c.blind and c.expires_at > now), default=math.inf)
        for c in expired:
            self._blind_done += 1
            self._release_tokens(c)

    # --- reads

    @property
    def pending_tokens(self) -> int:
        return self._pending_tokens

    @property
    def pending_requests(self) -> int:
        return len(self._pending)

    def decode_delta(self) -> int:
        """How far the node's running + waiting requests have moved since its last report, as
        far as this router's requests show it: its requests in flight now (those whose finish
        it sees: proxy, unary) minus how many of them the report held, plus lookaside
        requests pending and unreported (their finish is not seen). The report holds
        admitted - finished when the node sends ``finished_requests``; otherwise every
        in-flight request up to the report's admission cutoff, so that a finish seen after the
        report counts as one since it. The reported part is capped at 0: the requests the
        router still counted in flight at the report beyond what the node held had already
        ended at the node (their ends were on the way), so the first finishes seen after the
        report are theirs and change nothing; only finishes beyond them lower D. May be
        negative. O(1)."""
        return (len(self._live_unreported) + min(0, self._live_reported - self._held)
                + self._blind_slot_unreported)

    def unreported(self) -> tuple[int, int]:
        """(prompt tokens, requests) outstanding and dispatched after the last report. O(1):
        kept as running sums (charge adds, a release or a report's cutoff subtracts)."""
        return self._unreported_tokens, self._unreported_n


class PeerShare:
    """This router's share of the admissions its nodes report across every router, and its
    inverse ``factor`` (>= 1): how many requests all routers together are estimated to
    dispatch for each one this router dispatches.

    Why: a decision sees the fleet as of each node's last report plus THIS router's own
    dispatches since; its peers' dispatches since that report (other ``--workers`` processes,
    other replicas) are invisible until the next one. With W equal routers every one of them
    sees the same report and, counting only its own 1/W of the traffic, moves its estimate
    of a node W times too slowly: all of them keep sending to the node that reported the
    lighter load for the whole heartbeat interval, the next report shows the overshoot, and
    the split of in-flight requests between equal nodes swings by about one interval's
    arrivals. Scaling this router's unreported requests by ``factor`` (peers assumed to act
    like it, which they do when they see the same reports) restores one router's behaviour.

    Estimate: every accepted report carries each router's cumulative ``admitted_requests`` on
    that node; per node, the increase since the node's previous report, ours and all
    routers', is added to two sums over all nodes that decay with ``half_life_s`` (injected
    clock). ``factor`` = all / ours, 1 while there is too little data (fewer than
    ``MIN_ADMISSIONS`` in the decayed sum, or none of them ours) and capped at ``MAX_FACTOR``.
    One router alone (or peers that are idle) gives exactly 1, so a single router decides as
    before. A counter going down (node restart) only resets that node's baseline."""

    MIN_ADMISSIONS = 8.0
    MAX_FACTOR = 64.0

    def __init__(self, router_id: str, half_life_s: float, clock: Clock) -> None:
        self.router_id = router_id
        self.half_life_s = half_life_s
        self.clock = clock
        self._last: dict[str, tuple[int, int]] = {}   # node id -> (ours, all) cumulative
        self._ours = 0.0
        self._all = 0.0
        self._t = -math.inf
        self.factor = 1.0

    def observe(self, node_id: str, accounts: Iterable[tuple[str, AccountSample]]) -> None:
        ours = total = 0
        for rid, a in accounts:
            total += a.admitted_requests
            if rid == self.router_id:
                ours = a.admitted_requests
        prev = self._last.get(node_id)
        self._last[node_id] = (ours, total)
        if self.half_life_s <= 0:
            return
        if prev is None or ours < prev[0] or total < prev[1]:
            return   # first report of this node, or its counters restarted: baseline only
        d_ours, d_all = ours - prev[0], total - prev[1]
        if d_all <= 0:
            return
        now = self.clock()
        if math.isfinite(self._t) and now > self._t:
            decay = 0.5 ** ((now - self._t) / self.half_life_s)
            self._ours *= decay
            self._all *= decay
        self._t = max(self._t, now)
        self._ours += d_ours
        self._all += d_all
        if self._all < self.MIN_ADMISSIONS or self._ours <= 0:
            self.factor = 1.0
        else:
            self.factor = min(max(self._all / self._ours, 1.0), self.MAX_FACTOR)

    def forget(self, node_id: str) -> None:
        self._last.pop(node_id, None)


# ---------------------------------------------------------------------------- registry


@dataclass
class _Index:
    by_name: dict[str, str] = field(default_factory=dict)         # name or alias -> model
    snapshots: dict[str, _ModelSlots] = field(default_factory=dict)
    slots: dict[str, tuple[_Slot, ...]] = field(default_factory=dict)   # node id -> its slots


class Registry:
    def __init__(self, router_id: str, *, lease_ttl_s: float, freshness_s: float,
                 max_concurrency_default: int = 0, known_model_retention_s: float = 60.0,
                 peer_share_half_life_s: float = 10.0, step_from_report: bool = True,
                 clock: Clock = time.monotonic) -> None:
        self.router_id = router_id
        self.step_from_report = step_from_report   # RouterConfig.step_from_report
        self.lease_ttl_s = lease_ttl_s
        self.freshness_s = freshness_s
        self.max_concurrency_default = max_concurrency_default
        self.known_model_retention_s = known_model_retention_s
        self.clock = clock
        # This router's share of all routers' dispatches (0 = off: peers ignored).
        self.peers = PeerShare(router_id, peer_share_half_life_s, clock)
        self._nodes: dict[str, NodeEntry] = {}
        self._ledgers: dict[str, NodeLedger] = {}
        self._index = _Index()
        self._gone_models: dict[str, float] = {}
        # Per model, from the latest node that measured them, per unit of its capacity weight:
        # its decode step x weight and its prefill capacity / weight. A node with no
        # measurement of its own yet (never busy; a vLLM node reports no capacity before its
        # first prefill) is scored with these scaled by its weight, not with the floor and
        # the constant: those differ ~10x from a real node's terms, so of two idle nodes, one
        # measured and one not, a burst would all go to the unmeasured one (seen with two
        # vLLM nodes: 8 of 8). (step x weight, capacity / weight) per model name.
        self._speed_ref: dict[str, tuple[float, float]] = {}
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

    def register(self, reg: NodeRegistration, stream_id: int) -> None:
        now = self.clock()
        old = self._nodes.get(reg.node_id)
        ledger = self._ledgers.get(reg.node_id)
        if ledger is None or ledger.incarnation != reg.incarnation:
            if ledger is not None:
                log.info("node %s restarted (incarnation %s -> %s): accounting reset",
                         reg.node_id, ledger.incarnation, reg.incarnation)
            self._ledgers[reg.node_id] = NodeLedger(reg.incarnation,
                                                    self._releaser(reg.node_id))
        self._nodes[reg.node_id] = NodeEntry(reg, stream_id, now, now)
        log.info("node %s registered at %s serving %s", reg.node_id, reg.address,
                 [m.name for m in reg.models])
        self._rebuild()
        affected = {m.name for m in reg.models}
        if old is not None:
            affected |= {m.name for m in old.registration.models}
        self._notify(affected)

    def heartbeat(self, node_id: str, stream_id: int, seq: int, sent_unix_ms: int,
                  load: LoadSample, accounts: Iterable[tuple[str, AccountSample]] = (),
                  gpus: tuple[GpuStat, ...] = ()) -> bool:
        """Applies a heartbeat; False when ignored (unknown node, other stream, old seq)."""
        entry = self._nodes.get(node_id)
        if entry is None or entry.stream_id != stream_id:
            return False
        if entry.report is not None and seq <= entry.report.seq:
            return False
        now = self.clock()
        accounts = tuple(accounts)
        ours = next((a for rid, a in accounts if rid == self.router_id), None)
        self.peers.observe(node_id, accounts)
        self._ledgers[node_id].on_report(ours)
        load, running_avg = _with_step_time(load, entry.report, now, self.step_from_report)
        if load.step_s > 0 or load.prefill_capacity_tokens_per_s > 0:
            for m in entry.registration.models:
                step, cap = self._speed_ref.get(m.name, (0.0, 0.0))
                w = max(m.capacity_weight, 1e-9)
                self._speed_ref[m.name] = (
                    load.step_s * w if load.step_s > 0 else step,
                    load.prefill_capacity_tokens_per_s / w
                    if load.prefill_capacity_tokens_per_s > 0 else cap)
        report = Report(seq, sent_unix_ms, now, load, ours, gpus, accounts, running_avg)
        was_draining = self._draining(entry)
        self._nodes[node_id] = replace(entry, report=report, last_seen=now)
        if was_draining != self._draining(self._nodes[node_id]):
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

    def drain(self, node_id: str) -> None:
        """Stops routing to a node (operator drain); it stays listed until it leaves."""
        entry = self._nodes.get(node_id)
        if entry is not None and not entry.drain_ordered:
            self._nodes[node_id] = replace(entry, drain_ordered=True)
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

    def _draining(self, e: NodeEntry) -> bool:
        return e.drain_ordered or (e.report is not None and e.report.load.draining)

    def _rebuild(self) -> None:
        by_model: dict[str, list[NodeEntry]] = {}
        specs: dict[str, ModelSpec] = {}
        by_name: dict[str, str] = {}
        for e in sorted(self._nodes.values(), key=lambda e: e.node_id):
            for m in e.registration.models:
                by_model.setdefault(m.name, []).append(e)
                prev = specs.get(m.name)
                specs[m.name] = m if prev is None else replace(
                    prev, aliases=tuple(dict.fromkeys(prev.aliases + m.aliases)),
                    max_context_length=max(prev.max_context_length, m.max_context_length))
        for name, spec in specs.items():
            for alias in spec.aliases:
                by_name.setdefault(alias, name)
        for name in specs:
            by_name[name] = name  # a real name always wins over another model's alias
        now = self.clock()
        for old in self._index.snapshots:
            if old not in specs:
                self._gone_models[old] = now
        for name in specs:
            self._gone_models.pop(name, None)
        snapshots: dict[str, _ModelSlots] = {}
        node_slots: dict[str, list[_Slot]] = {}
        # Unchanged nodes keep their slots (and cached candidates) across a membership change.
        old_slots = {(slot.entry.node_id, m): slot for m, ms in self._index.snapshots.items()
                     for slot in ms.slots}
        for n, model_spec in specs.items():
            slots = []
            for e in by_model[n]:
                spec = next(m for m in e.registration.models if m.name == n)
                slot = old_slots.get((e.node_id, n))
                if (slot is None or slot.entry is not e or slot.spec != spec
                        or slot.ledger is not self._ledgers[e.node_id]):
                    slot = _Slot(e, spec, self._ledgers[e.node_id])
                slots.append(slot)
                node_slots.setdefault(e.node_id, []).append(slot)
            snapshots[n] = _ModelSlots(n, model_spec, tuple(slots))
        self._index = _Index(by_name, snapshots, {k: tuple(v) for k, v in node_slots.items()})

    def _replace_in_snapshots(self, entry: NodeEntry) -> None:
        """A node's entry changed (heartbeat): O(1), its slots take it in place."""
        for slot in self._index.slots.get(entry.node_id, ()):
            slot.entry = entry
            slot.valid_until = -math.inf

    # --- request path

    def resolve(self, model: str) -> str:
        """Canonical model name for a name or alias; empty -> the only model served.

        Raises RouterError: NOT_FOUND (unknown, listing served models), INVALID_ARGUMENT
        (empty with several served), UNAVAILABLE (none served, or its nodes all left)."""
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
        if model in self._gone_models:
            raise errors.no_healthy_node(model, {"*": "every node serving it has left"})
        raise errors.model_not_found(model, index.snapshots)

    def snapshot(self, model: str) -> ModelSnapshot | None:
        """The model's nodes now, as an immutable value (operators, tests)."""
        m = self._index.snapshots.get(model)
        return None if m is None else ModelSnapshot(m.model, m.spec,
                                                    tuple(s.entry for s in m.slots))

    def ledger(self, node_id: str) -> NodeLedger:
        return self._ledgers[node_id]

    def entry(self, node_id: str) -> NodeEntry | None:
        return self._nodes.get(node_id)

    def state_of(self, e: NodeEntry, now: float) -> tuple[NodeState, float]:
        age = now - e.report.received_at if e.report is not None else math.inf
        if self._draining(e):
            return NodeState.DRAINING, age
        if age > self.freshness_s:
            return NodeState.STALE, age
        return NodeState.HEALTHY, age

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
        return LazyCandidates(self, snap.slots if snap is not None else (), self.clock(),
                               exclude)

    def _build(self, s: _Slot, now: float) -> Candidate | None:
        """Rebuilds a slot's cached candidate as of ``now`` (None: lease over)."""
        e = s.entry
        ledger = s.ledger
        ledger.housekeep(now)   # before reading: a release may call back into the router
        lease_end = e.last_seen + self.lease_ttl_s
        if now > lease_end:
            s.cand, s.valid_until, s.version = None, math.inf, ledger.version
            return None   # until the next heartbeat replaces the entry
        state, age = self.state_of(e, now)
        tokens, requests = ledger.unreported()
        report = e.report
        fresh = report is not None and state is not NodeState.STALE
        valid_until = min(lease_end, ledger.next_expiry)
        if fresh and state is NodeState.HEALTHY and report is not None:
            valid_until = min(valid_until, report.received_at + self.freshness_s)
        load = report.load if fresh and report is not None else None
        if load is not None and (load.step_s <= 0 or load.prefill_capacity_tokens_per_s <= 0):
            load = self._with_model_speed(load, s.spec)
        c = Candidate(
            node_id=e.node_id, address=e.registration.address, state=state,
            capacity_weight=s.spec.capacity_weight,
            max_concurrency=e.registration.max_concurrency or self.max_concurrency_default,
            report=load, report_age_s=age,
            kv_cache_usage=report.load.kv_cache_usage if report is not None else 0.0,
            router_in_flight=ledger.in_flight,
            outstanding_prompt_tokens=ledger.pending_tokens,
            outstanding_requests=ledger.pending_requests,
            unreported_prompt_tokens=tokens, unreported_requests=requests,
            decode_delta=ledger.decode_delta(), peer_factor=self.peers.factor)
        s.cand, s.valid_until, s.version = c, valid_until, ledger.version
        return c

    def _with_model_speed(self, load: LoadSample, spec: ModelSpec) -> LoadSample:
        """``load`` with the model's reference step / capacity (``_speed_ref``) scaled by
        this node's weight where the node has not measured its own."""
        step, cap = self._speed_ref.get(spec.name, (0.0, 0.0))
        w = max(spec.capacity_weight, 1e-9)
        fill: dict[str, float] = {}
        if load.step_s <= 0 and step > 0:
            fill["step_s"] = step / w
        if load.prefill_capacity_tokens_per_s <= 0 and cap > 0:
            fill["prefill_capacity_tokens_per_s"] = cap * w
        return replace(load, **fill) if fill else load

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
            healthy = [e for e in live if not self._draining(e)]
            weight = sum(m.capacity_weight for e in healthy for m in e.registration.models
                         if m.name == name)
            tp = max((m.tensor_parallel_size for e in live for m in e.registration.models
                      if m.name == name), default=snap.spec.tensor_parallel_size)
            out.append(ModelSummary(name, snap.spec.aliases, snap.spec.max_context_length, tp,
                                    weight, tuple(e.node_id for e in live)))
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
