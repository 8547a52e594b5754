"""Prediction feedback and SLO admission end to end: a real router (in process, real gRPC) in
front of simulated nodes, routing with a predicting policy given as a parameter (today the
test fixture ``tests.router.predicting_policy``; the real predictive policy joins the list).

- The router compares each decision's predicted TTFT with what it observed, learns the node's
  scale, exports it in GetFleet, and ``gpumesh status`` shows a drifting node.
- A request whose predicted TTFT misses its objective (its own, its API key's or its model's)
  is refused with RESOURCE_EXHAUSTED and a retry-after, or waits while a node frees up.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import statistics
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpumesh import metadata as md
from gpumesh.node.app import NodeServer
from gpumesh.node.config import NodeConfig
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig
from gpumesh.router.app import RouterServer
from gpumesh.router.auth.keys import hash_key
from gpumesh.config import nest
from gpumesh.router.config import RouterConfig
from gpumesh.router.scheduling import Policy
from gpumesh.status import run_status
from gpumesh.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.integration.procs import free_port
from tests.router.predicting_policy import FixturePredictor

MODEL = "sim"

# Predicting policies under test, each a factory; the fixture predicts half the simulated
# nodes' time to first token (50 ms steps), so the router must learn a scale of about 2.
POLICIES: dict[str, Callable[[], Policy]] = {
    "fixture": lambda: FixturePredictor(base_s=0.025),
}


async def wait_for(pred: Callable[[], bool], timeout: float = 30.0) -> None:
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def mesh(policy: Policy, n: int = 1, step_a_ms: float = 50.0,
               **router_kw: Any) -> AsyncIterator[RouterServer]:
    router = RouterServer(RouterConfig.build(nest(RouterConfig, {
        "host": "127.0.0.1", "port": free_port(), "router_id": "rt",
        "heartbeat_interval_ms": 50, "shutdown_grace_s": 0.5, **router_kw})))
    await router.start()
    router.dispatcher.admission.profile = policy   # the policy under test
    nodes = []
    try:
        for i in range(n):
            engine = SimEngine(SimEngineConfig(model_name=MODEL, time_scale=1.0, seed=i,
                                               step_a_ms=step_a_ms))
            node = NodeServer(NodeConfig(engine={"kind": "sim"},
                                         serving={"port": 0, "node_id": f"n{i}"},
                                         membership={"routers": (router.address,),
                                                     "heartbeat_idle_interval_s": 0.2,
                                                     "reconnect_max_backoff_s": 0.2}), engine)
            await node.start()
            nodes.append(node)
        await wait_for(lambda: len(router.registry) == n)
        yield router
    finally:
        for node in nodes:
            await node.stop()
        await router.stop(0.2)


def request(max_tokens: int = 2, **kw: Any) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        model=kw.pop("model", MODEL), text="a short prompt for the simulated engine",
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kw)


async def stream(address: str, req: inference_pb2.GenerateRequest,
                 metadata: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """Runs a stream to its end; returns its trailing metadata (raises AioRpcError)."""
    async with grpc.aio.insecure_channel(address) as ch:
        call = inference_pb2_grpc.InferenceStub(ch).GenerateStream(req, timeout=30,
                                                                   metadata=metadata)
        async for _ in call:
            pass
        return dict(await call.trailing_metadata())


async def refused(address: str, req: inference_pb2.GenerateRequest,
                  metadata: tuple[tuple[str, str], ...] = ()) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stream(address, req, metadata)
    return exc.value


async def fleet(address: str) -> control_pb2.GetFleetResponse:
    async with grpc.aio.insecure_channel(address) as ch:
        return await control_pb2_grpc.RouterStub(ch).GetFleet(control_pb2.GetFleetRequest(),
                                                               timeout=10)


@pytest.mark.parametrize("make_policy", POLICIES.values(), ids=list(POLICIES))
async def test_the_router_learns_from_its_prediction_errors(
        make_policy: Callable[[], Policy]) -> None:
    async with mesh(make_policy()) as router:
        tracker = router.registry.predictions
        errors: list[float] = []
        tracker.add_listener(lambda _n, kind, e: errors.append(e) if kind == "ttft" else None)
        for _ in range(20):
            await stream(router.address, request())
        stats = tracker.stats("n0")
        assert stats.samples == 20 and len(errors) == 20
        # after it learned the node, its predictions are close to what happens
        assert statistics.median(errors[-8:]) <= 0.35, errors
        # the candidate the policy reads carries the learned scale
        (cand,) = router.registry.candidates(MODEL)
        assert cand.prediction_scale == pytest.approx(stats.scale)
        got = {n.node_id: n for n in (await fleet(router.address)).nodes}["n0"]
        assert got.prediction_scale == pytest.approx(stats.scale)
        assert got.ttft_error_p50 == pytest.approx(stats.ttft_error_p50)


async def test_a_node_the_profile_mispredicts_shows_as_drifting() -> None:
    async with mesh(FixturePredictor(base_s=0.025)) as router:
        first: list[float] = []
        router.registry.predictions.add_listener(
            lambda _n, kind, e: first.append(e) if kind == "ttft" else None)
        for _ in range(12):
            await stream(router.address, request())
        scale = router.registry.predictions.scale("n0")
        assert 1.6 <= scale <= 4.0, scale     # observed about 2x the fixture's 25 ms
        assert first[0] >= 0.4                 # the unscaled prediction was half of it
        out = io.StringIO()
        assert await run_status(router.address, as_json=True, out=out) == 0
        (node,) = json.loads(out.getvalue())["nodes"]
        assert node["prediction"]["drifting"] is True
        assert node["prediction"]["scale"] == pytest.approx(scale)
        out = io.StringIO()
        await run_status(router.address, out=out)
        table = out.getvalue()
        assert f"x{scale:.2f}" in table and "prediction drift n0: observed TTFT" in table


async def test_a_request_no_node_meets_is_refused_with_a_retry_after(tmp_path: Path) -> None:
    async with mesh(FixturePredictor(base_s=0.2), slo_admission="reject",
                    slo_ttft_ms=(f"{MODEL}=100",)) as router:
        # the model's objective (100 ms) against a 200 ms prediction
        exc = await refused(router.address, request())
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "objective" in (exc.details() or "")
        meta = dict(exc.trailing_metadata() or ())
        assert meta[md.RETRY_AFTER_MS] == meta["grpc-retry-pushback-ms"] == "100"
        # the request's own objective comes first
        await stream(router.address, request(ttft_slo_ms=1000))
        exc = await refused(router.address, request(ttft_slo_ms=150))
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # out of range: INVALID_ARGUMENT, and the router keeps serving
        exc = await refused(router.address, request(ttft_slo_ms=3_600_001))
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ttft_slo_ms" in (exc.details() or "")
        exc = await refused(router.address, request(tpot_slo_ms=4_000_000))
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        await stream(router.address, request(ttft_slo_ms=1000))


async def test_an_api_keys_objective_applies_to_its_requests(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[[key]]\nname = "tight"\nsha256 = "{hash_key("gpm_tight")}"\n'
                    f'ttft_slo_ms = 100\n'
                    f'[[key]]\nname = "loose"\nsha256 = "{hash_key("gpm_loose")}"\n')
    async with mesh(FixturePredictor(base_s=0.2), slo_admission="reject",
                    api_keys_file=str(keys)) as router:
        tight = (("authorization", "Bearer gpm_tight"),)
        loose = (("authorization", "Bearer gpm_loose"),)
        exc = await refused(router.address, request(), tight)
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await stream(router.address, request(), loose)              # no objective at all
        await stream(router.address, request(ttft_slo_ms=500), tight)  # its own comes first


async def test_a_request_waits_for_a_node_that_meets_its_objective() -> None:
    # TTFT predicted 50 ms + 1 s per request already in flight on the node; one node
    async with mesh(FixturePredictor(base_s=0.05, per_request_s=1.0), step_a_ms=20.0) as router:
        busy = asyncio.ensure_future(stream(router.address, request(max_tokens=12)))
        await wait_for(lambda: router.registry.candidates(MODEL)[0].router_in_flight == 1)
        # predicted 1.05 s > 800 ms: it waits (queued) until the busy stream ends, ~0.25 s
        start = time.monotonic()
        waiting = asyncio.ensure_future(stream(router.address, request(ttft_slo_ms=800)))
        await wait_for(lambda: router.dispatcher.queue_length(MODEL) == 1, 5)
        await asyncio.gather(busy, waiting)
        assert time.monotonic() - start < 5
        assert router.dispatcher.queue_length(MODEL) == 0

        # a stream that keeps the node busy for seconds: the waiter's budget runs out first
        busy = asyncio.ensure_future(stream(router.address, request(max_tokens=150)))
        await wait_for(lambda: router.registry.candidates(MODEL)[0].router_in_flight == 1)
        start = time.monotonic()
        exc = await refused(router.address, request(ttft_slo_ms=300))
        waited = time.monotonic() - start
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # refused once its 300 ms budget ran out, while the long stream still ran
        assert 0.25 <= waited < 3.0 and not busy.done()
        assert int(dict(exc.trailing_metadata() or ())[md.RETRY_AFTER_MS]) >= 50
        assert router.dispatcher.queue_length(MODEL) == 0
        busy.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await busy
        await wait_for(lambda: router.registry.candidates(MODEL)[0].router_in_flight == 0)
