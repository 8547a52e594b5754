"""Disaggregated serving in the simulator: a request's prefill on a prefill node, its KV over
the link, its decode on a decode node (the choices and the rule: ``pools``).

The flow, each message taking the fleet's network delay one way:

1. At arrival the router asks :func:`pools.pays` for the prefill node (least prefill
   backlog) and the decode node (least predicted decode load) it would use, from its own
   view of them (``Registry`` candidates: the nodes' reports plus its own dispatches since).
   Not paying, the request is served whole by the router's own policy, among the ``both``
   nodes or, in a fleet without them, the decode nodes (which then prefill it themselves).
2. Paying, the router charges both nodes (the prefill node with the prompt's tokens, the
   decode node with a request) and sends the prefill leg: the prompt with ``max_tokens`` 1,
   its KV kept after it finishes (``node.engines.sim.transfer``). Its one output token is not
   the client's.
3. The prefill leg's end reaches the router, which sends the decode leg to the decode node.
4. The decode node queues it until its KV cache can hold the whole prompt, takes the blocks,
   and pulls the KV: the transfer starts when both nodes' links are free (each end moves one
   transfer at a time) and lasts ``link.transfer_s(prompt tokens, kv bytes per token)``.
   Its end frees the prefill node's copy.
5. The decode node's next step computes the last prompt token and emits the first output
   token; the client's time to first token therefore holds both legs, the hops and the
   transfer. The rest decodes as any request.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpumesh.node.engines.sim.scheduler import SimRequest
from gpumesh.router.fleet import Credit
from gpumesh.router.scheduling.filters import Filter
from gpumesh.router.scheduling.types import Candidate
from gpumesh_bench.sim.actors import RequestRecord, SimNode, SimRouter
from gpumesh_bench.sim.pools import choose_decode, choose_prefill, pays, pool_node
from gpumesh_bench.sim.workloads import Arrival

if TYPE_CHECKING:
    from gpumesh_bench.sim.core import Simulation

# event kinds (core.Simulation dispatches every kind >= PREFILL_RECV here)
PREFILL_RECV, PREFILLED_RECV, DECODE_RECV, KV_LOADED = range(100, 104)


def whole_filter(nodes: frozenset[str]) -> Filter:
    """A routing filter keeping the nodes that serve whole requests (the router's own policy
    decides among them for requests that are not disaggregated)."""
    def serves_whole(cands: Sequence[Candidate]) -> tuple[list[Candidate], dict[str, str]]:
        kept = [c for c in cands if c.node_id in nodes]
        return kept, {c.node_id: "serves one leg only" for c in cands if c.node_id not in nodes}
    return serves_whole


def whole_nodes(roles: dict[str, str]) -> frozenset[str]:
    """The nodes whole requests go to: the ``both`` nodes, else the decode nodes."""
    both = frozenset(n for n, r in roles.items() if r == "both")
    return both or frozenset(n for n, r in roles.items() if r == "decode")


class PdFlow:
    """The disaggregated requests of one ``Simulation`` (module docstring)."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.roles = {n.node_id: n.role for n in sim.fleet.nodes}
        self.link = sim.fleet.link
        self.rule = sim.fleet.pd_rule
        self.link_free = dict.fromkeys(self.roles, 0.0)
        self.prefill_credits: dict[int, Credit] = {}
        self.arrivals: dict[int, Arrival] = {}
        # why each request was or was not disaggregated (pools.pays' reasons)
        self.reasons: Counter[str] = Counter()
        # per node: its decode step model (s, s per sequence) and prefill rate (tokens/s)
        self._steps: dict[str, tuple[float, float, float]] = {}
        for nid, n in sim.nodes.items():
            e = n.spec.engine
            self._steps[nid] = (e.step_a_ms / e.speed / 1000, e.step_b_decode_ms / e.speed / 1000,
                                n.sched.prefill_capacity_tokens_per_s())

    def arrive(self, a: Arrival, rec: RequestRecord, router: SimRouter, model: str) -> bool:
        """Disaggregates the request when it pays (module docstring, 1-2); False: the caller
        serves it whole."""
        sim = self.sim
        views = [pool_node(c, self.roles[c.node_id], *self._steps[c.node_id])
                 for c in router.registry.candidates(model) if self.roles[c.node_id] != "both"]
        p = choose_prefill(views, a.prompt_tokens)
        d, room = choose_decode(views, a.prompt_tokens + a.output_tokens)
        if p is None or d is None:
            self.reasons["no pool"] += 1
            return False
        bpt = sim.nodes[d.node_id].spec.engine.kv_bytes_per_token
        ok, why = pays(a.prompt_tokens, p, d, room, self.link.transfer_s(a.prompt_tokens, bpt),
                       2 * sim.delay, self.rule)
        self.reasons[why] += 1
        if not ok:
            return False
        rec.node_id, rec.prefill_node = d.node_id, p.node_id
        router.credits[a.index] = router.registry.charge(d.node_id, 0)
        self.prefill_credits[a.index] = router.registry.charge(p.node_id, a.prompt_tokens)
        self.arrivals[a.index] = a
        sim._push(sim.now + sim.delay, PREFILL_RECV, a.index)
        return True

    def handle(self, kind: int, index: int) -> None:
        if kind == PREFILL_RECV:
            self._prefill_recv(index)
        elif kind == PREFILLED_RECV:
            self._prefilled_recv(index)
        elif kind == DECODE_RECV:
            self._decode_recv(index)
        elif kind == KV_LOADED:
            self._kv_loaded(index)
        else:
            raise AssertionError(kind)

    def _router_id(self, index: int) -> str:
        return self.sim.routers[self.sim.records[index].router].router_id

    def _prefill_recv(self, index: int) -> None:
        sim, a = self.sim, self.arrivals[index]
        n = sim.nodes[sim.records[index].prefill_node]
        rid = f"p{index}"
        prefix, prefill = n.sched.prefix, a.prompt_tokens
        if prefix is not None and a.blocks:
            prefill -= min(prefix.match(a.blocks), (a.prompt_tokens - 1) // prefix.block_size
                           ) * prefix.block_size
        n.admissions[rid] = n.ledger.admit(self._router_id(index), prefill)
        n.sched.add(SimRequest(rid, a.prompt_tokens, 1, sim._tok_rng, 0.0, (),
                               a.blocks if prefix is not None else (), keep_kv=True))
        if not n.busy:
            sim._start_step(n)

    def prefill_done(self, n: SimNode, req: SimRequest, t: float) -> None:
        """A prefill leg finished on ``n`` (its step's end): the node's accounting closes and
        its end reaches the router at ``t``."""
        n.admissions.pop(req.id).finish()
        self.sim._push(t, PREFILLED_RECV, int(req.id[1:]))

    def _prefilled_recv(self, index: int) -> None:
        credit = self.prefill_credits.pop(index)
        credit.first_token()
        credit.finish()
        self.sim._push(self.sim.now + self.sim.delay, DECODE_RECV, index)

    def _decode_recv(self, index: int) -> None:
        sim, a = self.sim, self.arrivals[index]
        n = sim.nodes[sim.records[index].node_id]
        rid = str(index)
        n.admissions[rid] = n.ledger.admit(self._router_id(index), 1)
        out = min(a.output_tokens, max(n.spec.engine.max_context_length - a.prompt_tokens, 1))
        if out < a.output_tokens:
            sim.cut_outputs += 1
        n.sched.add(SimRequest(rid, a.prompt_tokens, out, sim._tok_rng, 0.0, (), (),
                               remote=True))
        if not n.busy:
            sim._start_step(n)

    def transfers(self, n: SimNode) -> None:
        """Starts the transfers of the decode legs ``n`` took KV blocks for (module
        docstring, 4)."""
        sim = self.sim
        for req in n.sched.take_started():
            index = int(req.id)
            rec = sim.records[index]
            src, dst = rec.prefill_node, rec.node_id
            size = req.prompt_len * n.spec.engine.kv_bytes_per_token
            start = max(sim.now, self.link_free[src], self.link_free[dst])
            end = start + size / self.link.bandwidth_bytes_per_s
            self.link_free[src] = self.link_free[dst] = end
            rec.transfer_s = end + self.link.latency_s - sim.now
            sim._push(end + self.link.latency_s, KV_LOADED, index)

    def _kv_loaded(self, index: int) -> None:
        sim = self.sim
        rec = sim.records[index]
        src, dst = sim.nodes[rec.prefill_node], sim.nodes[rec.node_id]
        dst.sched.kv_loaded(str(index))
        src.sched.release(f"p{index}")
        del self.arrivals[index]
        for n in (dst, src):
            if not n.busy:
                sim._start_step(n)
