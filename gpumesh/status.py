"""`gpumesh status`: the fleet as one router process sees it (Router.GetFleet), as a table or
as JSON (schema ``gpumesh.status.v1``, documented in docs/operations.md), once or ``--watch``.

Exit codes (``Exit``), shared by ``gpumesh drain`` / ``undrain`` (gpumesh.drain) so that
scripts can branch on them: 0 done; 1 the router could not be reached or refused the call;
2 bad usage; 3 no such node in the router's fleet; 4 ``--check`` found a node that is not
healthy, or no node at all; 5 ``drain --wait`` timed out with requests still in flight.
"""

from __future__ import annotations

import asyncio
import enum
import json
import sys
from typing import Any, TextIO

import grpc

from gpumesh.security.client import ClientTls, bearer_interceptors, open_channel
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc

SCHEMA = "gpumesh.status.v1"

# A node's predictions drift when its observed / predicted TTFT ratio leaves
# [1/DRIFT_SCALE, DRIFT_SCALE] or their median error exceeds DRIFT_ERROR (the router's
# prediction feedback uses the same bounds).
DRIFT_SCALE = 1.5
DRIFT_ERROR = 0.5


class Exit(enum.IntEnum):
    OK = 0
    ROUTER_ERROR = 1
    USAGE = 2
    NODE_NOT_FOUND = 3
    NOT_HEALTHY = 4
    DRAIN_TIMEOUT = 5


def state_name(state: int) -> str:
    return cpb.NodeState.Name(state).removeprefix("NODE_STATE_").lower()


def reason_of(n: cpb.NodeStatus) -> str:
    return n.state_reason or n.quarantine_reason


def drifting(n: cpb.NodeStatus) -> bool:
    """The router's TTFT predictions for the node are off (no samples yet: False)."""
    if n.prediction_scale <= 0:
        return False
    return (not 1 / DRIFT_SCALE <= n.prediction_scale <= DRIFT_SCALE
            or n.ttft_error_p50 > DRIFT_ERROR)


def prediction_cell(n: cpb.NodeStatus) -> str:
    """``x1.05 12%``: observed / predicted TTFT and the median TTFT error; ``!`` marks
    drift; ``-`` before any sample (or under a policy that does not predict)."""
    if n.prediction_scale <= 0:
        return "-"
    return (f"x{n.prediction_scale:.2f} {n.ttft_error_p50 * 100:.0f}%"
            + ("!" if drifting(n) else ""))


