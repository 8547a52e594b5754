"""`gpumesh status`: the fleet table, from the router's Router.GetFleet."""

from __future__ import annotations

import sys

import grpc

from gpumesh.v1 import control_pb2 as cpb


def fleet_table(fleet: cpb.GetFleetResponse) -> str:
    # fe: the node's front-end processes over its engine (node.frontends)
    head = ("node", "state", "models", "weight", "fe", "running", "waiting", "KV%", "in flight",
            "tok/s", "step ms", "GPU util", "GPU mem", "hb age")
    rows = [head]
    for n in sorted(fleet.nodes, key=lambda n: n.node_id):
        ld = n.load
        gpu_util = ",".join(f"{g.utilization * 100:.0f}%" for g in ld.gpus) or "-"
        gpu_mem = ",".join(f"{g.memory_used_bytes / 2**30:.1f}/{g.memory_total_bytes / 2**30:.0f}G"
                           for g in ld.gpus) or "-"
        rows.append((
            n.node_id, cpb.NodeState.Name(n.state).removeprefix("NODE_STATE_").lower(),
            ",".join(m.name for m in n.models),
            f"{max((m.capacity_weight for m in n.models), default=1.0):g}",
            str(len(n.frontend_addresses) or 1), str(ld.num_running), str(ld.num_waiting), f"{ld.kv_cache_usage * 100:.1f}",
            f"{n.router_in_flight}/{ld.in_flight}", f"{ld.generation_tokens_per_s:.0f}",
            f"{ld.decode_step_s * 1000:.1f}" if ld.decode_step_s > 0 else "-",
            gpu_util, gpu_mem, f"{n.last_heartbeat_age_s:.1f}s"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    title = f"router {fleet.router_id}  policy {fleet.policy}  nodes {len(fleet.nodes)}"
    # quarantined nodes (router.fleet.quarantine): why the router refuses them
    why = [f"quarantined {n.node_id}: {n.quarantine_reason}" for n in fleet.nodes
           if n.state == cpb.NODE_STATE_QUARANTINED]
    return "\n".join([title, *lines, *why])


async def print_fleet(router: str) -> int:
    from gpumesh.client import MeshClient

    async with MeshClient(router) as client:
        try:
            fleet = await client.fleet()
        except grpc.aio.AioRpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(fleet_table(fleet))
    return 0
