"""The gpumesh router fronts a stock vLLM CPU gRPC worker (vLLM's own launcher, a "foreign
node"): membership and load from its pushed records / GetLoads, requests translated to
VllmEngine Generate, its load visible in `gpumesh status`; and a mixed fleet (the worker + a
gpumesh sim node serving the same model name) routes as one."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest

from gpumesh import metadata as md
from gpumesh.status import fleet_table
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc
from gpumesh.v1 import inference_pb2 as pb
from gpumesh.v1 import inference_pb2_grpc as pb_grpc
from gpumesh.node.app import NodeServer
from gpumesh.node.config import NodeConfig
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig
from gpumesh.router.app import RouterServer
from gpumesh.router.config import RouterConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


async def _until(cond, timeout_s: float = 120.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
async def mesh(vllm_grpc_worker: str, tiny_model_dir: Path):
    # A long lease: nothing here waits for one to expire, and a worker busy with long streams
    # on shared cores can answer a load poll later than the default lease allows.
    router = RouterServer(RouterConfig(serving={"port": 0, "host": "127.0.0.1"},
                                       membership={"lease_ttl_s": 30.0,
                                                   "foreign_nodes": (f"{vllm_grpc_worker}?node_id=stock-vllm",)}))
    await router.start()
    member = router.foreign.members[0]
    try:
        await _reported(router, "stock-vllm", "the foreign node's first report")
        async with grpc.aio.insecure_channel(router.address) as ch:
            yield router, member, ch
    finally:
        await router.stop(1)


async def _reported(router: RouterServer, node_id: str, what: str) -> None:
    """Waits until ``node_id`` is in the fleet with a load report (each test starts so)."""
    await _until(lambda: (e := router.registry.entry(node_id)) is not None
                 and e.report is not None, 300, what)


def _req(model: Path, max_tokens: int, **prompt) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=str(model), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True), **prompt)


async def test_stream_and_unary_through_the_router(mesh, tiny_model_dir):
    from transformers import AutoTokenizer

    router, _, ch = mesh
    await _reported(router, "stock-vllm", "the foreign node in the fleet")
    stub = pb_grpc.InferenceStub(ch)
    req = _req(tiny_model_dir, 16, text="The mesh routes tokens")
    call = stub.GenerateStream(req, timeout=300)
    chunks = [c async for c in call]
    assert dict(await call.trailing_metadata()).get(md.NODE_ID) == "stock-vllm"
    ids = [t for c in chunks for t in c.token_ids]
    assert len(ids) == 16 and chunks[0].request_id
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens > 0
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert "".join(c.text for c in chunks) == tok.decode(ids, skip_special_tokens=True)

    unary = await stub.Generate(req, timeout=300)
    assert list(unary.token_ids) == ids   # greedy: same ids either way
    assert unary.text == "".join(c.text for c in chunks)

    by_ids = await stub.Generate(_req(tiny_model_dir, 4, token_ids=pb.TokenIds(
        ids=tok.encode("The mesh routes tokens"))), timeout=300)
    assert list(by_ids.token_ids) == ids[:4]
    chat = await stub.Generate(_req(tiny_model_dir, 4, chat=pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="hello")])), timeout=300)
    assert len(chat.token_ids) == 4
    assert router.registry.ledger("stock-vllm").in_flight == 0


async def test_load_shows_in_gpumesh_status(mesh, tiny_model_dir):
    router, member, ch = mesh
    await _reported(router, "stock-vllm", "the foreign node in the fleet")
    stub = pb_grpc.InferenceStub(ch)
    calls: list[grpc.aio.UnaryStreamCall] = []
    readers: list[asyncio.Task[None]] = []
    started = 0

    async def drain(call: grpc.aio.UnaryStreamCall) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for _ in call:
                pass

    async def top_up() -> None:
        # Three long streams in flight while we look. The tiny model can finish 400 tokens
        # before a report shows it on a loaded machine, so each stream is read to its end by
        # its own task (an unread stream never reports done) and one that ended is replaced:
        # the worker is busy whenever we look.
        nonlocal started
        live = [(c, t) for c, t in zip(calls, readers) if not t.done()]
        calls[:] = [c for c, _ in live]
        readers[:] = [t for _, t in live]
        fresh = [stub.GenerateStream(_req(tiny_model_dir, 400, text=f"load {started + i} " * 20),
                                     timeout=600) for i in range(3 - len(calls))]
        started += len(fresh)
        for c in fresh:
            await c.read()       # admitted and streaming
            calls.append(c)
            readers.append(asyncio.create_task(drain(c)))

    try:
        fleet_stub = cpb_grpc.RouterStub(ch)
        seen: list[cpb.NodeStatus] = []

        async def busy() -> bool:
            f = await fleet_stub.GetFleet(cpb.GetFleetRequest(), timeout=60)
            seen[:] = [n for n in f.nodes if n.node_id == "stock-vllm"]
            return bool(seen) and seen[0].load.num_running >= 1

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 180
        while True:
            await top_up()
            if await busy() or loop.time() > deadline:
                break
            await asyncio.sleep(0.1)
        (node,) = seen
        assert node.kind == "vllm-grpc" and node.state == cpb.NODE_STATE_HEALTHY
        assert node.load.num_running >= 1 and node.router_in_flight >= 1, (
            f"the worker's load never showed a running request over {started} streams "
            f"(pushed {member.pushed}, polled {member.polled}): {node.load}")
        assert node.load.kv_cache_usage > 0
        table = fleet_table(await fleet_stub.GetFleet(cpb.GetFleetRequest(), timeout=60))
        row = next(line for line in table.splitlines() if line.startswith("stock-vllm"))
        assert "healthy" in row and str(tiny_model_dir) in row
        assert member.pushed + member.polled > 0
    finally:
        for c in calls:
            c.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    await _until(lambda: router.registry.ledger("stock-vllm").in_flight == 0, 120,
                 "router in-flight back to 0")
    # The worker aborted them: its next reports show it idle.
    await _until(lambda: (e := router.registry.entry("stock-vllm")) is not None
                 and e.report is not None and e.report.load.num_running == 0, 300,
                 "the worker idle again")


async def test_mixed_fleet_routes_as_one(mesh, tiny_model_dir):
    router, _, ch = mesh
    await _reported(router, "stock-vllm", "the foreign node in the fleet")
    vocab = 2048
    sim = NodeServer(NodeConfig(serving={"port": 0, "node_id": "sim-peer"},
                                engine={"kind": "sim", "model": str(tiny_model_dir),
                                        "served_name": str(tiny_model_dir)},
                                membership={"routers": (router.address,)}),
                     SimEngine(SimEngineConfig(model_name=str(tiny_model_dir), vocab_size=vocab,
                                               max_context_length=512, time_scale=5.0)))
    await sim.start()
    try:
        await _reported(router, "sim-peer", "the sim node's first heartbeat")
        stub = pb_grpc.InferenceStub(ch)
        # prompts without a shared prefix, so locality ties none of them to a node
        calls = [stub.GenerateStream(_req(tiny_model_dir, 24, token_ids=pb.TokenIds(
            ids=[(7 * i + k) % 1900 + 3 for k in range(197)])), timeout=300)
                 for i in range(8)]
        served: list[str] = []
        for c in calls:
            chunks = [x async for x in c]
            assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert sum(len(x.token_ids) for x in chunks) == 24
            served.append(dict(await c.trailing_metadata()).get(md.NODE_ID, ""))
        assert {"sim-peer", "stock-vllm"} <= set(served), served
    finally:
        await sim.stop(0)