def fleet_table(fleet: cpb.GetFleetResponse) -> str:
    # fe: the node's front-end processes over its engine (node.frontends); routers: how many
    # router processes the node reports to (their ids are in --json)
    head = ("node", "address", "state", "role", "models", "weight", "fe", "running", "waiting",
            "KV%", "in flight", "tok/s", "step ms", "GPU util", "GPU mem", "hb age", "routers",
            "TTFT pred")
    rows = [head]
    for n in sorted(fleet.nodes, key=lambda n: n.node_id):
        ld = n.load
        gpu_util = ",".join(f"{g.utilization * 100:.0f}%" for g in ld.gpus) or "-"
        gpu_mem = ",".join(f"{g.memory_used_bytes / 2**30:.1f}/{g.memory_total_bytes / 2**30:.0f}G"
                           for g in ld.gpus) or "-"
        age = f"{n.last_heartbeat_age_s:.1f}s" if n.last_heartbeat_age_s >= 0 else "-"
        rows.append((
            n.node_id, n.address or "-", state_name(n.state), n.role or "both",
            ",".join(m.name for m in n.models) or "-",
            f"{max((m.capacity_weight for m in n.models), default=1.0):g}",
            str(len(n.frontend_addresses) or 1), str(ld.num_running), str(ld.num_waiting),
            f"{ld.kv_cache_usage * 100:.1f}",
            f"{n.router_in_flight}/{ld.in_flight}", f"{ld.generation_tokens_per_s:.0f}",
            f"{ld.decode_step_s * 1000:.1f}" if ld.decode_step_s > 0 else "-",
            gpu_util, gpu_mem, age, str(len(n.router_ids)), prediction_cell(n)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    title = f"router {fleet.router_id}  policy {fleet.policy}  nodes {len(fleet.nodes)}"
    # why each node that is not healthy is in its state (quarantined: what it sent wrong)
    why = [f"{state_name(n.state)} {n.node_id}: {reason_of(n)}"
           for n in sorted(fleet.nodes, key=lambda n: n.node_id) if reason_of(n)]
    # nodes whose engine profile no longer predicts them (router.fleet.predictions)
    why += [f"prediction drift {n.node_id}: observed TTFT {n.prediction_scale:.2f}x the "
            f"profile's prediction, median error {n.ttft_error_p50 * 100:.0f}%"
            for n in sorted(fleet.nodes, key=lambda n: n.node_id) if drifting(n)]
    # the scaling signal per model (router.fleet.saturation)
    models = [f"model {m.model}: saturation {m.saturation:.2f} (slots {m.slot_utilization:.0%}, "
              f"KV {m.kv_utilization:.0%}, "
              f"prefill backlog {m.prefill_backlog_s:.2f}s, at limit "
              f"{m.at_limit_fraction:.0%}, queued {m.queued})  nodes {m.nodes}  "
              f"wanted {m.nodes_wanted}" for m in fleet.models]
    return "\n".join([title, *lines, *why, *models])


def _load_json(ld: cpb.LoadReport) -> dict[str, Any]:
    return {
        "num_running": ld.num_running, "num_waiting": ld.num_waiting,
        "in_flight": ld.in_flight, "pending_prefill_tokens": ld.pending_prefill_tokens,
        "kv_cache_usage": ld.kv_cache_usage, "kv_capacity_tokens": ld.kv_capacity_tokens,
        "generation_tokens_per_s": ld.generation_tokens_per_s,
        "prompt_tokens_per_s": ld.prompt_tokens_per_s,
        "prefill_capacity_tokens_per_s": ld.prefill_capacity_tokens_per_s,
        "decode_step_s": ld.decode_step_s, "output_tokens_mean": ld.output_tokens_mean,
        "draining": ld.draining,
        "engine_epoch": ld.engine_epoch,
        "step_model": ({"a_ms": ld.step_model.a_ms, "b_decode_ms": ld.step_model.b_decode_ms,
                        "b_prefill_ms": ld.step_model.b_prefill_ms,
                        "spans": ld.step_model.spans, "rms_error": ld.step_model.rms_error}
                       if ld.HasField("step_model") else None),
        "gpus": [{"index": g.index, "utilization": g.utilization,
                  "memory_used_bytes": g.memory_used_bytes,
                  "memory_total_bytes": g.memory_total_bytes} for g in ld.gpus],
        "router_accounts": [{"router_id": a.router_id,
                             "admitted_requests": a.admitted_requests,
                             "first_token_requests": a.first_token_requests,
                             "finished_requests": (a.finished_requests
                                                   if a.HasField("finished_requests") else None)}
                            for a in ld.router_accounts],
    }


def node_json(n: cpb.NodeStatus) -> dict[str, Any]:
    return {
        "node_id": n.node_id, "state": state_name(n.state), "state_reason": reason_of(n),
        "address": n.address, "frontend_addresses": list(n.frontend_addresses),
        "routers": list(n.router_ids),
        "models": [{"name": m.name, "aliases": list(m.aliases),
                    "capacity_weight": m.capacity_weight,
                    "tensor_parallel_size": m.tensor_parallel_size,
                    "max_context_length": m.max_context_length} for m in n.models],
        "engine": n.engine, "kind": n.kind, "gpu_model": n.gpu_model, "role": n.role or "both",
        "heartbeat_age_s": n.last_heartbeat_age_s if n.last_heartbeat_age_s >= 0 else None,
        "router_in_flight": n.router_in_flight,
        "load": _load_json(n.load),
        # TTFT prediction feedback; null before the router has a sample
        "prediction": ({"scale": n.prediction_scale, "ttft_error_p50": n.ttft_error_p50,
                        "drifting": drifting(n)} if n.prediction_scale > 0 else None),
    }


def fleet_json(fleet: cpb.GetFleetResponse, target: str) -> dict[str, Any]:
    """The ``gpumesh.status.v1`` document (docs/operations.md lists every field)."""
    nodes = [node_json(n) for n in sorted(fleet.nodes, key=lambda n: n.node_id)]
    counts = {s: 0 for s in ("healthy", "stale", "draining", "quarantined")}
    for n in nodes:
        counts[n["state"]] = counts.get(n["state"], 0) + 1
    return {"schema": SCHEMA,
            "router": {"id": fleet.router_id, "target": target, "policy": fleet.policy,
                       "worker_addresses": list(fleet.worker_addresses)},
            "summary": {"nodes": len(nodes), **counts},
            "nodes": nodes,
            "models": [{"model": m.model, "nodes": m.nodes, "queued": m.queued,
                        "slot_utilization": m.slot_utilization,
                        "kv_utilization": m.kv_utilization,
                        "prefill_backlog_s": m.prefill_backlog_s,
                        "saturation": m.saturation, "at_limit_fraction": m.at_limit_fraction,
                        "nodes_wanted": m.nodes_wanted} for m in fleet.models]}


def all_healthy(fleet: cpb.GetFleetResponse) -> bool:
    return bool(fleet.nodes) and all(n.state == cpb.NODE_STATE_HEALTHY for n in fleet.nodes)


def rpc_error(exc: grpc.aio.AioRpcError, out: TextIO = sys.stderr) -> Exit:
    print(f"error: {exc.code().name}: {exc.details()}", file=out)
    return Exit.NODE_NOT_FOUND if exc.code() == grpc.StatusCode.NOT_FOUND else Exit.ROUTER_ERROR


async def get_fleet(stub: cpb_grpc.RouterStub, timeout_s: float) -> cpb.GetFleetResponse:
    return await stub.GetFleet(cpb.GetFleetRequest(), timeout=timeout_s)


async def run_status(router: str, *, as_json: bool = False, watch_s: float = 0.0,
                     count: int = 0, check: bool = False, timeout_s: float = 10.0,
                     out: TextIO | None = None, tls: ClientTls | None = None,
                     api_key: str = "") -> int:
    """Prints the fleet once, or every ``watch_s`` seconds (``count`` times; 0 = until
    interrupted). Returns an ``Exit`` code: the last print's. While watching, a failed call
    prints the error and the watch goes on."""
    out = out or sys.stdout
    code = Exit.OK
    shown = 0
    # tls / api_key: an operator certificate or key (gpumesh.security.client)
    async with open_channel(router, (), tls, bearer_interceptors(api_key)) as channel:
        stub = cpb_grpc.RouterStub(channel)
        while True:
            try:
                fleet = await get_fleet(stub, timeout_s)
            except grpc.aio.AioRpcError as exc:
                code = rpc_error(exc)
            else:
                code = Exit.NOT_HEALTHY if check and not all_healthy(fleet) else Exit.OK
                if as_json:
                    # one document per line while watching (NDJSON), indented once
                    print(json.dumps(fleet_json(fleet, router), indent=None if watch_s else 2),
                          file=out, flush=True)
                else:
                    if watch_s and out.isatty():
                        out.write("\x1b[H\x1b[2J")
                    print(fleet_table(fleet), file=out, flush=True)
                    if watch_s and not out.isatty():
                        print(file=out, flush=True)
            shown += 1
            if not watch_s or (count and shown >= count):
                return code
            await asyncio.sleep(watch_s)
