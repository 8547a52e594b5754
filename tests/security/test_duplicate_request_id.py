"""A request id already in flight, on Generate and GenerateStream, at the router and at the
node directly (real router and simulated-node processes): ALREADY_EXISTS, never INTERNAL; the
running request of that id is not disturbed, and the id is free again once it ends."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gpumesh.client import MeshClient, StreamResult, build_request
from gpumesh.v1 import inference_pb2_grpc as pb_grpc
from tests.security.mesh import mesh


@pytest.fixture(scope="module")
async def one_node(tmp_path_factory):
    async with mesh(tmp_path_factory.mktemp("dup"), ("good",)) as m:
        yield m


def _req(request_id: str, max_tokens: int):
    req = build_request("a long answer please", model="sim", max_tokens=max_tokens)
    req.request_id = request_id
    req.sampling.ignore_eos = True
    return req


async def _code(stub, req, stream: bool) -> grpc.StatusCode:
    try:
        if stream:
            async for _ in stub.GenerateStream(req, timeout=60):
                pass
        else:
            await stub.Generate(req, timeout=60)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("target", ["router", "node"])
async def test_a_request_id_in_flight_is_already_exists(one_node, target):
    m = one_node
    address = m.router_address if target == "router" else m.nodes["good"][1]
    async with MeshClient(m.router_address) as client, \
            grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        first = StreamResult()
        tokens: list[int] = []

        async def running() -> None:
            async for chunk in client.stream(_req("dup-1", 300), timeout=120, result=first):
                tokens.extend(chunk.token_ids)

        task = asyncio.create_task(running())
        while not tokens:   # the first request is in flight on the node
            assert not task.done()
            await asyncio.sleep(0.02)
        codes = [await _code(stub, _req("dup-1", 4), stream) for stream in (False, True, False)]
        assert not task.done(), "the duplicates ended within the first request's run"
        await task
        assert codes == [grpc.StatusCode.ALREADY_EXISTS] * 3
        assert len(tokens) == 300 and first.node_id == "good"   # undisturbed
        # the id is free again
        assert await _code(stub, _req("dup-1", 4), True) == grpc.StatusCode.OK
        assert await _code(stub, _req("dup-1", 4), False) == grpc.StatusCode.OK
