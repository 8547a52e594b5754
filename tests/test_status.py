"""`gpumesh status`'s table (gpumesh.status.fleet_table) from a GetFleet response."""

from __future__ import annotations

from gpumesh.status import fleet_table
from gpumesh.v1 import control_pb2 as cpb


def test_fleet_table_shows_each_nodes_load_step_and_gpus() -> None:
    fleet = cpb.GetFleetResponse(router_id="r1", policy="weighted_least_load", nodes=[
        cpb.NodeStatus(node_id="b", state=cpb.NODE_STATE_STALE, address="h:9",
                       state_reason="last report 2.0s old",
                       models=[cpb.ServedModel(name="m", capacity_weight=1.0)],
                       load=cpb.LoadReport(), last_heartbeat_age_s=2.0),
        cpb.NodeStatus(node_id="a", state=cpb.NODE_STATE_HEALTHY, router_in_flight=3,
                       address="h:1", router_ids=["r1", "r2"], role="decode",
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
    assert lines[1].split() == ["node", "address", "state", "role", "models", "weight", "fe", "running", "waiting", "KV%",
                                "in", "flight", "tok/s", "step", "ms", "GPU", "util", "GPU",
                                "mem", "hb", "age", "routers", "TTFT", "pred"]
    assert lines[2].split() == ["a", "h:1", "healthy", "decode", "m", "2", "2", "12", "1", "25.0", "3/5", "1234",
                                "9.8", "50%", "3.0/80G", "0.2s", "2", "-"]
    # A node with nothing measured: dashes, not zeros that read as measurements.
    assert lines[3].split() == ["b", "h:9", "stale", "both", "m", "1", "1", "0", "0", "0.0", "0/0", "0", "-", "-",
                                "-", "2.0s", "0", "-"]
    assert lines[4] == "stale b: last report 2.0s old"


def test_status_json_document_keeps_its_schema() -> None:
    from gpumesh.status import SCHEMA, fleet_json

    fleet = cpb.GetFleetResponse(router_id="r1", policy="p", worker_addresses=["w:1"], nodes=[
        cpb.NodeStatus(node_id="q", state=cpb.NODE_STATE_QUARANTINED, address="h:3",
                       quarantine_reason="bad weight", last_heartbeat_age_s=-1.0),
        cpb.NodeStatus(node_id="d", state=cpb.NODE_STATE_DRAINING, address="h:2",
                       state_reason="the node reports draining", router_ids=["r1"],
                       frontend_addresses=["h:2", "h:5"], last_heartbeat_age_s=0.5,
                       load=cpb.LoadReport(in_flight=2, draining=True, router_accounts=[
                           cpb.RouterAccount(router_id="r1", admitted_requests=7)]))])
    doc = fleet_json(fleet, "r:50050")
    assert doc["schema"] == SCHEMA
    assert doc["router"] == {"id": "r1", "target": "r:50050", "policy": "p",
                             "worker_addresses": ["w:1"]}
    assert doc["summary"] == {"nodes": 2, "healthy": 0, "stale": 0, "draining": 1,
                              "quarantined": 1}
    d, q = doc["nodes"]
    assert (d["node_id"], d["state"], d["routers"], d["frontend_addresses"]) == (
        "d", "draining", ["r1"], ["h:2", "h:5"])
    assert d["load"]["in_flight"] == 2 and d["load"]["draining"] is True
    assert d["load"]["router_accounts"] == [{"router_id": "r1", "admitted_requests": 7,
                                             "first_token_requests": 0,
                                             "finished_requests": None}]
    assert q["state_reason"] == "bad weight" and q["heartbeat_age_s"] is None


def test_prediction_scale_and_error_show_and_drift_is_flagged() -> None:
    from gpumesh.status import fleet_json

    fleet = cpb.GetFleetResponse(router_id="r1", policy="p", nodes=[
        cpb.NodeStatus(node_id="ok", state=cpb.NODE_STATE_HEALTHY, prediction_scale=1.05,
                       ttft_error_p50=0.12),
        cpb.NodeStatus(node_id="slow", state=cpb.NODE_STATE_HEALTHY, prediction_scale=2.31,
                       ttft_error_p50=0.4),
        cpb.NodeStatus(node_id="noisy", state=cpb.NODE_STATE_HEALTHY, prediction_scale=1.0,
                       ttft_error_p50=0.8),
        cpb.NodeStatus(node_id="new", state=cpb.NODE_STATE_HEALTHY)])
    lines = fleet_table(fleet).splitlines()
    cells = {ln.split()[0]: " ".join(ln.split()[-2:]) for ln in lines[2:6]}
    assert cells == {"new": "0 -", "noisy": "x1.00 80%!", "ok": "x1.05 12%",
                     "slow": "x2.31 40%!"}
    assert lines[6:] == [
        "prediction drift noisy: observed TTFT 1.00x the profile's prediction, median error 80%",
        "prediction drift slow: observed TTFT 2.31x the profile's prediction, median error 40%"]
    nodes = {n["node_id"]: n["prediction"] for n in fleet_json(fleet, "r")["nodes"]}
    assert nodes["new"] is None
    assert nodes["ok"] == {"scale": 1.05, "ttft_error_p50": 0.12, "drifting": False}
    assert nodes["slow"]["drifting"] and nodes["noisy"]["drifting"]
