"""The discrete-event fleet simulator: one virtual clock, the router's real code, the sim
engine's real scheduler, no sockets and no sleeps.

What runs as in production (the same objects, driven by the virtual clock):

- per router: ``router.fleet.Registry`` (membership, leases, freshness, the candidate cache,
  speed estimates, peer share) with its ``CreditLedger`` per node, the
  ``router.dispatch.AdmissionQueue``'s decision (filters, the profile, sampling on large
  fleets) and the proxy charge the dispatcher makes (``Registry.charge``; the credit's
  ``first_token`` at the first token, ``finish`` at the end); ``Registry.expire`` every 0.5 s;
  the profile wrapped in the session-affinity and adapter terms (``scheduling.steering``) and
  the ``SessionTable`` the dispatcher reads and updates for an arrival with a routing key;
- per node: ``node.engines.sim.SimScheduler`` (continuous batching, chunked prefill, KV
  blocks, preemption, the step-time model, the prefix cache, the load signals), the node's
  ``AdmissionLedger`` (per-router accounts) and ``node.report.build_load_report`` (the
  heartbeat's ``LoadReport``), pushed to every router every ``heartbeat_interval_s``.

Messages (request to node, first token and end to the router, heartbeats, registrations)
take ``network_delay_s`` one way. What does not run: gRPC, the servicers, streaming
coalescing, the router's wait queue (nodes have no concurrency limit here, so a request is
always placed at once), retries and failover (no node fails), tracing.

Events are ordered by (time, sequence number); every random draw comes from seeded RNGs, so a
run is a pure function of (fleet, workload, policy, seed).
"""

from __future__ import annotations

import heapq
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from gpumesh.node.accounting import Admission, AdmissionLedger
from gpumesh.node.engines.sim.scheduler import SimRequest, SimScheduler, SimStep
from gpumesh.node.report import build_load_report
from gpumesh.router.config import RouterConfig
from gpumesh.router.dispatch.admission import AdmissionQueue
from gpumesh.router.fleet import Credit, Registry
from gpumesh.router.fleet.locality import PrefixLocality, prefill_tokens
from gpumesh.router.fleet.prefix_index import PrefixIndexes
from gpumesh.router.fleet.sessions import SessionTable
from gpumesh.router.scheduling import (
    NoCandidate,
    RequestInfo,
    WaitModel,
    build_profile,
    default_filters,
)
from gpumesh.router.scheduling.steering import SteeringModel, steer
from gpumesh.types import ModelSpec, Registration
from gpumesh_bench.sim.fleets import FleetSpec, NodeSpec
from gpumesh_bench.sim.smg_policy import POLICIES as SMG_POLICIES
from gpumesh_bench.sim.smg_policy import SmgCacheAware, SmgConfig, WorkerLoad
from gpumesh_bench.sim.workloads import Arrival, FleetEvent, Workload

MODEL = "sim-model"
SWEEP_S = 0.5

# event kinds
_ARRIVE, _NODE_RECV, _STEP_END, _HB_SEND, _HB_RECV, _FIRST_RECV, _END_RECV, _FLEET, \
    _REG_RECV, _DEREG_RECV, _SWEEP, _KV_RECV = range(12)


