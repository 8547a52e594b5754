"""``RouterOperatorServicer``: the Router service — GetFleet (operators, ``gpumesh status``),
DrainNode / UndrainNode (operators, ``gpumesh drain`` / ``undrain``) and Pick (lookaside:
choose and charge a node, answer a signed ticket for it).

DrainNode stops this router's routing to the node at once and writes a DrainOrder on the
node's Connect stream (``api.orders``): the node then drains and reports it to every router.

Pick needs ``ticket_secret`` (FAILED_PRECONDITION without it); its trailing metadata carries
the dispatch record like a routed call's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

import grpc

from gpumesh import tickets, wire
from gpumesh.router import errors
from gpumesh.router.api import intake
from gpumesh.router.api.orders import NodeOrders
from gpumesh.router.config import RouterConfig
from gpumesh.router.dispatch import Dispatcher, DispatchRecord
from gpumesh.router.fleet import NodeView, Registry
from gpumesh.router.fleet.predictions import PredictionTracker
from gpumesh.router.fleet.quarantine import Quarantine, Quarantined
from gpumesh.router.fleet.saturation import ModelSaturation
from gpumesh.router.scheduling.types import NodeState
from gpumesh.router.telemetry import RouterTelemetry
from gpumesh.v1 import control_pb2, control_pb2_grpc

log = logging.getLogger(__name__)

_STATE = {NodeState.HEALTHY: control_pb2.NODE_STATE_HEALTHY,
          NodeState.STALE: control_pb2.NODE_STATE_STALE,
          NodeState.DRAINING: control_pb2.NODE_STATE_DRAINING}


def state_reason(v: NodeView) -> str:
    """Why the node is in its state, for operators (empty when healthy)."""
    if v.state is NodeState.DRAINING:
        if v.entry.drain_ordered:
            why = v.entry.drain_reason
            return "drain ordered by an operator" + (f": {why}" if why else "")
        return "the node reports draining"
    if v.state is NodeState.STALE:
        if not math.isfinite(v.report_age_s):
            return "no report yet"
        return f"last report {v.report_age_s:.1f}s old"
    return ""


def node_status(v: NodeView, predictions: PredictionTracker | None = None
                ) -> control_pb2.NodeStatus:
    reg = v.entry.registration
    report = v.entry.report
    p = predictions.stats(reg.node_id) if predictions is not None else None
    return control_pb2.NodeStatus(
        # prediction feedback (router.fleet.predictions): 0 = no sample yet
        prediction_scale=p.scale if p is not None and p.samples else 0.0,
        ttft_error_p50=p.ttft_error_p50 if p is not None else 0.0,
        state_reason=state_reason(v),
        router_ids=report.router_ids if report is not None else (),
        node_id=reg.node_id, address=reg.address, state=_STATE[v.state],
        models=[wire.model_spec_to_proto(m) for m in reg.models],
        load=(wire.load_report_to_proto(report.load) if report is not None
              else control_pb2.LoadReport()),
        last_heartbeat_age_s=v.report_age_s if math.isfinite(v.report_age_s) else -1.0,
        router_in_flight=v.router_in_flight, engine=reg.engine, gpu_model=reg.gpu_model,
        kind=reg.kind, frontend_addresses=reg.frontend_addresses, role=reg.role)


def model_load(s: ModelSaturation) -> control_pb2.ModelLoad:
    return control_pb2.ModelLoad(
        model=s.model, nodes=s.nodes, queued=s.queued,
        slot_utilization=s.slot_utilization if math.isfinite(s.slot_utilization) else 1e9,
        prefill_backlog_s=s.prefill_backlog_s, kv_utilization=s.kv_utilization,
        saturation=s.saturation if math.isfinite(s.saturation) else 1e9,
        at_limit_fraction=s.at_limit_fraction, nodes_wanted=s.nodes_wanted)


def quarantined_status(q: Quarantined) -> control_pb2.NodeStatus:
    return control_pb2.NodeStatus(node_id=q.node_id, address=q.address,
                                  state=control_pb2.NODE_STATE_QUARANTINED,
                                  quarantine_reason=q.reason, last_heartbeat_age_s=-1.0,
                                  state_reason=f"quarantined: {q.reason}")


class RouterOperatorServicer(control_pb2_grpc.RouterServicer):
    """``clock``: monotonic seconds (deadlines); ``wall_clock``: Unix seconds (tickets)."""

    def __init__(self, config: RouterConfig, registry: Registry, dispatcher: Dispatcher,
                 clock: Callable[[], float], wall_clock: Callable[[], float],
                 telemetry: RouterTelemetry | None = None,
                 quarantine: Quarantine | None = None,
                 orders: NodeOrders | None = None,
                 saturation: Callable[[], Mapping[str, ModelSaturation]] | None = None
                 ) -> None:
        self.config = config
        self.orders = orders or NodeOrders()
        self.saturation = saturation or dict
        self.quarantine = quarantine
        self.telemetry = telemetry or RouterTelemetry.disabled()
        self.registry = registry
        self.dispatcher = dispatcher
        self.clock = clock
        self.wall_clock = wall_clock
        self._picks = 0

    async def GetFleet(self, request: control_pb2.GetFleetRequest,
                       context: grpc.aio.ServicerContext) -> control_pb2.GetFleetResponse:
        peers = self.config.serving.peer_addresses
        workers = peers if len(peers) > 1 else ()
        return control_pb2.GetFleetResponse(
            router_id=self.config.serving.router_id, policy=self.config.routing.policy,
            nodes=[node_status(v, self.registry.predictions)
                   for v in self.registry.fleet()]
            + [quarantined_status(q) for q in (self.quarantine.listing()
                                               if self.quarantine is not None else ())],
            worker_addresses=workers,
            models=[model_load(s) for _, s in sorted(self.saturation().items())])

    def _view(self, node_id: str) -> NodeView | None:
        return next((v for v in self.registry.fleet() if v.entry.node_id == node_id), None)

    async def _known(self, node_id: str, context: grpc.aio.ServicerContext) -> NodeView:
        if not node_id or len(node_id) > 256:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "node_id must be 1..256 characters")
        view = self._view(node_id)
        if view is None:
            known = ", ".join(v.entry.node_id for v in self.registry.fleet()) or "none"
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"node {node_id!r} is not in router "
                                f"{self.config.serving.router_id}'s fleet (nodes: {known})")
        assert view is not None
        return view

    async def DrainNode(self, request: control_pb2.DrainNodeRequest,
                        context: grpc.aio.ServicerContext) -> control_pb2.DrainNodeResponse:
        view = await self._known(request.node_id, context)
        reason = request.reason[:256]
        self.registry.drain(request.node_id, reason)
        why = (f"operator via router {self.config.serving.router_id}"
               + (f": {reason}" if reason else ""))
        ordered = self.orders.send(view.entry.stream_id, control_pb2.RouterMessage(
            drain=control_pb2.DrainOrder(reason=why)))
        log.info("node %s: drain ordered (%s)", request.node_id, why)
        view = self._view(request.node_id) or view
        return control_pb2.DrainNodeResponse(node=node_status(view), ordered=ordered)

    async def UndrainNode(self, request: control_pb2.UndrainNodeRequest,
                          context: grpc.aio.ServicerContext) -> control_pb2.UndrainNodeResponse:
        view = await self._known(request.node_id, context)
        self.registry.undrain(request.node_id)
        ordered = self.orders.send(view.entry.stream_id, control_pb2.RouterMessage(
            undrain=control_pb2.UndrainOrder(
                reason=f"operator via router {self.config.serving.router_id}")))
        log.info("node %s: undrain ordered", request.node_id)
        view = self._view(request.node_id) or view
        return control_pb2.UndrainNodeResponse(node=node_status(view), ordered=ordered)

    async def Pick(self, request: control_pb2.PickRequest,
                   context: grpc.aio.ServicerContext) -> control_pb2.PickResponse:
        record = DispatchRecord()
        trace = self.telemetry.start("Pick", context, record)
        try:
            if not self.config.security.ticket_secret:
                raise errors.lookaside_disabled()
            ctx = await intake.prepare(b"", request.request, self.config, self.dispatcher,
                                       context, self.clock, trace)
            slot = await self.dispatcher.pick(ctx, record, frozenset(request.exclude_node_ids))
            ticket, expires_ms = tickets.issue(
                self.config.security.ticket_secret_bytes, self.config.serving.router_id,
                slot.node_id,
                slot.charged_tokens, self.config.security.ticket_ttl_s, now=self.wall_clock())
        except (errors.RouterError, ValueError) as e:
            if isinstance(e, ValueError):
                e = errors.RouterError(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            trace.fail(e)
            await intake.abort(context, e, record, trace)
        finally:
            trace.finish(record)
        context.set_trailing_metadata(intake.trailing(record, trace))
        address = slot.address
        if slot.frontends:  # a node with several front-end processes: each in turn
            self._picks += 1
            address = slot.frontends[self._picks % len(slot.frontends)]
        return control_pb2.PickResponse(node_id=slot.node_id, address=address, ticket=ticket,
                                        expires_unix_ms=expires_ms, model=ctx.info.model,
                                        predicted_ttft_s=slot.decision.predicted_ttft_s or 0.0)
