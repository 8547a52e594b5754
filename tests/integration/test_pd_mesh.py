"""Disaggregated prefill/decode end to end: a router (in-process, real gRPC) and two real
vLLM CPU node processes on the tiny model, one ``--role prefill``, one ``--role decode``,
the KV cache moved between them by vLLM's NIXL connector.

A greedy request through the router is prefilled on one node and decoded on the other; its
tokens equal the same request served whole by one node.
"""

from __future__ import annotations

import grpc
import pytest

from gpumesh import metadata as md
from gpumesh.client import MeshClient, StreamResult, build_request
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import inference_pb2 as pb
from tests.integration.test_mesh_vllm import Mesh, healthy

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("nixl")

PD_TOML = ('[engine]\nmax_model_len = 1024\nserved_name = "tiny"\nnum_gpu_blocks_override = 64\n'
           'enforce_eager = true\n[membership]\nheartbeat_busy_interval_s = 0.1\n'
           'heartbeat_idle_interval_s = 0.5\nreconnect_max_backoff_s = 0.5\n'
           '[serving]\ndrain_timeout_s = 10\nrole = "{role}"\n')


class PdMesh(Mesh):
    leg_timeout_s = 10.0   # the router's disagg_leg_timeout_s

    async def start_router(self) -> None:
        from gpumesh.router.app import RouterServer
        from gpumesh.router.config import RouterConfig

        # leases long enough for engines starting side by side on a busy machine
        self.router = RouterServer(RouterConfig(serving={"host": "127.0.0.1",
                                                         "port": self.router_port,
                                                         "shutdown_grace_s": 1.0},
                                                membership={"lease_ttl_s": 15.0,
                                                            "freshness_s": 5.0,
                                                            "heartbeat_interval_ms": 100},
                                                dispatch={"stall_s": 5.0,
                                                          "disagg_leg_timeout_s": self.leg_timeout_s}))
        await self.router.start()

    async def warm_up(self, attempts: int = 6) -> None:
        """Until one request through the router is served disaggregated: an engine's first
        requests and the connectors' first transfer (NIXL's handshake between the two
        engines) take far longer than later ones, more than a leg's deadline on a busy
        machine; a test measures the steady state, not that first exchange."""
        req = build_request("warm up " * 40, model="tiny", max_tokens=2, temperature=0)
        for _ in range(attempts):
            result = StreamResult()
            try:
                async with MeshClient(self.router_addr) as client:
                    async for _chunk in client.stream(req, timeout=60, result=result):
                        pass
            except grpc.aio.AioRpcError:
                continue
            if result.trailing.get(md.PREFILL_NODE_ID):
                return
        raise AssertionError(f"no request was served disaggregated in {attempts} tries")

    async def start_pd_node(self, name: str, role: str, core: int, model_dir, tmp) -> None:
        from tests.integration.procs import free_port, node_proc, wait_serving

        cfg = tmp / f"{name}.toml"
        cfg.write_text(PD_TOML.format(role=role))
        port = free_port()
        proc = node_proc(name, port, [self.router_addr], model=str(model_dir), core=core,
                         config=cfg)
        self.nodes[name] = proc
        self.addrs[name] = f"127.0.0.1:{port}"
        await wait_serving(self.addrs[name], proc, timeout_s=480)


@pytest.fixture(scope="module")
async def pd_mesh(tiny_model_dir, tmp_path_factory):
    import asyncio

    m = PdMesh()
    tmp = tmp_path_factory.mktemp("pd")
    await m.start_router()
    try:
        await asyncio.gather(m.start_pd_node("pre", "prefill", 0, tiny_model_dir, tmp),
                             m.start_pd_node("dec", "decode", 1, tiny_model_dir, tmp))
        await m.wait_fleet(lambda f: {"pre", "dec"} <= healthy(f))
        await m.warm_up()
        yield m
    finally:
        for p in m.nodes.values():
            p.close()
        if m.router is not None:
            await m.router.stop(0.5)


async def _stream(target: str, req: pb.GenerateRequest) -> tuple[list[int], pb.Usage,
                                                                  StreamResult]:
    result = StreamResult()
    ids: list[int] = []
    usage = pb.Usage()
    async with MeshClient(target) as client:
        async for chunk in client.stream(req, timeout=120, result=result):
            ids.extend(chunk.token_ids)
            if chunk.HasField("usage"):
                usage = chunk.usage
    return ids, usage, result


async def test_roles_are_registered_and_shown(pd_mesh):
    fleet = await pd_mesh.fleet()
    roles = {n.node_id: n.role for n in fleet.nodes}
    assert roles == {"pre": "prefill", "dec": "decode"}


@pytest.mark.parametrize("words", [3, 40])
async def test_disaggregated_answer_equals_aggregated(pd_mesh, words: int):
    text = f"disaggregated {words}: " + "a long prompt about prefill and decode " * words
    req = build_request(text, model="tiny", max_tokens=24, temperature=0, ignore_eos=True)
    # served whole by one node (the prefill node: the decode node never sees this prompt
    # before its decode leg, so it can only have it from the transfer)
    whole, whole_usage, _ = await _stream(pd_mesh.addrs["pre"], req)
    ids, usage, result = await _stream(pd_mesh.router_addr, req)
    assert ids == whole and len(ids) == 24
    assert result.node_id == "dec"
    assert result.trailing.get(md.PREFILL_NODE_ID) == "pre"
    # usage counted once: the decode leg's, equal to the whole request's
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole_usage.prompt_tokens, whole_usage.completion_tokens)


async def test_client_kv_transfer_params_are_refused(pd_mesh):
    req = build_request("x" * 10, model="tiny", max_tokens=2)
    req.kv_transfer_params = '{"do_remote_prefill": true}'
    async with MeshClient(pd_mesh.router_addr) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_node_refuses_malformed_params(pd_mesh):
    req = build_request("hello", model="tiny", max_tokens=2)
    req.kv_transfer_params = "[1, 2]"
    async with MeshClient(pd_mesh.addrs["dec"]) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    req.kv_transfer_params = '{"do_remote_prefill": true}'
    async with MeshClient(pd_mesh.addrs["dec"]) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "remote_engine_id" in err.value.details()


async def test_status_json_has_roles(pd_mesh):
    from gpumesh.status import fleet_json

    fleet: cpb.GetFleetResponse = await pd_mesh.fleet()
    doc = fleet_json(fleet, pd_mesh.router_addr)
    assert {n["node_id"]: n["role"] for n in doc["nodes"]} == {"pre": "prefill",
                                                                "dec": "decode"}
