"""Disaggregated prefill/decode end to end: a router (in-process, real gRPC) and two real
vLLM CPU node processes on the tiny model, one ``--role prefill``, one ``--role decode``,
the KV cache moved between them by vLLM's NIXL connector (``tests.integration.pd``).

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
from tests.integration.pd import started_pd_mesh

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("nixl")


@pytest.fixture(scope="module")
async def pd_mesh(tiny_model_dir, tmp_path_factory):
    async with started_pd_mesh(tiny_model_dir, tmp_path_factory.mktemp("pd")) as m:
        yield m


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
