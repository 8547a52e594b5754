"""A disaggregated request's trace, from real processes (`gpumesh router`, two vLLM CPU
`gpumesh node` processes with roles prefill and decode) exported to a real OTLP receiver:
router -> attempt (the decode node) -> {prefill leg -> the prefill node's span, KV transfer,
the decode node's span}."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from gpumesh import metadata as md
from gpumesh.client import MeshClient, StreamResult, build_request
from tests.integration.pd import warm_up
from tests.integration.procs import Proc, free_port, wait_serving
from tests.tracing.conftest import new_traceparent, otel_env
from tests.tracing.otlp_receiver import Span, build_tree, by_name

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("nixl")

ROUTER, ATTEMPT, NODE = "gpumesh.router.generate", "gpumesh.router.attempt", "gpumesh.node.generate"
PREFILL, TRANSFER = "gpumesh.router.prefill", "gpumesh.router.kv_transfer"


@pytest.fixture(scope="module")
async def pd_trace_mesh(receiver, tiny_model_dir, tmp_path_factory):
    env = otel_env(receiver)
    rport = free_port()
    raddr = f"127.0.0.1:{rport}"
    procs = [Proc("pd-trace-router", ["router", "--host", "127.0.0.1", "--port", str(rport),
                                      "--router-id", "pd-trace-router", "--membership.fleet-rebuild-s",
                                      "0", "--membership.lease-ttl-s", "15", "--membership.freshness-s", "5"], env)]
    addrs: list[str] = []
    try:
        for core, (node_id, role) in enumerate((("tr-pre", "prefill"), ("tr-dec", "decode"))):
            port = free_port()
            addrs.append(f"127.0.0.1:{port}")
            node_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": str(core),
                        "VLLM_CPU_KVCACHE_SPACE": "1"}
            procs.append(Proc(node_id, [
                "node", "--engine", "vllm", "--model", str(tiny_model_dir), "--port",
                str(port), "--node-id", node_id, "--router", raddr, "--role", role,
                "--served-name", "tiny", "--max-model-len", "1024", "--enforce-eager"],
                node_env))
        for addr, p in zip(addrs, procs[1:]):
            await wait_serving(addr, p, timeout_s=480)
        async with MeshClient(raddr) as client:
            for _ in range(4800):
                with contextlib.suppress(grpc.aio.AioRpcError):
                    fleet = await client.fleet(timeout=2)
                    if {n.node_id for n in fleet.nodes} >= {"tr-pre", "tr-dec"}:
                        break
                for p in procs:
                    assert p.alive(), p.log()
                await asyncio.sleep(0.1)
            await warm_up(raddr)   # a test measures the steady state, not the first exchange
            yield client
    finally:
        for p in procs:
            p.close()


def _one(spans: list[Span], name: str) -> Span:
    found = by_name(spans, name)
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


# the fixture starts two vLLM engines with their KV connector (up to 480 s each on a busy
# machine): its setup counts against this, the module's first test
@pytest.mark.timeout(1200)
async def test_trace_shows_both_legs_and_the_transfer(pd_trace_mesh, receiver):
    tp, tid, client_span = new_traceparent()
    result = StreamResult()
    req = build_request("trace the two legs " * 20, model="tiny", max_tokens=8,
                        temperature=0.0, ignore_eos=True)
    chunks = [c async for c in pd_trace_mesh.stream(
        req, timeout=120, metadata=(("traceparent", tp),), result=result)]
    assert chunks[-1].usage.completion_tokens == 8
    assert result.node_id == "tr-dec" and result.trailing[md.PREFILL_NODE_ID] == "tr-pre"

    spans = await receiver.wait_for(
        tid, lambda s: len(by_name(s, NODE)) == 2 and by_name(s, PREFILL)
        and by_name(s, TRANSFER) and by_name(s, ROUTER), timeout_s=30)
    (root,) = build_tree(spans)
    router, attempt = _one(spans, ROUTER), _one(spans, ATTEMPT)
    prefill, transfer = _one(spans, PREFILL), _one(spans, TRANSFER)
    nodes = {s.resource["service.instance.id"]: s for s in by_name(spans, NODE)}
    assert root is router and router.parent_id == client_span
    assert attempt.parent_id == router.span_id
    assert attempt.attributes["gpumesh.node.id"] == "tr-dec"
    assert prefill.parent_id == attempt.span_id == transfer.parent_id
    assert prefill.attributes["gpumesh.node.id"] == "tr-pre"
    assert transfer.attributes["gpumesh.prefill.node.id"] == "tr-pre"
    assert nodes["tr-pre"].parent_id == prefill.span_id
    assert nodes["tr-dec"].parent_id == attempt.span_id
