"""The router as a real grpc.aio server on port 0 with fake nodes (real servers, real Connect
streams) over loopback."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpumesh import metadata as md
from gpumesh import tickets
from gpumesh.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from gpumesh.router.app import RouterServer
from gpumesh.config import nest
from gpumesh.router.config import RouterConfig
from tests.integration.procs import free_port
from tests.router.fakenode import FakeNode

SECRET = "test-secret"


async def wait_for(pred: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def config(**kw: Any) -> RouterConfig:
    base: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "router_id": "rt",
                            "lease_ttl_s": 1.0, "freshness_s": 0.5, "heartbeat_interval_ms": 50,
                            "shutdown_grace_s": 0.5, "ticket_secret": SECRET}
    base.update(kw)
    return RouterConfig.build(nest(RouterConfig, base))


class Fleet:
    def __init__(self, router: RouterServer, nodes: list[FakeNode],
                 channel: grpc.aio.Channel) -> None:
        self.router = router
        self.nodes = {n.node_id: n for n in nodes}
        self.channel = channel
        self.stub = inference_pb2_grpc.InferenceStub(channel)
        self.admin = control_pb2_grpc.RouterStub(channel)


@contextlib.asynccontextmanager
async def fleet(*nodes: dict[str, Any], **cfg: Any) -> AsyncIterator[Fleet]:
    router = RouterServer(config(**cfg))
    await router.start()
    started = [await FakeNode(routers=(router.address,), **kw).start() for kw in nodes]
    channel = grpc.aio.insecure_channel(router.address)
    try:
        await wait_for(lambda: len(router.registry) == len(started) and all(
            e.entry.report is not None for e in router.registry.fleet()))
        yield Fleet(router, started, channel)
    finally:
        await channel.close()
        for n in started:
            await n.stop()
        await router.stop(0.2)


def req(model: str = "m", max_tokens: int = 4, text: str = "hello world") -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(model=model, text=text,
                                         sampling=inference_pb2.SamplingParams(max_tokens=max_tokens))


async def stream_all(stub: inference_pb2_grpc.InferenceStub, request: inference_pb2.GenerateRequest,
                     **kw: Any) -> tuple[list[inference_pb2.GenerateStreamResponse], dict[str, str]]:
    call = stub.GenerateStream(request, **kw)
    chunks = [c async for c in call]
    return chunks, dict(await call.trailing_metadata())


async def drain(call: grpc.aio.UnaryStreamCall) -> int:
    n = 0
    while await call.read() is not grpc.aio.EOF:
        n += 1
    return n


async def test_stream_through_router() -> None:
    async with fleet({"node_id": "a"}) as f:
        chunks, trailing = await stream_all(f.stub, req(max_tokens=5))
        assert "".join(c.text for c in chunks) == "t0 t1 t2 t3 t4 "
        assert chunks[0].request_id and chunks[-1].usage.completion_tokens == 5
        assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert trailing[md.NODE_ID] == "a" and trailing[md.ATTEMPTS] == "1"
        seen = f.nodes["a"].seen[0]
        assert seen.router_id == "rt" and seen.charged_tokens == 3   # 11 bytes / 4
        await wait_for(lambda: f.router.registry.ledger("a").in_flight == 0)


async def test_unary_through_router() -> None:
    async with fleet({"node_id": "a"}) as f:
        call = f.stub.Generate(req(max_tokens=3))
        resp = await call
        assert resp.text == "t0 t1 t2 " and list(resp.token_ids) == [0, 1, 2]
        trailing = dict(await call.trailing_metadata())
        assert trailing[md.NODE_ID] == "a" and trailing[md.ATTEMPTS] == "1"


async def test_routing_spreads_over_nodes() -> None:
    async with fleet({"node_id": "a", "token_s": 0.02}, {"node_id": "b", "token_s": 0.02},
                     {"node_id": "c", "token_s": 0.02}) as f:
        results = await asyncio.gather(*(stream_all(f.stub, req(max_tokens=4))
                                          for _ in range(12)))
        counts = Counter(t[md.NODE_ID] for _, t in results)
        assert set(counts) == {"a", "b", "c"} and max(counts.values()) <= 5, counts


async def test_finished_counts_reach_the_ledger_and_their_absence_is_kept() -> None:
    """The node's per-router finished count rides the heartbeat into this router's
    RouterAccount (None when the node leaves it unset) and GetFleet; once every request has
    ended and a report came after, the node holds none of ours and D is 0 either way."""
    async with fleet({"node_id": "a"}, {"node_id": "b", "reports_finished": False}) as f:
        await asyncio.gather(*(stream_all(f.stub, req(max_tokens=3)) for _ in range(6)))
        reg = f.router.registry
        seq = {n: reg.entry(n).report.seq for n in "ab"}
        await wait_for(lambda: all(reg.entry(n).report.seq > seq[n] for n in "ab"))
        acc = {n: reg.entry(n).report.account for n in "ab"}
        assert acc["a"].finished_requests == acc["a"].admitted_requests > 0
        assert acc["b"].finished_requests is None and acc["b"].admitted_requests > 0
        assert acc["a"].admitted_requests + acc["b"].admitted_requests == 6
        assert reg.ledger("a").decode_delta() == reg.ledger("b").decode_delta() == 0
        fleet_resp = await f.admin.GetFleet(control_pb2.GetFleetRequest(), timeout=30)
        shown = {n.node_id: n for n in fleet_resp.nodes}
        (a_acc,) = [a for a in shown["a"].load.router_accounts if a.router_id == "rt"]
        assert a_acc.HasField("finished_requests") and a_acc.finished_requests > 0
        (b_acc,) = [a for a in shown["b"].load.router_accounts if a.router_id == "rt"]
        assert not b_acc.HasField("finished_requests")


async def test_cancel_reaches_node() -> None:
    async with fleet({"node_id": "a", "token_s": 0.2}) as f:
        call = f.stub.GenerateStream(req(max_tokens=100))
        first = await call.read()
        assert first.text == "t0 "
        node = f.nodes["a"]
        assert node.active == 1
        call.cancel()
        await wait_for(lambda: node.cancelled == 1 and node.active == 0)
        await wait_for(lambda: f.router.registry.ledger("a").in_flight == 0)


async def test_client_deadline_reaches_node() -> None:
    async with fleet({"node_id": "a", "token_s": 0.2}) as f:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stream_all(f.stub, req(max_tokens=100), timeout=0.3)
        assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_for(lambda: f.nodes["a"].cancelled == 1)


async def test_unknown_model_not_found_lists_served() -> None:
    # fleet_rebuild_s=0: NOT_FOUND at once (by default a just-started router says UNAVAILABLE)
    async with fleet({"node_id": "a", "model": "llama"}, {"node_id": "b", "model": "qwen"},
                     fleet_rebuild_s=0) as f:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stream_all(f.stub, req(model="gpt"))
        assert e.value.code() is grpc.StatusCode.NOT_FOUND
        assert "llama, qwen" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await f.stub.Generate(req(model=""))
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_two_models_never_cross_and_aliases_route() -> None:
    async with fleet({"node_id": "a", "model": "llama", "aliases": ("l",)},
                     {"node_id": "b", "model": "qwen"}) as f:
        jobs = [stream_all(f.stub, req(model=m)) for m in ["llama", "qwen", "l"] * 6]
        results = await asyncio.gather(*jobs)
        for (_, trailing), model in zip(results, ["llama", "qwen", "l"] * 6):
            assert trailing[md.NODE_ID] == ("b" if model == "qwen" else "a")
        assert {s.model for s in f.nodes["a"].seen} == {"llama", "l"}
        assert {s.model for s in f.nodes["b"].seen} == {"qwen"}


async def test_empty_model_with_one_served() -> None:
    async with fleet({"node_id": "a", "model": "only"}) as f:
        _, trailing = await stream_all(f.stub, req(model=""))
        assert trailing[md.NODE_ID] == "a"


async def test_list_models_aggregates() -> None:
    async with fleet({"node_id": "a", "model": "m", "capacity_weight": 1.0},
                     {"node_id": "b", "model": "m", "capacity_weight": 2.0},
                     {"node_id": "c", "model": "x"}) as f:
        resp = await f.stub.ListModels(inference_pb2.ListModelsRequest())
        models = {m.name: m for m in resp.models}
        assert models["m"].capacity_weight == 3.0 and list(models["m"].node_ids) == ["a", "b"]
        assert list(models["x"].node_ids) == ["c"]


async def test_node_validation_error_passes_through() -> None:
    async with fleet({"node_id": "a"}) as f:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stream_all(f.stub, req(max_tokens=0))
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tokens" in e.value.details()
        assert dict(e.value.trailing_metadata())[md.ATTEMPTS] == "1"   # not retried
        await wait_for(lambda: f.router.registry.ledger("a").in_flight == 0)


async def test_no_healthy_node_unavailable() -> None:
    async with fleet({"node_id": "a", "draining": True}) as f:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stream_all(f.stub, req())
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()


async def test_node_dies_before_first_token_is_retried_elsewhere() -> None:
    async with fleet({"node_id": "a-bad", "fail_mode": "before_first"}, {"node_id": "b-good"},
                     routing={"policy": "round_robin"}) as f:
        chunks, trailing = await stream_all(f.stub, req(max_tokens=3))
        assert "".join(c.text for c in chunks) == "t0 t1 t2 "
        assert trailing[md.NODE_ID] == "b-good" and trailing[md.ATTEMPTS] == "2"
        assert len(f.nodes["a-bad"].seen) == 1


async def test_unary_retried_when_node_dies() -> None:
    async with fleet({"node_id": "a-bad", "fail_mode": "before_first"}, {"node_id": "b-good"},
                     routing={"policy": "round_robin"}) as f:
        call = f.stub.Generate(req(max_tokens=2))
        assert (await call).text == "t0 t1 "
        assert dict(await call.trailing_metadata())[md.ATTEMPTS] == "2"


async def test_node_dies_after_first_token_stream_continues_elsewhere() -> None:
    async with fleet({"node_id": "a-bad", "fail_mode": "after_first"}, {"node_id": "b-good"},
                     routing={"policy": "round_robin"}) as f:
        call = f.stub.GenerateStream(req(max_tokens=5))
        chunks = [c async for c in call]
        assert "".join(c.text for c in chunks) == "t0 t1 t2 t3 t4 "
        assert [i for c in chunks for i in c.token_ids] == [0, 1, 2, 3, 4]
        assert chunks[-1].usage.completion_tokens == 5
        trailing = dict(await call.trailing_metadata())
        assert trailing[md.NODE_ID] == "b-good" and trailing[md.ATTEMPTS] == "2"
        assert len(f.nodes["b-good"].seen) == 1


async def test_node_dies_after_first_token_unavailable_naming_node() -> None:
    async with fleet({"node_id": "a-bad", "fail_mode": "after_first"}, {"node_id": "b-good"},
                     routing={"policy": "round_robin"}) as f:
        opted_out = req(max_tokens=5)
        opted_out.no_migration = True
        call = f.stub.GenerateStream(opted_out)
        first = await call.read()
        assert first.text == "t0 "
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await drain(call)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "a-bad" in e.value.details()
        assert dict(e.value.trailing_metadata())[md.NODE_ID] == "a-bad"
        assert len(f.nodes["b-good"].seen) == 0
        # the dead node leaves the fleet at once (its Connect stream broke)
        await wait_for(lambda: len(f.router.registry) == 1)
        _, trailing = await stream_all(f.stub, req())
        assert trailing[md.NODE_ID] == "b-good"


async def test_router_restart_rebuilds_fleet_from_heartbeats() -> None:
    router = RouterServer(config())
    await router.start()
    port = router.port
    nodes = [await FakeNode(node_id=n, routers=(router.address,)).start() for n in ("a", "b")]
    try:
        await wait_for(lambda: len(router.registry) == 2)
        await router.stop(0.1)
        router = RouterServer(config(port=port, router_id="rt2"))
        await router.start()
        await wait_for(lambda: len(router.registry) == 2)
        async with grpc.aio.insecure_channel(router.address) as ch:
            fleet_resp = await control_pb2_grpc.RouterStub(ch).GetFleet(
                control_pb2.GetFleetRequest())
            assert {n.node_id for n in fleet_resp.nodes} == {"a", "b"}
            assert fleet_resp.router_id == "rt2"
            _, trailing = await stream_all(inference_pb2_grpc.InferenceStub(ch), req())
            assert trailing[md.NODE_ID] in {"a", "b"}
        assert all(n.hellos[-1].router_id == "rt2" for n in nodes)
    finally:
        for n in nodes:
            await n.stop()
        await router.stop(0.1)


async def test_queue_bound_resource_exhausted() -> None:
    async with fleet({"node_id": "a", "max_concurrency": 1, "token_s": 0.05},
                     queue_bound=1) as f:
        first = f.stub.GenerateStream(req(max_tokens=6))
        await first.read()                                  # running: the node is full
        queued = asyncio.ensure_future(stream_all(f.stub, req(max_tokens=1)))
        await wait_for(lambda: f.router.dispatcher.queue_length("m") == 1)
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stream_all(f.stub, req())
        assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - t0 < 0.5                  # at once, not after waiting
        _, trailing = await queued                          # FIFO: served once a slot frees
        assert trailing[md.NODE_ID] == "a"
        await drain(first)


async def test_deadline_honoured_in_queue() -> None:
    async with fleet({"node_id": "a", "max_concurrency": 1, "token_s": 0.1}) as f:
        first = f.stub.GenerateStream(req(max_tokens=20))
        await first.read()
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stream_all(f.stub, req(), timeout=0.3)
        assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 1.0
        await wait_for(lambda: f.router.dispatcher.queue_length("m") == 0)
        assert len(f.nodes["a"].seen) == 1                  # never dispatched
        first.cancel()


async def test_pick_returns_valid_ticket() -> None:
    async with fleet({"node_id": "a"}, {"node_id": "b"}) as f:
        resp = await f.admin.Pick(control_pb2.PickRequest(request=req(max_tokens=3)))
        assert resp.node_id in {"a", "b"} and resp.model == "m"
        assert resp.address == f.nodes[resp.node_id].address
        t = tickets.verify(SECRET.encode(), resp.ticket, resp.node_id)
        assert t.router_id == "rt" and t.prompt_tokens == 3
        assert resp.expires_unix_ms == t.expires_ms
        ledger = f.router.registry.ledger(resp.node_id)
        assert ledger.pending_tokens == 3 and ledger.in_flight == 1   # charged until released
        # the next pick goes elsewhere: the credit counts at once
        resp2 = await f.admin.Pick(control_pb2.PickRequest(request=req(max_tokens=3)))
        assert resp2.node_id != resp.node_id


async def test_pick_without_secret_failed_precondition() -> None:
    async with fleet({"node_id": "a"}, ticket_secret="") as f:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await f.admin.Pick(control_pb2.PickRequest(request=req()))
        assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION


async def test_get_fleet_health_and_stale_lease() -> None:
    async with fleet({"node_id": "a", "kv_cache_usage": 0.4}) as f:
        resp = await f.admin.GetFleet(control_pb2.GetFleetRequest())
        (node,) = resp.nodes
        assert node.state == control_pb2.NODE_STATE_HEALTHY and node.load.kv_cache_usage == 0.4
        assert resp.policy == "predicted_latency" and node.engine == "fake"
        health = health_pb2_grpc.HealthStub(f.channel)
        ok = await health.Check(health_pb2.HealthCheckRequest(service="gpumesh.v1.Inference"))
        assert ok.status == health_pb2.HealthCheckResponse.SERVING
        assert f.nodes["a"].hellos[0].lease_ttl_ms == 1000


async def test_reflection_lists_services_and_stop_flips_health() -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    router = RouterServer(config())
    await router.start()
    async with grpc.aio.insecure_channel(router.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name async for r in responses for s in r.list_services_response.service}
        assert {"gpumesh.v1.Inference", "gpumesh.v1.ControlPlane", "gpumesh.v1.Router",
                "grpc.health.v1.Health"} <= names
        health = health_pb2_grpc.HealthStub(ch)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        # no node: not ready until the fleet-rebuild window (one lease) has passed
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        stopping = asyncio.ensure_future(router.stop(0.2))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await stopping


async def test_calls_and_picks_alternate_over_a_nodes_front_ends() -> None:
    # A node with several front-end processes registers each one's own address; here the
    # second "front end" is another fake node's server (not registered itself).
    other = await FakeNode(node_id="a").start()
    router = RouterServer(config())
    await router.start()
    main = FakeNode(node_id="a", routers=(router.address,))
    main.port = free_port()
    main.frontend_addresses = (f"127.0.0.1:{main.port}", other.address)
    await main.start(main.port)
    channel = grpc.aio.insecure_channel(router.address)
    try:
        await wait_for(lambda: len(router.registry) == 1)
        stub = inference_pb2_grpc.InferenceStub(channel)
        for _ in range(4):
            chunks, trailing = await stream_all(stub, req(max_tokens=2))
            assert "".join(c.text for c in chunks) == "t0 t1 " and trailing[md.NODE_ID] == "a"
        # the router's channel to each front end carried half of the calls
        assert (len(main.seen), len(other.seen)) == (2, 2)
        picks = [await control_pb2_grpc.RouterStub(channel).Pick(
            control_pb2.PickRequest(request=req())) for _ in range(4)]
        assert sorted(p.address for p in picks) == sorted(main.frontend_addresses * 2)
        fleet_view = await control_pb2_grpc.RouterStub(channel).GetFleet(
            control_pb2.GetFleetRequest())
        assert list(fleet_view.nodes[0].frontend_addresses) == list(main.frontend_addresses)
    finally:
        await channel.close()
        await main.stop()
        await other.stop()
        await router.stop(0.2)
