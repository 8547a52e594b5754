"""End to end through a router (in-process, real gRPC) to two real vLLM CPU node processes
("la" on core 0, "lb" on core 1), both serving the tiny model with the same two LoRA adapters.
Prompts are token ids.

The nodes serve the model as "tiny-cpu", the name of its built-in engine profile (calibrated
on this model on CPU), so the router predicts both from that one profile until a node has
fitted its own step model (seconds of busy engine, which only the last test's load gives):
the two are of equal speed in its view, and a decision turns on what a test varies (a prefix
held, an adapter loaded, a drain, load), not on how busy the shared machine made each core
during a node's first requests (their step times differ by several times).

- An adapter request goes to the node that has its adapter loaded (each node is given a
  different one first): the other node's prediction carries the adapter's load; an adapter no
  node serves is NOT_FOUND.
- A routing key (docs/routing.md, "Routing keys"): a conversation's turns stay on the node
  that holds its prefix; the key moves when that node is clearly worse (drained, or loaded far
  beyond the other) and then stays where the conversation went, which now holds its prefix.
"""

from __future__ import annotations

import time
from pathlib import Path
from pprint import pformat

import grpc
import pytest

from gpumesh import metadata as md
from gpumesh.client import MeshClient, build_request
from gpumesh.router.app import RouterServer
from gpumesh.router.config import RouterConfig
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc
from tests.integration.procs import free_port, node_proc, wait_serving
from tests.integration.test_affinity_sim import wait_fleet

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NODES = ("la", "lb")
PROMPT = [17, 402, 33, 1005, 61, 7, 250, 12, 99, 808]
# 48 KV blocks of 128 tokens (the CPU backend's block): 6,144 tokens, room for a conversation
# of 1.8k tokens
NODE_TOML = ('[engine]\nserved_name = "tiny-cpu"\nmax_model_len = 2048\n'
             'num_gpu_blocks_override = 48\nenforce_eager = true\n'
             '[membership]\nheartbeat_busy_interval_s = 0.1\n'
             'heartbeat_idle_interval_s = 0.2\nreconnect_max_backoff_s = 0.5\n'
             '[lora]\nadapter_dir = "{adapters}"\nmax_loras = 2\nmax_lora_rank = 8\n')

LOAD_STREAMS, LOAD_PROMPT = 8, 900   # 7,200 prompt tokens: more than a node's KV (6,144)


