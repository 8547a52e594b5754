"""KV index truth with a real vLLM CPU engine: a node whose prefix cache is reset shows at once
as holding nothing in a real router (vLLM itself publishes its AllBlocksCleared only with its
next scheduler step), under a new engine epoch; the prefix is learned again afterwards."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from gpumesh.client import MeshClient, StreamResult, build_request
from gpumesh.kvblocks import block_hashes
from gpumesh.router.app import RouterServer
from gpumesh.router.config import RouterConfig
from gpumesh.router.scheduling.types import RequestInfo
from tests.integration.procs import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PREFIX = [(7 * i + 3) % 1900 + 20 for i in range(384)]   # 3 CPU KV blocks of 128 tokens


async def wait_for(pred: Callable[[], bool], timeout: float) -> float:
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


@pytest.fixture(scope="module")
async def mesh(tiny_model_dir: Path) -> AsyncIterator[tuple[RouterServer, object]]:
    pytest.importorskip("vllm")
    from gpumesh.node.app import NodeServer
    from gpumesh.node.config import NodeConfig
    from gpumesh.node.engines.vllm import VllmEngine, VllmEngineConfig

    router = RouterServer(RouterConfig(serving={"host": "127.0.0.1", "port": free_port(),
                                                "router_id": "rt", "shutdown_grace_s": 0.5},
                                       membership={"heartbeat_interval_ms": 100}))
    await router.start()
    engine = VllmEngine(VllmEngineConfig(
        model=str(tiny_model_dir), served_name="tiny", max_model_len=512,
        num_gpu_blocks_override=16, enforce_eager=True, kv_events=True))
    node = NodeServer(NodeConfig(engine={"kind": "vllm", "model": str(tiny_model_dir),
                                         "served_name": "tiny"},
                                 serving={"port": 0, "node_id": "kv"},
                                 membership={"routers": (router.address,),
                                             "heartbeat_busy_interval_s": 0.1,
                                             "heartbeat_idle_interval_s": 0.5,
                                             "reconnect_max_backoff_s": 0.5}), engine)
    try:
        await node.start()
        await wait_for(lambda: len(router.registry) == 1, 60)
        yield router, node
    finally:
        await node.stop()
        await router.stop(0.2)


async def send(address: str, tail: list[int]) -> str:
    async with MeshClient(address) as client:
        r = StreamResult()
        async for _ in client.stream(build_request(PREFIX + tail, model="tiny", max_tokens=2),
                                     timeout=60, result=r):
            pass
    return r.node_id


async def test_a_reset_prefix_cache_empties_the_routers_index_at_once(mesh) -> None:
    router, node = mesh
    hashes = block_hashes(PREFIX)
    assert await send(router.address, [11, 12, 13]) == "kv"
    index = router.locality.indexes.model("tiny")
    await wait_for(lambda: index.match(hashes).get("kv", 0) == len(hashes), 30)
    assert index.is_precise("kv")
    before = index.epoch("kv")
    assert before > 0

    assert await node.engine.reset_prefix_cache()
    # no request runs, so vLLM has not published its AllBlocksCleared: the node's own
    # cleared update (new epoch) must reach the router by itself
    waited = await wait_for(lambda: "kv" not in index.match(hashes), 5)
    assert index.epoch("kv") > before and index.node_blocks("kv") == 0
    # what the request path sees: no node holds any of the prompt
    info = RequestInfo("tiny", len(PREFIX), prefix_hashes=tuple(hashes))
    assert not router.locality.annotate(info).cached_tokens
    assert waited < 5

    # the prefix is learned again under the new epoch; vLLM's late AllBlocksCleared (flushed
    # with this request's first step, ahead of its stored blocks) does not wipe it
    after = index.epoch("kv")
    assert await send(router.address, [21, 22]) == "kv"
    await wait_for(lambda: index.match(hashes).get("kv", 0) == len(hashes), 30)
    await asyncio.sleep(0.5)
    assert index.match(hashes).get("kv", 0) == len(hashes)
    assert index.epoch("kv") >= after
