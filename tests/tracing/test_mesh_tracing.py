"""Client -> router -> node traces from real processes (`gpumesh router`, two
`gpumesh node --engine sim`) exported to a real OTLP receiver; the tests rebuild each trace tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys

import grpc
import pytest

from gpumesh import metadata as md
from gpumesh.client import MeshClient, StreamResult, build_request
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc
from tests.integration.procs import Proc, free_port, wait_serving
from tests.tracing.conftest import SIM_MODEL, new_traceparent, otel_env
from tests.tracing.otlp_receiver import Span, build_tree, by_name

pytestmark = [pytest.mark.slow]

ROUTER_ID = "trace-router"
NODES = ("trace-node-a", "trace-node-b")
ROUTER_SPAN, ATTEMPT_SPAN, NODE_SPAN = ("gpumesh.router.generate", "gpumesh.router.attempt",
                                        "gpumesh.node.generate")


async def _wait_fleet(client: MeshClient, n: int, proc: Proc) -> None:
    for _ in range(200):
        assert proc.alive(), proc.log()
        with contextlib.suppress(grpc.aio.AioRpcError):
            fleet = await client.fleet(timeout=2)
            if sum(1 for x in fleet.nodes if x.node_id in NODES) == n:
                return
        await asyncio.sleep(0.1)
    raise AssertionError(f"fleet never reached {n} nodes")


@pytest.fixture(scope="module")
async def mesh(receiver):
    env = otel_env(receiver)
    rport = free_port()
    raddr = f"127.0.0.1:{rport}"
    procs = [Proc(ROUTER_ID, ["router", "--host", "127.0.0.1", "--port", str(rport),
                              "--router-id", ROUTER_ID, "--dispatch.first-token-timeout-s", "10",
                              "--membership.fleet-rebuild-s", "0"], env)]
    try:
        for node_id in NODES:
            port = free_port()
            procs.append(Proc(node_id, ["node", "--engine", "sim", "--model", SIM_MODEL,
                                        "--port", str(port), "--node-id", node_id,
                                        "--router", raddr], env))
        await wait_serving(raddr, procs[0], timeout_s=60)
        async with MeshClient(raddr) as client:
            await _wait_fleet(client, len(NODES), procs[0])
            yield client, raddr, procs
    finally:
        for p in procs:
            p.close()


def _has(*names: str):
    return lambda spans: all(by_name(spans, n) for n in names)


def _one(spans: list[Span], name: str) -> Span:
    found = by_name(spans, name)
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


async def test_one_trace_across_client_router_node(mesh, receiver):
    client, _, _ = mesh
    tp, tid, client_span_id = new_traceparent()
    result = StreamResult()
    req = build_request("trace me through the mesh", model=SIM_MODEL, max_tokens=8,
                        temperature=0.0, ignore_eos=True)
    chunks = [c async for c in client.stream(req, timeout=30, metadata=(("traceparent", tp),),
                                             result=result)]
    assert chunks[-1].usage.completion_tokens == 8
    assert result.trace_id == tid and result.node_id in NODES and result.attempts == 1

    spans = await receiver.wait_for(tid, _has(ROUTER_SPAN, ATTEMPT_SPAN, NODE_SPAN))
    assert {s.trace_id for s in spans} == {tid}
    (root,) = build_tree(spans)
    router, attempt, node = _one(spans, ROUTER_SPAN), _one(spans, ATTEMPT_SPAN), _one(spans,
                                                                                        NODE_SPAN)
    # Parent/child links across processes: client -> router -> attempt -> node.
    assert root is router and router.parent_id == client_span_id
    assert attempt.parent_id == router.span_id
    assert node.parent_id == attempt.span_id
    assert [s.name for s in root.walk()] == [ROUTER_SPAN, ATTEMPT_SPAN, NODE_SPAN]
    assert router.service == "gpumesh-router" and node.service == "gpumesh-node"
    assert router.resource["service.instance.id"] == ROUTER_ID
    assert node.resource["service.instance.id"] == result.node_id

    a = router.attributes
    assert a["gpumesh.routing.policy"] == "predicted_latency"
    assert a["gpumesh.routing.candidates"] == 2
    assert a["gpumesh.routing.chosen_node"] == result.node_id == a["gpumesh.node.id"]
    assert a["gpumesh.routing.attempts"] == 1
    assert a["gpumesh.routing.queue_wait_s"] == 0.0
    assert 0.0 <= a["gpumesh.routing.report_age_s"] < 5.0
    assert {a["gpumesh.routing.candidate.0.node_id"], a["gpumesh.routing.candidate.1.node_id"]} \
        == set(NODES)
    assert a["gpumesh.routing.candidate.0.total"] >= a["gpumesh.routing.candidate.1.total"]
    # each kept candidate carries its prediction in seconds
    ttft = a["gpumesh.routing.candidate.0.score.ttft_s"]
    assert 0.0 < ttft <= a["gpumesh.routing.candidate.0.score.completion_s"]
    assert a["gpumesh.routing.candidate.0.score.imposed_s"] >= 0.0
    assert a["gen_ai.request.model"] == SIM_MODEL and a["gen_ai.request.max_tokens"] == 8
    assert a["rpc.grpc.status_code"] == 0 and a["gpumesh.ttft_s"] > 0
    assert "gpumesh.first_chunk" in router.event_names()
    assert attempt.attributes["gpumesh.attempt"] == 1
    assert attempt.attributes["gpumesh.node.id"] == result.node_id
    assert attempt.attributes["gpumesh.routing.chosen_node"] == result.node_id

    n = node.attributes
    assert n["gpumesh.router.id"] == ROUTER_ID
    assert n["gen_ai.request.model"] == SIM_MODEL
    assert n["gen_ai.request.max_tokens"] == 8
    assert n["gen_ai.request.temperature"] == 0.0
    assert n["gen_ai.usage.input_tokens"] > 0
    assert n["gen_ai.usage.output_tokens"] == 8
    assert n["gen_ai.response.finish_reasons"] == ["length"]
    assert n["gpumesh.engine.ttft_s"] >= 0 and n["gpumesh.engine.decode_s"] >= 0
    assert not any(s.is_error for s in spans)


async def test_unary_without_traceparent_starts_a_trace_at_the_router(mesh, receiver):
    client, _, _ = mesh
    call = client.inference.Generate(build_request("unary", model=SIM_MODEL, max_tokens=3),
                                     timeout=30)
    await call
    trailing = dict(await call.trailing_metadata())
    tid = trailing[md.TRACE_ID]
    spans = await receiver.wait_for(tid, _has(ROUTER_SPAN, NODE_SPAN))
    (root,) = build_tree(spans)
    assert root.name == ROUTER_SPAN and root.parent_id == ""
    assert root.attributes["rpc.method"] == "Generate"
    assert _one(spans, NODE_SPAN).resource["service.instance.id"] == trailing[md.NODE_ID]


class _GhostNode:
    """A registration for a node that is not there (its address refuses connections) and that
    heartbeats as idle: a node failure before the first token, instant (connection refused)."""

    def __init__(self, router: str) -> None:
        self.router = router
        self.address = f"127.0.0.1:{free_port()}"   # nothing listens here
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _messages(self):
        yield cpb.NodeMessage(registration=cpb.Registration(
            node_id="trace-ghost", address=self.address, incarnation="ghost-1", engine="sim",
            models=[cpb.ServedModel(name=SIM_MODEL, capacity_weight=64.0,
                                    max_context_length=8704)]))
        seq = 0
        while not self._stop.is_set():
            seq += 1
            yield cpb.NodeMessage(heartbeat=cpb.Heartbeat(seq=seq, load=cpb.LoadReport()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.2)

    async def _run(self) -> None:
        async with grpc.aio.insecure_channel(self.router) as ch:
            with contextlib.suppress(grpc.aio.AioRpcError):
                async for _ in cpb_grpc.ControlPlaneStub(ch).Connect(self._messages()):
                    pass

    async def __aenter__(self) -> _GhostNode:  # noqa: PYI034
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._task is not None
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(self._task, 5)


async def test_retry_after_node_failure_shows_both_attempts(mesh, receiver):
    client, raddr, _ = mesh
    async with _GhostNode(raddr):
        for _ in range(100):
            fleet = await client.fleet(timeout=5)
            if any(x.node_id == "trace-ghost" and x.last_heartbeat_age_s >= 0
                   for x in fleet.nodes):
                break
            await asyncio.sleep(0.05)
        # Idle nodes all score 1.0 (zero expected wait), so the pick among the three is a
        # random tie-break: 40 tries leave a (2/3)^40 ~ 1e-7 chance of never hitting the ghost.
        for _ in range(40):
            tp, tid, _ = new_traceparent()
            result = StreamResult()
            req = build_request("retry me", model=SIM_MODEL, max_tokens=4)
            async for _chunk in client.stream(req, timeout=30, metadata=(("traceparent", tp),),
                                              result=result):
                pass
            if result.attempts == 2:
                break
        else:
            pytest.fail("the router never tried the ghost node first")

    spans = await receiver.wait_for(tid, _has(ROUTER_SPAN, NODE_SPAN))
    (root,) = build_tree(spans)
    router = _one(spans, ROUTER_SPAN)
    assert root is router
    attempts = sorted(by_name(spans, ATTEMPT_SPAN), key=lambda s: s.attributes["gpumesh.attempt"])
    assert [s.attributes["gpumesh.attempt"] for s in attempts] == [1, 2]
    first, second = attempts
    assert first.parent_id == second.parent_id == router.span_id
    assert first.attributes["gpumesh.node.id"] == "trace-ghost"
    assert first.is_error and first.attributes["error.type"] == "UNAVAILABLE"
    assert first.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
    assert not first.children   # the ghost never answered
    assert second.attributes["gpumesh.node.id"] == result.node_id in NODES
    assert not second.is_error
    assert [c.name for c in second.children] == [NODE_SPAN]
    assert "trace-ghost" not in {second.attributes.get(f"gpumesh.routing.candidate.{i}.node_id")
                                 for i in range(3)}   # excluded from the retry's decision
    assert router.attributes["gpumesh.routing.attempts"] == 2
    assert router.attributes["gpumesh.node.id"] == result.node_id
    assert not router.is_error


async def test_cancel_shows_abort_on_router_and_node(mesh, receiver):
    client, _, _ = mesh
    tp, tid, _ = new_traceparent()
    req = build_request("a very long answer", model=SIM_MODEL, max_tokens=4000, ignore_eos=True)
    call = client.inference.GenerateStream(req, timeout=60, metadata=(("traceparent", tp),))
    assert (await call.read()).token_ids
    call.cancel()

    def done(spans: list[Span]) -> bool:
        return bool(by_name(spans, ROUTER_SPAN)) and any(
            "gpumesh.request.cancelled" in s.event_names() for s in by_name(spans, NODE_SPAN))

    spans = await receiver.wait_for(tid, done)
    router, node = _one(spans, ROUTER_SPAN), _one(spans, NODE_SPAN)
    assert "gpumesh.request.cancelled" in router.event_names()
    assert router.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert "gpumesh.request.cancelled" in _one(spans, ATTEMPT_SPAN).event_names()
    assert "gpumesh.engine.abort" in node.event_names()
    assert node.attributes["gen_ai.usage.output_tokens"] < 4000


async def test_not_found_shows_error_status(mesh, receiver):
    client, _, _ = mesh
    tp, tid, _ = new_traceparent()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.generate(build_request("x", model="no-such-model"), timeout=10,
                              metadata=(("traceparent", tp),))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert dict(err.value.trailing_metadata())[md.TRACE_ID] == tid
    spans = await receiver.wait_for(tid, _has(ROUTER_SPAN))
    (router,) = spans   # never dispatched: no attempt, no node span
    assert router.is_error and router.status_message.startswith("NOT_FOUND")
    assert router.attributes["error.type"] == "NOT_FOUND"
    assert router.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]


async def test_cli_generate_trace_prints_the_trace_id(mesh, receiver):
    """`gpumesh generate --trace` with an OTLP endpoint: a client root span, same trace id."""
    _, raddr, _ = mesh
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpumesh.cli", "generate", "--target", raddr, "--trace",
        "--model", SIM_MODEL, "--max-tokens", "4", "--stream", "hello from the cli",
        env=otel_env(receiver), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    m = re.search(r"trace id: ([0-9a-f]{32})", err.decode())
    assert m, err.decode()
    tid = m.group(1)
    spans = await receiver.wait_for(tid, _has("gpumesh.client.generate", ROUTER_SPAN, NODE_SPAN))
    (root,) = build_tree(spans)
    assert root.name == "gpumesh.client.generate" and root.service == "gpumesh-client"
    assert [s.name for s in root.walk()] == ["gpumesh.client.generate", ROUTER_SPAN,
                                             ATTEMPT_SPAN, NODE_SPAN]


async def test_router_metrics_exported(mesh, receiver):
    want = {"gpumesh.requests", "gpumesh.request.duration", "gpumesh.router.heartbeat_age",
            "gpumesh.router.node.num_running", "gpumesh.router.queue_length"}
    for _ in range(100):
        if want <= receiver.metric_names("gpumesh-router"):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(receiver.metric_names("gpumesh-router"))
