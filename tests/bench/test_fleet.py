"""The benchmark fleet launcher: real sim node processes + a real router (+ nginx when
installed) on loopback, a short load run with per-node shares, and a teardown that leaves no
process behind."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from gpumesh_bench.fleet import NGINX, Fleet, RouterSpec, SimNodeSpec
from gpumesh_bench.loadgen import LoadConfig, run_load
from gpumesh_bench.stats import summarize
from gpumesh_bench.workload import LengthDist, WorkloadSpec, iter_requests


def _alive(pids: list[int]) -> list[int]:
    left = []
    for p in pids:
        try:
            with open(f"/proc/{p}/stat", encoding="ascii") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    left.append(p)
        except OSError:
            pass
    return left


def _run(target: str, n: int = 24) -> dict:
    spec = WorkloadSpec(LengthDist("fixed", 32), LengthDist("fixed", 8), 0, "", 40.0)
    cfg = LoadConfig(target=target, rate=40.0, num_requests=n, progress_s=0, timeout_s=30)
    return summarize(asyncio.run(run_load(cfg, iter_requests(spec))).results)


def test_fleet_router_and_nginx_run_and_teardown(tmp_path) -> None:
    nodes = [SimNodeSpec("a", 1.0), SimNodeSpec("b", 2.0), SimNodeSpec("c", 1.0)]
    use_nginx = os.path.exists(NGINX)
    t0 = time.monotonic()
    fleet = Fleet(nodes, routers=[RouterSpec("lr", "least_request")], nginx=use_nginx,
                  time_scale=1.0, nodes_per_proc=2, log_dir=tmp_path)
    with fleet:
        pids = fleet.pids()
        assert len(fleet.hosts) == 2  # 3 nodes, 2 per fleet-host process
        s = _run(fleet.address("lr"))
        assert s["ok"] == s["requests"] == 24
        assert set(s["node_share"]) <= {"a", "b", "c"} and len(s["node_share"]) >= 2
        assert abs(sum(s["node_share"].values()) - 1) < 1e-9
        if use_nginx:
            asyncio.run(fleet.wait_idle("lr", timeout_s=20))
            s2 = _run(fleet.address("nginx"), 12)
            assert s2["ok"] == 12 and set(s2["node_share"]) <= {"a", "b", "c"}
    assert not _alive(pids), f"left behind: {_alive(pids)}"
    # bounded start (120 s) and teardown (grace + kill), whatever the machine's load
    assert time.monotonic() - t0 < 300


def test_fleet_start_failure_cleans_up(tmp_path) -> None:
    # A router that cannot start (unknown policy): start() raises and nothing stays behind.
    fleet = Fleet([SimNodeSpec("a")], routers=[RouterSpec("bad", "no_such_policy")],
                  log_dir=tmp_path)
    with pytest.raises(RuntimeError):
        fleet.start(timeout_s=30)
    assert not _alive([c.pid for c in fleet.children()])
