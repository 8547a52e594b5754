"""The simulator's actors and results: a simulated node (the sim engine's scheduler, the
node's admission ledger, its KV events), a simulated router (the product's registry, admission
decision, session table and prefix locality), one request's record and one run's result.
``core.Simulation`` drives them on its virtual clock."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpumesh.node.accounting import Admission, AdmissionLedger
from gpumesh.node.engines.sim.scheduler import SimScheduler, SimStep
from gpumesh.router.config import RouterConfig
from gpumesh.router.dispatch.admission import AdmissionQueue
from gpumesh.router.fleet import Credit, Registry
from gpumesh.router.fleet.locality import PrefixLocality
from gpumesh.router.fleet.prefix_index import PrefixIndexes
from gpumesh.router.fleet.sessions import SessionTable
from gpumesh.router.scheduling import build_policy, default_filters
from gpumesh.router.scheduling.filters import Filter
from gpumesh_bench.sim.fleets import NodeSpec
from gpumesh_bench.sim.smg_policy import SmgCacheAware


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
    # disaggregated serving (disagg.py): the node that ran its prefill ("" = served whole
    # on node_id) and the seconds its KV transfer took (link queueing included)
    prefill_node: str = ""
    transfer_s: float = 0.0

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


class KvEvents:
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


class SimNode:
    """A simulated node: its engine's scheduler, the node's admission ledger, its KV events
    and its heartbeat state."""

    __slots__ = ("admissions", "busy", "hb_seq", "incarnation", "kv", "ledger", "present",
                 "sched", "spec", "step")

    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec
        self.sched = SimScheduler(spec.engine)
        # prefix-cache block events for the routers' prefix indexes (precise locality)
        self.kv = KvEvents()
        if self.sched.prefix is not None:
            self.sched.prefix.sink = self.kv
        self.ledger = AdmissionLedger()
        self.admissions: dict[str, Admission] = {}
        self.step: SimStep | None = None
        self.busy = False
        self.hb_seq = 0
        self.present = True
        self.incarnation = f"{spec.node_id}-0"


class SimRouter:
    """A router of the simulated fleet: the product's registry, admission decision, session
    table and prefix locality (or an SMG gateway in its place)."""

    __slots__ = ("admission", "credits", "locality", "registry", "router_id", "sessions", "smg")

    def __init__(self, router_id: str, config: RouterConfig, clock: Callable[[], float],
                 rng: random.Random, extra_filters: Sequence[Filter] = ()) -> None:
        self.router_id = router_id
        self.registry = Registry(router_id, lease_ttl_s=config.membership.lease_ttl_s,
                                 freshness_s=config.membership.freshness_s,
                                 max_concurrency_default=config.dispatch.max_concurrency_default,
                                 known_model_retention_s=config.membership.known_model_retention_s,
                                 peer_share_half_life_s=config.membership.peer_share_half_life_s,
                                 step_from_report=config.membership.step_from_report, clock=clock)
        # as router.app builds them: the policy, the session table
        profile = build_policy(config.routing)
        self.sessions = SessionTable(config.locality.affinity_max_keys,
                                     config.locality.affinity_ttl_s, clock)
        filters = [*default_filters(config.membership.kv_hard_threshold), *extra_filters]
        self.admission = AdmissionQueue(self.registry, profile, filters, rng, clock,
                                        queue_bound=config.dispatch.queue_bound,
                                        decision_sample_size=config.routing.sample_size)
        self.credits: dict[int, Credit] = {}
        # prefix locality (router.fleet.locality): prompts' block ids are their hashes
        self.locality = (PrefixLocality(config.locality.prefix_locality, PrefixIndexes(
            config.locality.prefix_index_max_entries, config.locality.prefix_approx_ttl_s,
            config.locality.prefix_pending_ttl_s), clock)
            if config.locality.prefix_locality != "off" else None)
        # an SMG gateway in this router's place (a comparison policy, smg_policy)
        self.smg: SmgCacheAware | None = None

    def kv_events(self, node_id: str, ops: list[tuple[str, tuple[int, ...]]],
                  model: str) -> None:
        """A node's block events into this router's index (precise locality; the same as
        ``PrefixLocality.apply`` does with the control plane's updates, without the seq), or
        into an SMG gateway's event index."""
        if self.smg is not None:
            self.smg.kv_events(node_id, ops)
        loc = self.locality
        if loc is None or loc.mode == "approximate":
            return
        ix = loc.indexes.model(model)
        for op, hashes in ops:
            if op == "stored":
                ix.add(node_id, hashes)
            elif op == "removed":
                ix.remove(node_id, hashes)
            else:
                ix.clear_node(node_id)


@dataclass(frozen=True)
class RunResult:
    records: list[RequestRecord]
    node_ids: tuple[str, ...]
    sim_s: float
    preemptions: int
    events: int
    # requests whose output was cut to fit the node's context (prompt + output > context)
    cut_outputs: int = 0
