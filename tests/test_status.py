"""`gpumesh status`'s table (gpumesh.status.fleet_table) from a GetFleet response."""

from __future__ import annotations

from gpumesh.status import fleet_table
from gpumesh.v1 import control_pb2 as cpb


def test_fleet_table_shows_each_nodes_load_step_and_gpus() -> None:
    fleet = cpb.GetFleetResponse(router_id="r1", policy="weighted_least_load", nodes=[
        cpb.NodeStatus(node_id="b", state=cpb.NODE_STATE_STALE,
                       models=[cpb.ServedModel(name="m", capacity_weight=1.0)],
                       load=cpb.LoadReport(), last_heartbeat_age_s=2.0),
        cpb.NodeStatus(node_id="a", state=cpb.NODE_STATE_HEALTHY, router_in_flight=3,
                       frontend_addresses=["h:1", "h:2"],
                       models=[cpb.ServedModel(name="m", capacity_weight=2.0)],
                       load=cpb.LoadReport(num_running=12, num_waiting=1, kv_cache_usage=0.25,
                                           in_flight=5, generation_tokens_per_s=1234.4,
                                           decode_step_s=0.00975,
                                           gpus=[cpb.GpuStats(index=0, utilization=0.5,
                                                              memory_used_bytes=3 * 2**30,
                                                              memory_total_bytes=80 * 2**30)]),
                       last_heartbeat_age_s=0.21)])
    lines = fleet_table(fleet).splitlines()
    assert lines[0] == "router r1  policy weighted_least_load  nodes 2"
    assert lines[1].split() == ["node", "state", "models", "weight", "fe", "running", "waiting", "KV%",
                                "in", "flight", "tok/s", "step", "ms", "GPU", "util", "GPU",
                                "mem", "hb", "age"]
    assert lines[2].split() == ["a", "healthy", "m", "2", "2", "12", "1", "25.0", "3/5", "1234",
                                "9.8", "50%", "3.0/80G", "0.2s"]
    # A node with nothing measured: dashes, not zeros that read as measurements.
    assert lines[3].split() == ["b", "stale", "m", "1", "1", "0", "0", "0.0", "0/0", "0", "-", "-",
                                "-", "2.0s"]
