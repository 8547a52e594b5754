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
from gpumesh_bench.sim.smg_policy import SmgConfig, WorkerLoad
from gpumesh_bench.sim.workloads import Arrival, FleetEvent, Workload

__all__ = ["MODEL", "RequestRecord", "RunResult", "Simulation", "simulate"]

MODEL = "sim-model"
SWEEP_S = 0.5

# event kinds
_ARRIVE, _NODE_RECV, _STEP_END, _HB_SEND, _HB_RECV, _FIRST_RECV, _END_RECV, _FLEET, \
    _REG_RECV, _DEREG_RECV, _SWEEP, _KV_RECV = range(12)





def simulate(fleet: FleetSpec, workload: Workload, policy: str, seed: int,
             **kwargs: Any) -> RunResult:
    return Simulation(fleet, workload, policy, seed, **kwargs).run()
