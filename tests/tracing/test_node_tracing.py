"""A real sim node process exporting to a real OTLP receiver: the node's span continues the
caller's trace, carries GenAI attributes and engine timings, records cancel and errors."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gpumesh import metadata as md
from gpumesh.client import MeshClient, StreamResult, build_request
from tests.integration.procs import Proc, free_port, wait_serving
from tests.tracing.conftest import SIM_MODEL, new_traceparent, otel_env
from tests.tracing.otlp_receiver import build_tree, by_name

pytestmark = [pytest.mark.slow]

NODE_ID = "trace-node-direct"
SPAN = "gpumesh.node.generate"


@pytest.fixture(scope="module")
async def node(receiver):
    port = free_port()
    proc = Proc(NODE_ID, ["node", "--engine", "sim", "--model", SIM_MODEL, "--port", str(port),
                          "--node-id", NODE_ID], otel_env(receiver))
    addr = f"127.0.0.1:{port}"
    try:
        await wait_serving(addr, proc, timeout_s=60)
        async with MeshClient(addr) as client:
            yield client
    finally:
        proc.close()


def _node_span_done(spans):
    return bool(by_name(spans, SPAN))


async def test_stream_continues_caller_trace_with_genai_attributes(node, receiver):
    tp, tid, parent = new_traceparent()
    req = build_request("hello tracing world", model=SIM_MODEL, max_tokens=12, temperature=0.5,
                        ignore_eos=True)
    result = StreamResult()
    chunks = [c async for c in node.stream(req, timeout=30, metadata=(("traceparent", tp),),
                                           result=result)]
    assert chunks[-1].usage.completion_tokens == 12
    assert result.trace_id == tid
    assert result.node_id == NODE_ID

    spans = await receiver.wait_for(tid, _node_span_done)
    (span,) = by_name(spans, SPAN)
    assert span.parent_id == parent  # continues the caller's context
    assert build_tree(spans)[0] is span
    assert span.service == "gpumesh-node"
    assert span.resource["service.instance.id"] == NODE_ID
    assert span.resource["deployment.environment"] == "test"  # OTEL_RESOURCE_ATTRIBUTES
    assert span.resource["gpumesh.engine"] == "sim"
    assert span.resource["host.name"]
    a = span.attributes
    assert a["gen_ai.request.model"] == SIM_MODEL
    assert a["gen_ai.request.max_tokens"] == 12
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert a["gen_ai.usage.input_tokens"] == chunks[-1].usage.prompt_tokens > 0
    assert a["gen_ai.usage.output_tokens"] == 12
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.response.id"] == chunks[0].request_id
    assert a["rpc.method"] == "GenerateStream"
    assert a["rpc.grpc.status_code"] == 0
    assert a["gpumesh.engine.ttft_s"] >= 0
    assert a["gpumesh.engine.decode_s"] >= 0
    assert "gpumesh.first_token" in span.event_names()
    assert not span.is_error


async def test_unary_traced_and_untraced(node, receiver):
    tp, tid, _ = new_traceparent()
    call = node.inference.Generate(build_request("unary", model=SIM_MODEL, max_tokens=3),
                                   timeout=30, metadata=(("traceparent", tp),))
    await call
    trailing = dict(await call.trailing_metadata())
    assert trailing[md.TRACE_ID] == tid
    spans = await receiver.wait_for(tid, _node_span_done)
    assert by_name(spans, SPAN)[0].attributes["rpc.method"] == "Generate"

    # No traceparent: the node starts its own trace (sampler parentbased_always_on).
    call = node.inference.Generate(build_request("unary", model=SIM_MODEL, max_tokens=3),
                                   timeout=30)
    await call
    own = dict(await call.trailing_metadata()).get(md.TRACE_ID, "")
    assert len(own) == 32 and own != tid
    spans = await receiver.wait_for(own, _node_span_done)
    assert by_name(spans, SPAN)[0].parent_id == ""


async def test_not_found_sets_error_status(node, receiver):
    tp, tid, _ = new_traceparent()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await node.generate(build_request("x", model="no-such-model"), timeout=10,
                            metadata=(("traceparent", tp),))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    spans = await receiver.wait_for(tid, _node_span_done)
    (span,) = by_name(spans, SPAN)
    assert span.is_error
    assert span.status_message.startswith("NOT_FOUND")
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert span.attributes["error.type"] == "NOT_FOUND"


async def test_cancel_shows_abort_event(node, receiver):
    tp, tid, _ = new_traceparent()
    req = build_request("a long one", model=SIM_MODEL, max_tokens=4000, ignore_eos=True)
    call = node.inference.GenerateStream(req, timeout=60, metadata=(("traceparent", tp),))
    first = await call.read()
    assert first.token_ids
    call.cancel()
    spans = await receiver.wait_for(tid, _node_span_done)
    (span,) = by_name(spans, SPAN)
    names = span.event_names()
    assert "gpumesh.request.cancelled" in names
    assert "gpumesh.engine.abort" in names
    assert dict(span.events)["gpumesh.request.cancelled"]["reason"] == "client"
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert not span.is_error  # a client cancel is not a server error
    assert span.attributes["gen_ai.usage.output_tokens"] < 4000


async def test_metrics_exported(node, receiver):
    deadline = asyncio.get_running_loop().time() + 10
    want = {"gpumesh.requests", "gpumesh.request.duration",
            "gpumesh.request.time_to_first_token", "gpumesh.node.num_running"}
    while not want <= receiver.metric_names():
        assert asyncio.get_running_loop().time() < deadline, receiver.metric_names()
        await asyncio.sleep(0.2)
