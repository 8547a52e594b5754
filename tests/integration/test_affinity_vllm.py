"""End to end through a router (in-process, real gRPC) to two node processes serving the tiny
model with the same two LoRA adapters: a real vLLM CPU node ("lv", LoRA on) and a simulated
node ("ls", simulated adapter loads). Prompts are token ids, which both accept.

- An adapter request works through the router and goes to the node that has the adapter
  loaded (each node is given a different one first); an adapter no node serves is NOT_FOUND.
- Requests with a routing_key stick to one node; with streams held open on one key, the
  bounded-load rule sends the third elsewhere.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from gpumesh import metadata as md
from gpumesh.client import MeshClient, build_request
from gpumesh.router.app import RouterServer
from gpumesh.router.config import RouterConfig
from gpumesh.v1 import control_pb2 as cpb
from tests.integration.procs import free_port, node_proc, wait_serving

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = [17, 402, 33, 1005, 61, 7, 250, 12, 99, 808]
NODE_TOML = ('[membership]\nheartbeat_busy_interval_s = 0.1\n'
             'heartbeat_idle_interval_s = 0.2\nreconnect_max_backoff_s = 0.5\n'
             '[lora]\nadapter_dir = "{adapters}"\nmax_loras = 2\nmax_lora_rank = 8\n'
             '[engine]\nserved_name = "tiny"\n{extra}')
VLLM_EXTRA = 'max_model_len = 512\nnum_gpu_blocks_override = 32\nenforce_eager = true\n'
# the simulated node: the tiny model's context, steps slowed so a stream stays open a while
SIM_EXTRA = ('max_model_len = 512\n[engine.sim]\nvocab_size = 2048\ntime_scale = 20.0\n'
             'adapter_load_ms = 50.0\n')


@pytest.fixture(scope="module")
async def mesh(tiny_model_dir: Path, tiny_adapters: Path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("affinity")
    router = RouterServer(RouterConfig(serving={"host": "127.0.0.1", "port": 0,
                                                "shutdown_grace_s": 0.5},
                                       membership={"lease_ttl_s": 3.0, "freshness_s": 1.5}))
    await router.start()
    procs, addrs = {}, {}
    try:
        for name, engine, extra in (("lv", "vllm", VLLM_EXTRA), ("ls", "sim", SIM_EXTRA)):
            cfg = tmp / f"{name}.toml"
            cfg.write_text(NODE_TOML.format(adapters=tiny_adapters, extra=extra))
            port = free_port()
            procs[name] = node_proc(name, port, [router.address], engine=engine,
                                    model=str(tiny_model_dir) if engine == "vllm" else "",
                                    core=1, config=cfg)
            addrs[name] = f"127.0.0.1:{port}"
        for name in procs:
            await wait_serving(addrs[name], procs[name])
        await wait_fleet(router.address, lambda f: {"lv", "ls"} <= healthy(f))
        yield router.address, addrs
    finally:
        for p in procs.values():
            p.close()
        await router.stop(0.5)


def healthy(fleet: cpb.GetFleetResponse) -> set[str]:
    return {n.node_id for n in fleet.nodes if n.state == cpb.NODE_STATE_HEALTHY}


async def wait_fleet(router: str, predicate, timeout_s: float = 60.0) -> cpb.GetFleetResponse:
    deadline = time.monotonic() + timeout_s
    async with MeshClient(router) as c:
        while True:
            fleet = await c.fleet(timeout=30)
            if predicate(fleet):
                return fleet
            if time.monotonic() > deadline:
                raise AssertionError(f"fleet never matched: {fleet}")
            await asyncio.sleep(0.1)


def idle(fleet: cpb.GetFleetResponse) -> bool:
    return all(n.load.num_running == 0 and n.load.num_waiting == 0 and n.router_in_flight == 0
               for n in fleet.nodes)


def loaded(fleet: cpb.GetFleetResponse) -> dict[str, set[str]]:
    return {n.node_id: set(n.load.loaded_adapters) for n in fleet.nodes}


async def served_by(client: MeshClient, req) -> tuple[str, object]:
    call = client.inference.Generate(req, timeout=120)
    resp = await call
    return dict(await call.trailing_metadata() or ())[md.NODE_ID], resp


@pytest.mark.xfail(strict=False, reason=(
    "written for hard adapter affinity: predicted_latency weighs the adapter's load time "
    "against this mesh's 20x slower simulated node and may load it on the vLLM node; the "
    "mesh needs nodes of comparable speed (tests/integration/test_affinity_sim.py covers "
    "the rule on equal nodes)"))
async def test_adapter_request_goes_where_the_adapter_is_loaded(mesh) -> None:
    router, addrs = mesh
    # each node loads a different adapter, asked directly
    for node, adapter in (("lv", "alpha"), ("ls", "beta")):
        async with MeshClient(addrs[node]) as direct:
            await direct.generate(build_request(PROMPT, max_tokens=2, adapter=adapter),
                                  timeout=120)
    await wait_fleet(router, lambda f: {"alpha"} <= loaded(f).get("lv", set())
                     and {"beta"} <= loaded(f).get("ls", set()))
    async with MeshClient(router) as client:
        listed = await client.list_models(timeout=30)
        assert set(listed.models[0].adapters) == {"alpha", "beta"}
        for _ in range(4):
            # each request on an idle fleet: a report that still shows the last request
            # running (the slowed simulated node reports a long step) would weigh load, not
            # the adapter, in the choice
            await wait_fleet(router, idle)
            node, resp = await served_by(client, build_request(
                PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True, adapter="alpha"))
            assert node == "lv" and resp.usage.completion_tokens == 8
            await wait_fleet(router, idle)
            node, _ = await served_by(client, build_request(PROMPT, max_tokens=4,
                                                            adapter="beta"))
            assert node == "ls"
        # the adapter was applied on the real engine: its greedy output is not the base's
        async with MeshClient(addrs["lv"]) as direct:
            base = await direct.generate(build_request(
                PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True), timeout=120)
        assert list(resp.token_ids) != list(base.token_ids)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.generate(build_request(PROMPT, max_tokens=2, adapter="gamma"),
                                  timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.xfail(strict=False, reason=(
    "written for bounded-load affinity (spill at ceil(1.25 x mean)); under predicted_latency "
    "a routing key is an expected hit weighed against load, not a bound "
    "(tests/integration/test_affinity_sim.py asserts the new rule)"))
async def test_routing_key_sticks_and_spills_over_at_the_bound(mesh) -> None:
    router, _ = mesh
    async with MeshClient(router) as client:
        # sequential requests on one key: one node, whatever the tie-breaks
        nodes = [(await served_by(client, build_request(PROMPT, max_tokens=2,
                                                        routing_key="user-1")))[0]
                 for _ in range(5)]
        assert len(set(nodes)) == 1, nodes
        # streams held open on one key: the first two share a node (fair share of 2 requests
        # over 2 nodes is 1, ceil(1.25 x 1) = 2); the third would make 3 > ceil(1.25 x 1.5)
        # there, so load decides and it goes to the other node
        calls = []
        try:
            for expect in ([0, 1], [0, 2], [1, 2]):
                call = client.inference.GenerateStream(build_request(
                    PROMPT, max_tokens=480, ignore_eos=True, routing_key="user-2"),
                    timeout=120)
                await call.read()   # dispatched and streaming before the next one starts
                calls.append(call)
                fleet = await client.fleet(timeout=30)
                assert sorted(n.router_in_flight for n in fleet.nodes) == expect, fleet
        finally:
            for call in calls:
                call.cancel()