@dataclass
class RequestRecord:
    """One request's outcome (simulated seconds from the run's start)."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    node_id: str = ""
    router: int = 0
    first_s: float = -1.0   # first token at the router
    end_s: float = -1.0     # last token at the router
    error: str = ""

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.end_s - self.first_s) / (self.output_tokens - 1)


class _KvEvents:
    """A node's prefix-cache block events, collected over a step and sent to the routers
    at its end (vLLM publishes its KV events per step too)."""

    __slots__ = ("ops",)

    def __init__(self) -> None:
        self.ops: list[tuple[str, tuple[int, ...]]] = []

    def stored(self, hashes: Any) -> None:
        self.ops.append(("stored", tuple(hashes)))

    def removed(self, hashes: Any) -> None:
        self.ops.append(("removed", tuple(hashes)))

    def cleared(self) -> None:
        self.ops.append(("cleared", ()))


class _Node:
    __slots__ = ("admissions", "busy", "hb_seq", "incarnation", "kv", "ledger", "present",
                 "sched", "spec", "step")

    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec
        self.sched = SimScheduler(spec.engine)
        # prefix-cache block events for the routers' prefix indexes (precise locality)
        self.kv = _KvEvents()
        if self.sched.prefix is not None:
            self.sched.prefix.sink = self.kv
        self.ledger = AdmissionLedger()
        self.admissions: dict[str, Admission] = {}
        self.step: SimStep | None = None
        self.busy = False
        self.hb_seq = 0
        self.present = True
        self.incarnation = f"{spec.node_id}-0"


class _Router:
    __slots__ = ("admission", "credits", "locality", "registry", "router_id", "sessions", "smg")

    def __init__(self, router_id: str, config: RouterConfig, clock: Callable[[], float],
                 rng: random.Random) -> None:
        self.router_id = router_id
        self.registry = Registry(router_id, lease_ttl_s=config.lease_ttl_s,
                                 freshness_s=config.freshness_s,
                                 max_concurrency_default=config.max_concurrency_default,
                                 known_model_retention_s=config.known_model_retention_s,
                                 peer_share_half_life_s=config.peer_share_half_life_s,
                                 step_from_report=config.step_from_report, clock=clock)
        # as router.app builds them: the profile with the request terms, the session table
        profile = steer(build_profile(config.policy, config.scorer_weights,
                                      WaitModel.from_config(config)),
                        SteeringModel(config.affinity_weight, config.affinity_epsilon,
                                      config.adapter_weight, config.adapter_load_s,
                                      config.wait_scale_s))
        self.sessions = SessionTable(config.affinity_max_keys, config.affinity_ttl_s, clock)
        self.admission = AdmissionQueue(self.registry, profile,
                                        default_filters(config.kv_hard_threshold), rng, clock,
                                        queue_bound=config.queue_bound,
                                        decision_sample_size=config.decision_sample_size)
        self.credits: dict[int, Credit] = {}
        # prefix locality (router.fleet.locality): prompts' block ids are their hashes
        self.locality = (PrefixLocality(config.prefix_locality, PrefixIndexes(
            config.prefix_index_max_entries, config.prefix_approx_ttl_s,
            config.prefix_pending_ttl_s), clock)
            if config.prefix_locality != "off" else None)
        # an SMG gateway in this router's place (a comparison policy, smg_policy)
        self.smg: SmgCacheAware | None = None


@dataclass(frozen=True)
class RunResult:
    records: list[RequestRecord]
    node_ids: tuple[str, ...]
    sim_s: float
    preemptions: int
    events: int
    # requests whose output was cut to fit the node's context (prompt + output > context)
    cut_outputs: int = 0


class Simulation:
    """One run: ``Simulation(fleet, workload, policy, seed).run()``. ``closed_concurrency``
    > 0 turns it into a closed loop (that many requests outstanding, arrivals ignored).
    ``policy`` is a router policy or an SMG reference (``smg_policy.POLICIES``: every router
    is then an SMG gateway with ``smg`` settings; the gpumesh router's own bookkeeping still
    runs but decides nothing)."""

    def __init__(self, fleet: FleetSpec, workload: Workload, policy: str, seed: int, *,
                 router_overrides: dict[str, Any] | None = None,
                 closed_concurrency: int = 0, smg: SmgConfig | None = None) -> None:
        self.fleet = fleet
        self.workload = workload
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._rng = random.Random(seed)
        overrides = {**fleet.router, **(router_overrides or {})}
        overrides.pop("policy", None)   # the run's policy argument decides
        overrides.pop("router_id", None)
        smg_mode = SMG_POLICIES.get(policy)
        self.config = RouterConfig(router_id="r0", policy="least_request" if smg_mode
                                   else policy, **overrides)
        clock = self._clock
        self.routers = [_Router(f"r{i}", replace(self.config, router_id=f"r{i}"), clock,
                                random.Random(seed * 7919 + i)) for i in range(fleet.routers)]
        if smg_mode:
            for i, r in enumerate(self.routers):
                r.smg = SmgCacheAware(smg_mode, smg or SmgConfig(),
                                      random.Random(seed * 104729 + i), self._worker_load)
        self.nodes = {n.node_id: _Node(n) for n in fleet.nodes}
        self.delay = fleet.network_delay_s
        self.hb = fleet.heartbeat_interval_s
        self.records: list[RequestRecord] = []
        self.closed = closed_concurrency
        self._next_arrival = 0
        self._tok_rng = random.Random(seed ^ 0xC0FFEE)
        self._events = 0
        self.cut_outputs = 0

    def _clock(self) -> float:
        return self.now

    def _worker_load(self, node_id: str, now: float) -> WorkerLoad:
        """A node's load record as its VllmEngine service sends it (an SMG gateway's input)."""
        n = self.nodes[node_id]
        e = n.sched.load_at(now)
        return WorkerLoad(e.num_waiting, e.kv_cache_usage, n.ledger.pending_prefill_tokens,
                          e.generation_tokens_per_s)

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    # --- membership ------------------------------------------------------------------

    def _registration(self, n: _Node) -> Registration:
        e = n.spec.engine
        model = ModelSpec(MODEL, (), e.max_context_length, 1, n.spec.weight)
        return Registration(n.spec.node_id, f"sim://{n.spec.node_id}", (model,),
                            n.incarnation, engine="sim")

    def _join(self, n: _Node) -> None:
        n.present = True
        reg = self._registration(n)
        for r in range(len(self.routers)):
            self._push(self.now + self.delay, _REG_RECV, (r, reg))
        self._heartbeat(n)
        self._push(self.now + self.hb, _HB_SEND, n.spec.node_id)

    def _heartbeat(self, n: _Node) -> None:
        n.hb_seq += 1
        load = build_load_report(n.sched.load_at(self.now), n.ledger, False)
        for r in range(len(self.routers)):
            self._push(self.now + self.delay, _HB_RECV,
                       (r, n.spec.node_id, n.hb_seq, load))

    def _fleet_event(self, ev: FleetEvent) -> None:
        n = self.nodes[ev.node_id]
        if ev.kind == "leave" and n.present:
            n.present = False
            for r in range(len(self.routers)):
                self._push(self.now + self.delay, _DEREG_RECV, (r, ev.node_id))
        elif ev.kind == "join" and not n.present:
            self._join(n)
        elif ev.kind == "speed":
            sched = n.sched
            sched.config = replace(sched.config, speed=ev.value)
            sched._prefill_capacity = sched.prefill_capacity_tokens_per_s()

    # --- requests --------------------------------------------------------------------

    def _arrive(self, a: Arrival) -> None:
        rec = RequestRecord(a.index, self.now, a.prompt_tokens, a.output_tokens)
        self.records.append(rec)
        ri = a.index % len(self.routers)
        rec.router = ri
        router = self.routers[ri]
        info = RequestInfo(MODEL, a.prompt_tokens, output_tokens=a.output_tokens)
        key = a.routing_key   # session affinity as the dispatcher does it (_assign)
        if key:
            info = replace(info, routing_key=key,
                           session_node=router.sessions.lookup(MODEL, key))
        loc = router.locality
        if loc is not None and a.blocks:
            info = loc.annotate(replace(info, prefix_hashes=a.blocks))
        try:
            if router.smg is not None:
                present = [n for n, x in self.nodes.items() if x.present]
                if not present:
                    raise NoCandidate(False, {})
                node_id = router.smg.choose(present, a.prompt_tokens, a.blocks, self.now)
            else:
                node_id = router.admission.decide(info).node_id
        except NoCandidate:
            rec.error = "UNAVAILABLE"
            rec.first_s = rec.end_s = self.now
            self._closed_next()
            return
        router.credits[a.index] = router.registry.charge(node_id,
                                                         prefill_tokens(info, node_id))
        if loc is not None and a.blocks:
            loc.routed(info, node_id)
        if key:
            router.sessions.remember(MODEL, key, node_id)
        rec.node_id = node_id
        front = router.smg.config.front_end_s if router.smg is not None else 0.0
        self._push(self.now + self.delay + front, _NODE_RECV, (a, ri, node_id))

    def _node_recv(self, a: Arrival, ri: int, node_id: str) -> None:
        n = self.nodes[node_id]
        rid = str(a.index)
        # the node counts as pending prefill what its engine has not cached (node.cache)
        prefix, prefill = n.sched.prefix, a.prompt_tokens
        if prefix is not None and a.blocks:
            prefill -= min(prefix.match(a.blocks), (a.prompt_tokens - 1) // prefix.block_size
                           ) * prefix.block_size
        n.admissions[rid] = n.ledger.admit(self.routers[ri].router_id, prefill)
        e = n.spec.engine
        out = min(a.output_tokens, max(e.max_context_length - a.prompt_tokens, 1))
        if out < a.output_tokens:
            self.cut_outputs += 1
        req = SimRequest(rid, a.prompt_tokens, out, self._tok_rng, 0.0, (),
                         a.blocks if n.sched.prefix is not None else ())
        n.sched.add(req)
        if not n.busy:
            self._start_step(n)

    def _start_step(self, n: _Node) -> None:
        step = n.sched.begin_step()
        n.step = step
        n.busy = step is not None
        if step is not None:
            self._push(self.now + step.duration_s, _STEP_END, n.spec.node_id)

    def _step_end(self, n: _Node) -> None:
        step = n.step
        assert step is not None
        firsts, done = n.sched.end_step(step, self.now)
        t = self.now + self.delay
        for req in firsts:
            n.admissions[req.id].first_token()
            self._push(t, _FIRST_RECV, int(req.id))
        for req in done:
            n.admissions.pop(req.id).finish()
            self._push(t, _END_RECV, int(req.id))
        if n.kv.ops:
            for r in range(len(self.routers)):
                self._push(t, _KV_RECV, (r, n.spec.node_id, n.kv.ops))
            n.kv.ops = []
        self._start_step(n)

    @staticmethod
    def _kv_recv(router: _Router, node_id: str, ops: list[tuple[str, tuple[int, ...]]]) -> None:
        """A node's block events into the router's index (precise locality; the same as
        ``PrefixLocality.apply`` does with the control plane's updates, without the seq), or
        into an SMG gateway's event index."""
        if router.smg is not None:
            router.smg.kv_events(node_id, ops)
        loc = router.locality
        if loc is None or loc.mode == "approximate":
            return
        ix = loc.indexes.model(MODEL)
        for op, hashes in ops:
            if op == "stored":
                ix.add(node_id, hashes)
            elif op == "removed":
                ix.remove(node_id, hashes)
            else:
                ix.clear_node(node_id)

    def _first_recv(self, index: int) -> None:
        rec = self.records[index]
        rec.first_s = self.now
        self.routers[rec.router].credits[index].first_token()

    def _end_recv(self, index: int) -> None:
        rec = self.records[index]
        rec.end_s = self.now
        if rec.first_s < 0:
            rec.first_s = self.now
        router = self.routers[rec.router]
        router.credits.pop(index).finish()
        if router.smg is not None:
            router.smg.finished(rec.node_id)
        self._closed_next()

    def _closed_next(self) -> None:
        if self.closed and self._next_arrival < len(self.workload.arrivals):
            a = self.workload.arrivals[self._next_arrival]
            self._next_arrival += 1
            self._push(self.now, _ARRIVE, a)

    # --- the loop ----------------------------------------------------------------------

    def run(self) -> RunResult:
        """Runs to the last request's end. The router's per-node membership logs (a line per
        registration) are held at WARNING meanwhile: thousands of runs would repeat them."""
        quiet = logging.getLogger("gpumesh.router")
        level = quiet.level
        quiet.setLevel(max(level, logging.WARNING))
        try:
            return self._run()
        finally:
            quiet.setLevel(level)

    def _run(self) -> RunResult:
        for n in self.nodes.values():
            # heartbeat phases spread over one interval (nodes do not start in lockstep)
            self.now = 0.0
            n.hb_seq = 0
            reg = self._registration(n)
            for r in self.routers:
                r.registry.register(reg, 1)
            self._push(self._rng.random() * self.hb, _HB_SEND, n.spec.node_id)
        # the first reports, so the routers start with every node fresh
        for n in self.nodes.values():
            self._heartbeat(n)
        warm = 2 * self.hb + 2 * self.delay
        if self.closed:
            self.now = warm
            for _ in range(min(self.closed, len(self.workload.arrivals))):
                self._closed_next()
        else:
            for a in self.workload.arrivals:
                self._push(warm + a.arrival_s, _ARRIVE, a)
        for ev in self.workload.events:
            self._push(warm + ev.at_s, _FLEET, ev)
        self._push(SWEEP_S, _SWEEP, None)
        total = len(self.workload.arrivals)
        heap = self._heap
        nodes = self.nodes
        routers = self.routers
        finished = 0
        events = 0
        pop = heapq.heappop
        while heap:
            t, _, kind, p = pop(heap)
            self.now = t
            events += 1
            if kind == _STEP_END:
                self._step_end(nodes[p])
            elif kind == _FIRST_RECV:
                self._first_recv(p)
            elif kind == _END_RECV:
                self._end_recv(p)
                finished += 1
                if finished >= total:
                    break
            elif kind == _ARRIVE:
                self._arrive(p)
                if self.records[-1].error:
                    finished += 1
                    if finished >= total:
                        break
            elif kind == _NODE_RECV:
                self._node_recv(*p)
            elif kind == _HB_RECV:
                ri, node_id, seq, load = p
                routers[ri].registry.heartbeat(node_id, 1, seq, int(t * 1000), load)
            elif kind == _HB_SEND:
                n = nodes[p]
                if n.present:
                    self._heartbeat(n)
                    self._push(t + self.hb, _HB_SEND, p)
            elif kind == _SWEEP:
                for r in routers:
                    r.registry.expire()
                    if r.locality is not None:
                        r.locality.indexes.expire(t)
                self._push(t + SWEEP_S, _SWEEP, None)
            elif kind == _FLEET:
                self._fleet_event(p)
            elif kind == _REG_RECV:
                ri, reg = p
                routers[ri].registry.register(reg, 1)
            elif kind == _DEREG_RECV:
                ri, node_id = p
                routers[ri].registry.deregister(node_id, 1)
            elif kind == _KV_RECV:
                ri, node_id, ops = p
                self._kv_recv(routers[ri], node_id, ops)
        self._events = events
        # times relative to the first arrival
        t0 = warm
        for r in self.records:
            r.arrival_s -= t0
            r.first_s -= t0
            r.end_s -= t0
        pre = sum(n.sched.stats.preemptions for n in nodes.values())
        return RunResult(self.records, tuple(nodes), self.now - t0, pre, events,
                         self.cut_outputs)


def simulate(fleet: FleetSpec, workload: Workload, policy: str, seed: int,
             **kwargs: Any) -> RunResult:
    return Simulation(fleet, workload, policy, seed, **kwargs).run()
