"""A real router and a real simulated node (processes) shared by the fuzz tests, and a
blocking gRPC channel to each (hypothesis drives plain functions)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from gpumesh import metadata as md
from gpumesh.launcher import wait_serving, wait_until
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc
from tests.integration.procs import free_port, node_proc
from tests.security.mesh import NODE_TOML, router_proc

SECRET = "fuzz-secret"


@dataclass
class FuzzMesh:
    router: object
    node: object
    router_channel: grpc.Channel
    node_channel: grpc.Channel

    def alive(self) -> bool:
        return self.router.alive() and self.node.alive()

    def good_request_routes(self) -> None:
        """A well-formed request through the router still reaches the node and completes."""
        req = pb.GenerateRequest(model="sim", text="still routing?",
                                 sampling=pb.SamplingParams(max_tokens=4))
        resp, call = pb_grpc.InferenceStub(self.router_channel).Generate.with_call(req,
                                                                                 timeout=60)
        assert resp.usage.completion_tokens >= 1
        assert dict(call.trailing_metadata()).get(md.NODE_ID) == "fuzz-node"


@pytest.fixture(scope="session")
def fuzz_mesh(tmp_path_factory) -> Iterator[FuzzMesh]:
    tmp = tmp_path_factory.mktemp("fuzz")
    rport, nport = free_port(), free_port()
    router = router_proc(rport, ("--membership.quarantine-s", "5"), env={"GPUMESH_TICKET_SECRET": SECRET})
    cfg = tmp / "node.toml"
    # GPUMESH_FUZZ_TIME_SCALE: the simulated node's speed (0.01 for a long run of 10,000s)
    scale = os.environ.get("GPUMESH_FUZZ_TIME_SCALE", "1.0")
    cfg.write_text(f'[security]\nticket_secret = "{SECRET}"\n'
                   + NODE_TOML.replace("time_scale = 1.0", f"time_scale = {float(scale)}"))
    node = node_proc("fuzz-node", nport, [f"127.0.0.1:{rport}"], engine="sim", model="sim",
                     config=cfg)
    rch = grpc.insecure_channel(f"127.0.0.1:{rport}")
    nch = grpc.insecure_channel(f"127.0.0.1:{nport}")
    try:
        wait_serving(f"127.0.0.1:{nport}", 90, watch=[node])
        wait_serving(f"127.0.0.1:{rport}", 90, watch=[router])

        def registered() -> bool:
            try:
                fleet = cpb_grpc.RouterStub(rch).GetFleet(cpb.GetFleetRequest(), timeout=10)
            except grpc.RpcError:
                return False
            return any(n.node_id == "fuzz-node" and n.state == cpb.NODE_STATE_HEALTHY
                       for n in fleet.nodes)

        wait_until(registered, 60, watch=[router, node], what="fuzz-node healthy")
        yield FuzzMesh(router, node, rch, nch)
    finally:
        rch.close()
        nch.close()
        node.close()
        router.close()
