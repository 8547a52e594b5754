"""A gpumesh sim node over vLLM's native gRPC (``VllmEngine``, smg-grpc-proto), spoken by the
real generated client stub, over loopback on the node's own port."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc
from gpumesh.node.app import NodeServer
from gpumesh.node.config import NodeConfig
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig

MODEL = "sim-interop"


@pytest.fixture(scope="module")
async def node():
    # time_scale 20: slow enough for a request to still be running when the test aborts it.
    engine = SimEngine(SimEngineConfig(model_name=MODEL, time_scale=20.0, vocab_size=2048,
                                       max_context_length=4096, kv_capacity_tokens=65536))
    server = NodeServer(NodeConfig(serving={"port": 0, "node_id": "interop-sim"},
                                   engine={"kind": "sim", "model": MODEL, "served_name": MODEL}), engine)
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield server, ch
    await server.stop(0)


def stub(node) -> vpb_grpc.VllmEngineStub:
    return vpb_grpc.VllmEngineStub(node[1])


def _req(rid: str, ids: list[int], max_tokens: int, stream: bool = True,
         **sampling) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids), stream=stream,
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling))


async def test_health_model_and_server_info(node):
    h = await stub(node).HealthCheck(vpb.HealthCheckRequest(), timeout=5)
    assert h.healthy
    info = await stub(node).GetModelInfo(vpb.GetModelInfoRequest(), timeout=5)
    assert info.served_model_name == MODEL and info.is_generation
    assert info.max_context_length == 4096 and info.vocab_size == 2048
    si = await stub(node).GetServerInfo(vpb.GetServerInfoRequest(), timeout=5)
    assert si.server_type == "vllm-grpc" and si.data_parallel_size == 1


async def test_generate_token_ids_stream_and_unary(node):
    ids = [5, 17, 99, 1000, 7]
    chunks = [r async for r in stub(node).Generate(_req("s1", ids, 12), timeout=30)]
    assert [r.WhichOneof("response") for r in chunks][-1] == "complete"
    streamed = [t for r in chunks if r.HasField("chunk") for t in r.chunk.token_ids]
    done = chunks[-1].complete
    assert len(streamed) == 12 and all(0 <= t < 2048 for t in streamed)
    assert done.finish_reason == "length" and done.prompt_tokens == len(ids)
    # vLLM's DELTA semantics: the complete repeats the last chunk's delta.
    assert list(done.output_ids) == list(chunks[-2].chunk.token_ids)
    assert all(r.chunk.prompt_tokens == len(ids) for r in chunks if r.HasField("chunk"))

    unary = [r async for r in stub(node).Generate(_req("u1", ids, 12, stream=False), timeout=30)]
    assert len(unary) == 1 and unary[0].HasField("complete")
    # Greedy: the same prompt gives the same ids on either path.
    assert list(unary[0].complete.output_ids) == streamed
    assert unary[0].complete.completion_tokens == 12


async def test_generate_text_and_stop_token(node):
    r = [x async for x in stub(node).Generate(vpb.GenerateRequest(
        request_id="t1", text="hello mesh", stream=False,
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=5)), timeout=30)]
    assert r[-1].complete.completion_tokens == 5
    # Stop on the 3rd generated id: kept in the output, reported as matched.
    ids = [1, 2, 3]
    full = [x async for x in stub(node).Generate(_req("t2", ids, 8, stream=False), timeout=30)]
    third = full[-1].complete.output_ids[2]
    r = [x async for x in stub(node).Generate(
        _req("t3", ids, 8, stream=False, stop_token_ids=[third]), timeout=30)]
    out = r[-1].complete
    assert out.finish_reason == "stop" and out.matched_token_id == third
    assert list(out.output_ids) == list(full[-1].complete.output_ids)[:3]


async def test_unsupported_and_invalid_requests(node):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in stub(node).Generate(_req("bad1", [1], 4, n=2), timeout=5):
            pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in stub(node).Generate(_req("bad2", [1] * 4000, 200), timeout=5):
            pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_abort_and_loads(node):
    server, _ = node
    # 200 prompts of 500 tokens fill the sim's 64 Ki-token KV: some run, the rest wait (each
    # starts with its own token, so the prefix cache shares none of their blocks).
    calls = [stub(node).Generate(_req(f"a{i}", [1 + i, *range(1, 500)], 400), timeout=60)
             for i in range(200)]
    firsts = await asyncio.gather(*(c.read() for c in calls[:3]))
    assert all(f.HasField("chunk") for f in firsts)
    # every call reached the node and was admitted (the client sends them concurrently: on a
    # busy machine the last ones arrive after the first chunks)
    for _ in range(600):
        if server.state.ledger.in_flight == 200:
            break
        await asyncio.sleep(0.05)
    loads = await stub(node).GetLoads(vpb.GetLoadsRequest(), timeout=5)
    (load,) = loads.loads
    assert load.num_running_reqs > 0 and load.num_waiting_reqs > 0
    assert load.num_total_reqs == load.num_running_reqs + load.num_waiting_reqs
    assert 0 < load.token_usage <= 1 and load.max_total_num_tokens == 65536
    assert load.num_waiting_uncached_tokens == server.state.ledger.pending_prefill_tokens > 0
    assert server.state.ledger.in_flight == 200   # counted in the node ledger (heartbeats)
    assert server.load_report().in_flight == 200

    # Pushed load records on SubscribeKvEvents: load_only, sequence 0, same figures.
    sub = stub(node).SubscribeKvEvents(
        cpb.SubscribeKvEventsRequest(load_records_before_first_batch=True), timeout=10)
    batch = await sub.read()
    assert batch.load.load_only and batch.sequence_number == 0 and not batch.events
    assert batch.load.running_requests > 0 and batch.load.waiting_requests > 0
    assert batch.load.HasField("waiting_uncached_tokens") and batch.load.sample == 1
    sub.cancel()

    # Out-of-band Abort: the streams end with finish_reason "abort".
    await stub(node).Abort(vpb.AbortRequest(request_ids=[f"a{i}" for i in range(200)]),
                           timeout=5)
    for c in calls:
        last = None
        while (r := await c.read()) is not grpc.aio.EOF:
            last = r
        assert last is not None and last.complete.finish_reason == "abort"
    for _ in range(50):
        if server.state.ledger.in_flight == 0:
            break
        await asyncio.sleep(0.05)
    assert server.state.ledger.in_flight == 0
    assert server.state.ledger.pending_prefill_tokens == 0
    load = (await stub(node).GetLoads(vpb.GetLoadsRequest(), timeout=5)).loads[0]
    assert load.num_running_reqs == load.num_waiting_reqs == 0


async def test_inference_service_still_served_on_the_same_port(node):
    r = await pb_grpc.InferenceStub(node[1]).ListModels(pb.ListModelsRequest(), timeout=5)
    assert r.models[0].name == MODEL


async def test_cancel_releases_the_request(node):
    server, _ = node
    call = stub(node).Generate(_req("c1", [1, 2, 3], 2000), timeout=30)
    await call.read()
    call.cancel()
    for _ in range(50):
        if server.state.ledger.in_flight == 0 and server.engine.load().num_running == 0:
            break
        await asyncio.sleep(0.05)
    assert server.state.ledger.in_flight == 0
    assert server.engine.load().num_running == 0
