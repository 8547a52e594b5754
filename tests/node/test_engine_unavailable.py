"""A vLLM node's gRPC server is up before its engine (health says NOT_SERVING meanwhile); a
request that arrives then, or after the engine shut down, gets UNAVAILABLE (retry elsewhere),
not UNKNOWN. Real loopback gRPC over the real VllmEngine class, never started."""

from __future__ import annotations

import grpc
import pytest

from gpumesh.client import build_request
from gpumesh.v1 import inference_pb2_grpc as pb_grpc
from gpumesh.node.streaming.budget import CoalescePolicy
from gpumesh.node.api.inference import NodeInferenceServicer
from gpumesh.node.state import ServingState
from gpumesh.node.engines.vllm import VllmEngine, VllmEngineConfig


@pytest.fixture
async def unstarted_node(tiny_model_dir):
    engine = VllmEngine(VllmEngineConfig(model=str(tiny_model_dir), served_name="tiny"))
    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(
        NodeInferenceServicer(engine, ServingState("starting"), CoalescePolicy()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield pb_grpc.InferenceStub(ch)
    finally:
        await server.stop(None)


@pytest.mark.parametrize("prompt", ["hello", [("user", "hi")]])
async def test_request_before_engine_start_is_unavailable(unstarted_node, prompt):
    req = build_request(prompt, model="tiny", max_tokens=4)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await unstarted_node.Generate(req, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "still starting" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in unstarted_node.GenerateStream(req, timeout=10):
            pass
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
