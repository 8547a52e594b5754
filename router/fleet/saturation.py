"""The scaling signal: per model, how much of the fleet's measured capacity its demand uses, and
how many nodes it would take to meet the configured SLO. An autoscaler (HPA / KEDA on the
Prometheus gauges, docs/operations.md) scales the node Deployment on ``nodes_wanted``.

Everything comes from the fleet's own reports and this router's queue; nothing is sampled from
outside. Per model, over the nodes serving it that are not draining (a node serving several
models counts for each):

- ``slot_utilization`` U = (Σ busy + Q) / Σ slots. A node's busy count is the most of
  (running + waiting as reported, its in flight as reported, this router's in flight); its
  slots are its declared ``max_concurrency``, else the router's ``max_concurrency_default``,
  else ``saturation_default_slots``. Q: this router's queue for the model (requests waiting
  for a node slot). U = 1: every slot taken.
- ``kv_utilization`` K: the nodes' reported KV-cache usage, averaged over their KV capacity
  (tokens; equal weights where unknown). Many engines run out of KV cache before they run out
  of batch slots, and KV use grows with the tokens held, linearly with load.
- ``prefill_backlog_s`` B = Σ pending prefill tokens / Σ prefill capacity (tokens/s): how long
  the fleet needs for the prompt tokens it already holds, at its measured speed (a node that
  reports no capacity counts ``reference_prompt_tokens_per_s`` × its weight). Spread evenly,
  a new request waits about B before its own prefill starts.
- ``prefill_pressure`` P = B / ``saturation_slo_ttft_s``: that wait against the TTFT budget.
- ``saturation`` S = max(U, K, P): 1.0 means at capacity (slots or KV cache full, or queued
  prefill worth the whole TTFT budget).
- ``at_limit_fraction`` F: the fraction of time (exponentially weighted, half-life
  ``saturation_half_life_s``) that the model's nodes spent at their limit — a node is at its
  limit when busy >= slots or its engine has requests waiting (KV cache or batch full), and
  all are while the router queues.
- ``nodes_wanted`` = ceil(N × S / ``saturation_target``) for N serving nodes, at least 1
  while the model has a node or a queued request, and at least N + 1 while F > 1/2 (a fleet
  at its limit most of the time is short whatever the averages say — typically KV-bound).
  Below the target it asks for fewer nodes; the autoscaler's stabilisation window keeps the
  scale-down from following every dip.

``model_saturation`` is a pure function (table-driven tests); ``SaturationTracker`` keeps F
between samples and is sampled by the router's sweeper.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from gpumesh.router.fleet.entries import NodeView
from gpumesh.router.scheduling.types import NodeState


@dataclass(frozen=True)
class SaturationPolicy:
    """The SLO and defaults the signal is measured against (RouterConfig ``saturation_*``)."""

    slo_ttft_s: float = 2.0
    target: float = 0.8
    default_slots: int = 256
    half_life_s: float = 30.0
    reference_prompt_tokens_per_s: float = 8000.0   # per unit of weight, when unmeasured
    max_concurrency_default: int = 0


@dataclass(frozen=True)
class NodeDemand:
    """One node's part of one model's demand and capacity (from its last report)."""

    busy: int                       # requests it holds (see module docstring)
    slots: int                      # its concurrency limit
    waiting: int                    # requests its engine has waiting
    pending_prefill_tokens: int
    prefill_tokens_per_s: float     # its prefill capacity
    kv_usage: float = 0.0           # 0..1 as reported
    kv_capacity_tokens: int = 0     # 0 = unknown


@dataclass(frozen=True)
class ModelSaturation:
    model: str
    nodes: int
    queued: int                     # this router's queue for the model
    slot_utilization: float
    kv_utilization: float
    prefill_backlog_s: float
    prefill_pressure: float
    saturation: float
    at_limit: float                 # fraction of nodes at their limit in this sample
    at_limit_fraction: float        # its exponentially weighted average over time
    nodes_wanted: int


# (instrument, unit, ModelSaturation field, help text): the gauges ``router.telemetry``
# exports per model, what an autoscaler and alerts read.
SATURATION_GAUGES = (
    ("gpumesh.router.model.saturation", "1", "saturation",
     "Demand over measured capacity per model: max(slot utilization, KV utilization, queued "
     "prefill seconds / TTFT SLO); 1 = at capacity"),
    ("gpumesh.router.model.slot_utilization", "1", "slot_utilization",
     "(requests the nodes hold + this router's queue) / the nodes' concurrency slots"),
    ("gpumesh.router.model.kv_utilization", "1", "kv_utilization",
     "The nodes' KV-cache usage, averaged over their KV capacity"),
    ("gpumesh.router.model.prefill_backlog", "s", "prefill_backlog_s",
     "Queued prompt tokens / the nodes' measured prefill capacity, seconds"),
    ("gpumesh.router.model.at_limit_fraction", "1", "at_limit_fraction",
     "Fraction of recent time the model's nodes spent at their concurrency limit"),
    ("gpumesh.router.model.nodes", "{node}", "nodes",
     "Nodes serving the model that are not draining"),
    ("gpumesh.router.model.nodes_wanted", "{node}", "nodes_wanted",
     "Nodes that would keep saturation at the configured target (scale the node "
     "Deployment on it)"),
)


def node_demand(v: NodeView, model: str, policy: SaturationPolicy) -> NodeDemand:
    reg = v.entry.registration
    report = v.entry.report
    weight = next((m.capacity_weight for m in reg.models if m.name == model), 1.0)
    slots = reg.max_concurrency or policy.max_concurrency_default or policy.default_slots
    if report is None:
        return NodeDemand(v.router_in_flight, slots, 0, 0,
                          policy.reference_prompt_tokens_per_s * weight)
    ld = report.load
    busy = max(ld.num_running + ld.num_waiting, ld.in_flight, v.router_in_flight)
    cap = ld.prefill_capacity_tokens_per_s or policy.reference_prompt_tokens_per_s * weight
    return NodeDemand(busy, slots, ld.num_waiting, ld.pending_prefill_tokens, cap,
                      min(max(ld.kv_cache_usage, 0.0), 1.0), ld.kv_capacity_tokens)


def model_saturation(model: str, nodes: Sequence[NodeDemand], queued: int,
                     policy: SaturationPolicy, at_limit_fraction: float = 0.0
                     ) -> ModelSaturation:
    """The signal for one model from its serving nodes' demand and the router's queue.
    ``at_limit_fraction``: F as tracked over time (``SaturationTracker``)."""
    n = len(nodes)
    slots = sum(d.slots for d in nodes)
    busy = sum(d.busy for d in nodes) + queued
    if slots:
        util = busy / slots
    else:
        util = math.inf if queued else 0.0
    kv_w = [d.kv_capacity_tokens or 1 for d in nodes]
    kv = sum(d.kv_usage * w for d, w in zip(nodes, kv_w)) / sum(kv_w) if nodes else 0.0
    cap = sum(d.prefill_tokens_per_s for d in nodes)
    backlog = sum(d.pending_prefill_tokens for d in nodes) / cap if cap > 0 else 0.0
    pressure = backlog / policy.slo_ttft_s
    sat = max(util, kv, pressure)
    at_limit = (1.0 if queued else
                sum(d.busy >= d.slots or d.waiting > 0 for d in nodes) / n if n else 0.0)
    if n == 0:
        wanted = 1 if queued else 0
    else:
        wanted = max(1, math.ceil(n * sat / policy.target - 1e-9))
        if at_limit_fraction > 0.5:
            wanted = max(wanted, n + 1)
    return ModelSaturation(model, n, queued, util, kv, backlog, pressure, sat, at_limit,
                           at_limit_fraction, wanted)


class SaturationTracker:
    """Samples the registry (``sample``, from the router's sweeper) and keeps each model's
    at-limit fraction between samples; ``latest`` is what the gauges and GetFleet read."""

    def __init__(self, policy: SaturationPolicy, fleet: Callable[[], Iterable[NodeView]],
                 queue_length: Callable[[str], int]) -> None:
        self.policy = policy
        self._fleet = fleet
        self._queue_length = queue_length
        self._fraction: dict[str, tuple[float, float]] = {}   # model -> (F, at time)
        self.latest: dict[str, ModelSaturation] = {}

    def sample(self, now: float, models: Iterable[str] = ()) -> dict[str, ModelSaturation]:
        """Recomputes every model served (and ``models``: ones with only a queue left)."""
        # models seen last time stay while requests queue for them (their nodes all left)
        by_model: dict[str, list[NodeDemand]] = {m: [] for m in (*models, *self.latest)}
        for v in self._fleet():
            if v.state is NodeState.DRAINING:
                continue
            for m in v.entry.registration.models:
                by_model.setdefault(m.name, []).append(node_demand(v, m.name, self.policy))
        out = {}
        for model, demands in sorted(by_model.items()):
            queued = self._queue_length(model)
            if not demands and not queued:
                continue
            now_sat = model_saturation(model, demands, queued, self.policy)
            prev = self._fraction.get(model)
            if prev is None:
                frac = now_sat.at_limit
            else:
                keep = 0.5 ** (max(now - prev[1], 0.0) / self.policy.half_life_s)
                frac = keep * prev[0] + (1 - keep) * now_sat.at_limit
            self._fraction[model] = (frac, now)
            out[model] = model_saturation(model, demands, queued, self.policy, frac)
        for gone in set(self._fraction) - set(out):
            del self._fraction[gone]
        self.latest = out
        return out
