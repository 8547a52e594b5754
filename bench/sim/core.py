"""The discrete-event fleet simulator: one virtual clock, the router's real code, the sim
engine's real scheduler, no sockets and no sleeps.

What runs as in production (the same objects, driven by the virtual clock):

- per router: ``router.fleet.Registry`` (membership, leases, freshness, the candidate cache,
  speed estimates, peer share) with its ``CreditLedger`` per node, the
  ``router.dispatch.AdmissionQueue``'s decision (filters, the profile, sampling on large
  fleets) and the proxy charge the dispatcher makes (``Registry.charge``; the credit's
  ``first_token`` at the first token, ``finish`` at the end); ``Registry.expire`` every 0.5 s;
  the policy (``scheduling.build_policy``) and the ``SessionTable`` the dispatcher reads and updates for an arrival with a routing key;
- per node: ``node.engines.sim.SimScheduler`` (continuous batching, chunked prefill, KV
  blocks, preemption, the step-time model, the prefix cache, the load signals), the node's
  ``AdmissionLedger`` (per-router accounts) and ``node.report.build_load_report`` (the
  heartbeat's ``LoadReport``), pushed to every router every ``heartbeat_interval_s``.

The nodes and routers are ``actors``' ``SimNode`` and ``SimRouter``; an SMG gateway can take
a router's place (``smg_policy``); in a fleet with prefill and decode nodes, ``disagg.PdFlow``
runs the disaggregated requests (the pool choice and the rule: ``pools``).

Messages (request to node, first token and end to the router, heartbeats, registrations)
take ``network_delay_s`` one way; with the fleet's ``serving`` costs the router and every
node's front end are also FIFO servers on the way, and the streams are coalesced into
messages as the node does (``serving``). What does not run: gRPC, the servicers, the
router's wait queue (nodes have no concurrency limit here, so a request is always placed at
once), retries and failover (no node fails), tracing.

Events are ordered by (time, sequence number); every random draw comes from seeded RNGs, so a
run is a pure function of (fleet, workload, policy, seed).
"""

from __future__ import annotations

import heapq
import logging
import random
from dataclasses import replace
from typing import Any

from gpumesh.node.engines.sim.scheduler import SimRequest
from gpumesh.node.report import build_load_report
from gpumesh.router.config import RouterConfig
from gpumesh.router.fleet.locality import prefill_tokens
from gpumesh.config import nest
from gpumesh.router.scheduling import NoCandidate, RequestInfo
from gpumesh.types import ModelSpec, Registration
from gpumesh_bench.sim import smg_policy
from gpumesh_bench.sim.actors import RequestRecord, RunResult, SimNode, SimRouter
from gpumesh_bench.sim.disagg import PREFILL_RECV, PdFlow, whole_filter, whole_nodes
from gpumesh_bench.sim.fleets import FleetSpec
from gpumesh_bench.sim.serving import ServingPath
from gpumesh_bench.sim.smg_policy import SmgConfig, WorkerLoad
from gpumesh_bench.sim.workloads import Arrival, FleetEvent, Workload

__all__ = ["MODEL", "RequestRecord", "RunResult", "Simulation", "simulate"]

MODEL = "sim-model"
SWEEP_S = 0.5