@pytest.fixture(scope="module")
async def mesh(tiny_model_dir: Path, tiny_adapters: Path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("affinity")
    router = RouterServer(RouterConfig(serving={"host": "127.0.0.1", "port": 0,
                                                "shutdown_grace_s": 0.5},
                                       membership={"lease_ttl_s": 3.0, "freshness_s": 1.5}))
    await router.start()
    procs, addrs = {}, {}
    try:
        for core, name in enumerate(NODES):
            cfg = tmp / f"{name}.toml"
            cfg.write_text(NODE_TOML.format(adapters=tiny_adapters))
            port = free_port()
            procs[name] = node_proc(name, port, [router.address], model=str(tiny_model_dir),
                                    core=core, config=cfg)
            addrs[name] = f"127.0.0.1:{port}"
        for name in procs:
            await wait_serving(addrs[name], procs[name], timeout_s=480)
        await wait_fleet(router.address, lambda f: set(NODES) <= healthy(f), timeout_s=60)
        yield router, addrs
    finally:
        for p in procs.values():
            p.close()
        await router.stop(0.5)


def healthy(fleet: cpb.GetFleetResponse) -> set[str]:
    return {n.node_id for n in fleet.nodes if n.state == cpb.NODE_STATE_HEALTHY}


def idle(fleet: cpb.GetFleetResponse) -> bool:
    return all(n.load.num_running == 0 and n.load.num_waiting == 0 and n.router_in_flight == 0
               for n in fleet.nodes)


def loaded(fleet: cpb.GetFleetResponse) -> dict[str, set[str]]:
    return {n.node_id: set(n.load.loaded_adapters) for n in fleet.nodes}


def summary(fleet: cpb.GetFleetResponse) -> dict[str, str]:
    """What a routing decision read about each node, for a failure's message."""
    out = {}
    for n in fleet.nodes:
        sm, ld = n.load.step_model, n.load
        out[n.node_id] = (f"{cpb.NodeState.Name(n.state)} run={ld.num_running} "
                          f"wait={ld.num_waiting} step=({sm.a_ms:.2f}, {sm.b_decode_ms:.3f}, "
                          f"{sm.b_prefill_ms:.4f}) ms/{sm.spans} adapters="
                          f"{sorted(ld.loaded_adapters)} load={ld.adapter_load_s:.4f}s "
                          f"scale={n.prediction_scale:.2f}")
    return out


async def preview(router: RouterServer, req) -> dict[str, object]:
    """The decision the router would make for ``req`` now (nothing charged or remembered),
    with each node's measured decode step: for a failure's message."""
    ctx = await router.dispatcher.prepare(req, req.SerializeToString(), time.monotonic() + 30)
    d = router.dispatcher.decide(ctx.info)
    steps = {v.entry.node_id: v.entry.report.step_s for v in router.registry.fleet()
             if v.entry.report is not None}
    return {"chosen": d.node_id, "session_node": ctx.info.session_node,
            "held": dict(ctx.info.cached_tokens), "step_s": steps,
            **{c.node_id: {k: round(v * 1e3, 3) for k, v in c.scores.items()}
               for c in d.considered}}


async def session_of(router: RouterServer, key: str) -> str:
    """The node the router remembers for routing key ``key`` (what the next request of that
    key is predicted with as its session node)."""
    req = build_request(PROMPT, max_tokens=1, routing_key=key)
    ctx = await router.dispatcher.prepare(req, req.SerializeToString(), time.monotonic() + 30)
    return ctx.info.session_node


def node_of(fleet: cpb.GetFleetResponse, node_id: str) -> cpb.NodeStatus:
    return next(n for n in fleet.nodes if n.node_id == node_id)


async def served_by(client: MeshClient, req) -> tuple[str, object]:
    call = client.inference.Generate(req, timeout=120)
    resp = await call
    return dict(await call.trailing_metadata() or ())[md.NODE_ID], resp


async def route(router: RouterServer, client: MeshClient, req) -> tuple[str, object, str]:
    """``req`` through the router: the node that served it, its answer, and what the router
    saw just before (the fleet and its decision's predictions, ms) for a failure's message."""
    why = {"fleet": summary(await client.fleet(timeout=30)), **await preview(router, req)}
    node, resp = await served_by(client, req)
    return node, resp, pformat(why, width=100)


async def test_adapter_request_goes_where_the_adapter_is_loaded(mesh) -> None:
    router, addrs = mesh
    target = router.address
    # each node loads a different adapter, asked directly
    for node, adapter in (("la", "alpha"), ("lb", "beta")):
        async with MeshClient(addrs[node]) as direct:
            await direct.generate(build_request(PROMPT, max_tokens=2, adapter=adapter),
                                  timeout=120)
    await wait_fleet(target, lambda f: loaded(f) == {"la": {"alpha"}, "lb": {"beta"}})
    async with MeshClient(target) as client:
        listed = await client.list_models(timeout=30)
        assert set(listed.models[0].adapters) == {"alpha", "beta"}
        for _ in range(3):
            # each request on an idle fleet: the node without the adapter would add its load
            await wait_fleet(target, idle)
            node, resp, why = await route(router, client, build_request(
                PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True, adapter="alpha"))
            assert node == "la" and resp.usage.completion_tokens == 8, why
            await wait_fleet(target, idle)
            node, _, why = await route(router, client, build_request(
                PROMPT, max_tokens=4, adapter="beta"))
            assert node == "lb", why
        # neither node loaded the other's adapter
        assert loaded(await client.fleet(timeout=30)) == {"la": {"alpha"}, "lb": {"beta"}}
        # the adapter was applied on the real engine: its greedy output is not the base's
        async with MeshClient(addrs["la"]) as direct:
            base = await direct.generate(build_request(
                PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True), timeout=120)
        assert list(resp.token_ids) != list(base.token_ids)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.generate(build_request(PROMPT, max_tokens=2, adapter="gamma"),
                                  timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


class Conversation:
    """One routing key's turns: each prompt is the previous one, its reply and a new user
    message of ``USER_TOKENS`` token ids (two of the engine's 128-token KV blocks: the node
    that served the last turn holds a prefix longer than the other's by at least that)."""

    USER_TOKENS = 256

    def __init__(self, router: RouterServer, client: MeshClient, key: str) -> None:
        self.router, self.client, self.key = router, client, key
        self.prompt: list[int] = []
        self.turns = 0
        self.seen = ""   # what the router saw before the last turn (``route``)

    async def turn(self) -> str:
        """Sends the next turn through the router; the node that served it."""
        self.turns += 1
        start = 3 + 17 * self.turns
        self.prompt += [(start + 7 * i) % 1900 + 50 for i in range(self.USER_TOKENS)]
        node, resp, self.seen = await route(self.router, self.client, build_request(
            self.prompt, max_tokens=4, temperature=0.0, ignore_eos=True, routing_key=self.key))
        self.prompt += list(resp.token_ids)
        return node


async def test_routing_key_stays_with_its_prefix_and_moves_off_a_worse_node(mesh) -> None:
    router, addrs = mesh
    target = router.address
    async with MeshClient(target) as client, grpc.aio.insecure_channel(target) as ch:
        operator = cpb_grpc.RouterStub(ch)
        await wait_fleet(target, idle)
        conv = Conversation(router, client, "user-1")
        first = await conv.turn()
        other = next(n for n in NODES if n != first)
        # the key remembers its node: the next turn's prediction counts it as a hit there
        # (where the turn then goes is the prediction's call: two real engines on a shared
        # machine differ in speed by more than a turn's prefill; the simulated fleet's tests
        # check the placement itself)
        assert await session_of(router, conv.key) == first
        await conv.turn()

        # its node drained: the key moves, and its node is the one the conversation went to
        await operator.DrainNode(cpb.DrainNodeRequest(node_id=first, reason="test"),
                                 timeout=30)
        assert await conv.turn() == other, conv.seen
        assert await session_of(router, conv.key) == other
        await operator.UndrainNode(cpb.UndrainNodeRequest(node_id=first), timeout=30)
        await wait_fleet(target, lambda f: set(NODES) <= healthy(f) and idle(f))
        home = await conv.turn()
        assert await session_of(router, conv.key) == home
        first, other = other if home == first else first, home

        # its node loaded far beyond the other (streams sent to it directly whose prompts
        # alone need more KV than it has: its batch is full and requests wait): the key
        # moves back to the idle node
        async with MeshClient(addrs[other]) as direct:
            calls = []
            try:
                for i in range(LOAD_STREAMS):
                    call = direct.inference.GenerateStream(build_request(
                        [(60 + 13 * i + 5 * j) % 1900 + 50 for j in range(LOAD_PROMPT)],
                        max_tokens=1000, ignore_eos=True), timeout=120)
                    calls.append(call)
                await wait_fleet(target, lambda f: node_of(f, other).load.num_waiting > 0)
                assert await conv.turn() == first, conv.seen
            finally:
                for call in calls:
                    call.cancel()