# event kinds
_ARRIVE, _NODE_RECV, _STEP_END, _HB_SEND, _HB_RECV, _FIRST_RECV, _END_RECV, _FLEET, \
    _REG_RECV, _DEREG_RECV, _SWEEP, _KV_RECV, _NODE_ADMIT, _ROUTER_MSGS = range(14)


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
        gateways = smg_policy.gateways(policy, smg, seed, fleet.routers, self._worker_load)
        values = nest(RouterConfig, overrides)   # a fleet's router keys, by their names
        values.setdefault("routing", {})["policy"] = "least_request" if gateways else policy
        values.setdefault("serving", {})["router_id"] = "r0"
        self.config = RouterConfig.build(values)
        clock = self._clock
        # a disaggregated fleet: whole requests only to the nodes that serve them (disagg.py)
        roles = {n.node_id: n.role for n in fleet.nodes}
        extra = [whole_filter(whole_nodes(roles))] if fleet.disaggregated else []
        self.routers = [SimRouter(f"r{i}", self.config.replace(serving={"router_id": f"r{i}"}),
                                  clock, random.Random(seed * 7919 + i), extra)
                        for i in range(fleet.routers)]
        for r, g in zip(self.routers, gateways or ()):
            r.smg = g
        self.nodes = {n.node_id: SimNode(n) for n in fleet.nodes}
        self.delay = fleet.network_delay_s
        self.hb = fleet.heartbeat_interval_s
        self.records: list[RequestRecord] = []
        self.closed = closed_concurrency
        self._next_arrival = 0
        self._tok_rng = random.Random(seed ^ 0xC0FFEE)
        self._events = 0
        self.cut_outputs = 0
        self.pd = PdFlow(self) if fleet.disaggregated else None
        sc = fleet.serving   # the serving path's queues (serving.py), or none
        self.path = (ServingPath(sc, self.nodes, len(self.routers))
                     if sc is not None and sc.enabled else None)

    def _clock(self) -> float:
        return self.now

    def _worker_load(self, node_id: str, now: float) -> WorkerLoad:
        """A node's load record as its VllmEngine service sends it (an SMG gateway's input)."""
        n = self.nodes[node_id]
        return smg_policy.worker_load(n.sched.load_at(now), n.ledger.pending_prefill_tokens)

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    # --- membership ------------------------------------------------------------------

    def _registration(self, n: SimNode) -> Registration:
        e = n.spec.engine
        model = ModelSpec(MODEL, (), e.max_context_length, 1, n.spec.weight)
        return Registration(n.spec.node_id, f"sim://{n.spec.node_id}", (model,),
                            n.incarnation, engine="sim")

    def _join(self, n: SimNode) -> None:
        n.present = True
        reg = self._registration(n)
        for r in range(len(self.routers)):
            self._push(self.now + self.delay, _REG_RECV, (r, reg))
        self._heartbeat(n)
        self._push(self.now + self.hb, _HB_SEND, n.spec.node_id)

    def _heartbeat(self, n: SimNode) -> None:
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
        if self.pd is not None and self.pd.arrive(a, rec, router, MODEL):
            return
        try:
            if router.smg is not None:
                node_id = smg_policy.choose_present(
                    router.smg, [n for n, x in self.nodes.items() if x.present],
                    a.prompt_tokens, a.blocks, self.now)
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
        t = (self.path.forward(ri, self.now, a.prompt_tokens) if self.path is not None
             else self.now)
        self._push(t + self.delay + front, _NODE_RECV, (a, ri, node_id))

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
        if self.path is not None:   # the engine gets it when the front end is done
            self._push(self.path.admit(node_id, self.now, a.prompt_tokens), _NODE_ADMIT, (n, req))
            return
        self._node_admit(n, req)

    def _node_admit(self, n: SimNode, req: SimRequest) -> None:
        n.sched.add(req)
        if not n.busy:
            self._start_step(n)

    def _start_step(self, n: SimNode) -> None:
        step = n.sched.begin_step()
        n.step = step
        n.busy = step is not None
        if step is not None:
            self._push(self.now + step.duration_s, _STEP_END, n.spec.node_id)
        if self.pd is not None:
            self.pd.transfers(n)

    def _step_end(self, n: SimNode) -> None:
        step = n.step
        assert step is not None
        firsts, done = n.sched.end_step(step, self.now)
        t = self.now + self.delay
        if self.path is not None:   # the messages through the front end, then the router
            depart, per_router = self.path.step(
                n.spec.node_id, self.now, [r.id for r, _ in step.scheduled],
                [r.id for r in firsts if not r.keep_kv], [r.id for r in done if not r.keep_kv],
                lambda rid: self.records[int(rid)].router)
            for ri, msgs in per_router.items():
                self._push(depart + self.delay, _ROUTER_MSGS, (ri, *msgs))
        for req in firsts:
            if req.keep_kv:
                continue   # a prefill leg's token is not the client's (disagg.py)
            n.admissions[req.id].first_token()
            if self.path is None:
                self._push(t, _FIRST_RECV, int(req.id))
        for req in done:
            if req.keep_kv and self.pd is not None:
                self.pd.prefill_done(n, req, t)
                continue
            n.admissions.pop(req.id).finish()
            if self.path is None:
                self._push(t, _END_RECV, int(req.id))
        if n.kv.ops:
            for r in range(len(self.routers)):
                self._push(t, _KV_RECV, (r, n.spec.node_id, n.kv.ops))
            n.kv.ops = []
        self._start_step(n)

    def _router_msgs(self, ri: int, messages: int, firsts: list[str], ends: list[str]) -> None:
        """A step's stream messages reach router ``ri``: at the client when it relayed them."""
        t = self.path.relay(ri, self.now, messages)
        for rid in firsts:
            self._push(t, _FIRST_RECV, int(rid))
        for rid in ends:
            self._push(t, _END_RECV, int(rid))

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
            elif kind == _NODE_ADMIT:
                self._node_admit(*p)
            elif kind == _ROUTER_MSGS:
                self._router_msgs(*p)
            elif kind == _KV_RECV:
                ri, node_id, ops = p
                routers[ri].kv_events(node_id, ops, MODEL)
            elif kind >= PREFILL_RECV and self.pd is not None:
                self.pd.handle(kind, p)
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
