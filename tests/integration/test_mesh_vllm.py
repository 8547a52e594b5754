"""End to end: client -> router (in-process, real gRPC) -> two real vLLM CPU node processes.

Ordered: the failure tests at the end kill nodes. Nodes heartbeat to the router; the router is
restarted once (same port) and must rebuild the fleet from the next heartbeats.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from gpumesh import metadata as md
from gpumesh.client import MeshClient, StreamResult, build_request
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc
from gpumesh.router.app import RouterServer
from gpumesh.router.config import RouterConfig
from tests.integration.procs import free_port, node_proc, wait_serving

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NODE_TOML = ('[engine]\nmax_model_len = 512\nserved_name = "{name}"\nnum_gpu_blocks_override = 64\n'
             '[membership]\nheartbeat_busy_interval_s = 0.1\n'
             'heartbeat_idle_interval_s = 0.5\nreconnect_max_backoff_s = 0.5\n'
             '[serving]\ndrain_timeout_s = 10\n')


def router_config(port: int) -> RouterConfig:
    return RouterConfig(serving={"host": "127.0.0.1", "port": port, "shutdown_grace_s": 1.0},
                        membership={"lease_ttl_s": 2.0, "freshness_s": 1.0,
                                    "heartbeat_interval_ms": 100})


class Mesh:
    def __init__(self) -> None:
        self.router_port = free_port()
        self.router: RouterServer | None = None
        self.nodes: dict[str, object] = {}
        self.addrs: dict[str, str] = {}

    @property
    def router_addr(self) -> str:
        return f"127.0.0.1:{self.router_port}"

    async def start_router(self) -> None:
        self.router = RouterServer(router_config(self.router_port))
        await self.router.start()

    async def start_node(self, name: str, served: str, core: int, model_dir, tmp,
                         toml: str = "", timeout_s: float = 180) -> None:
        """A vLLM node process ``name`` on ``core``, configured by ``toml`` (NODE_TOML serving
        ``served`` when empty), registered with this mesh's router; returns once it serves."""
        cfg = tmp / f"{name}.toml"
        cfg.write_text(toml or NODE_TOML.format(name=served))
        port = free_port()
        proc = node_proc(name, port, [self.router_addr], model=str(model_dir), core=core,
                         config=cfg)
        self.nodes[name] = proc
        self.addrs[name] = f"127.0.0.1:{port}"
        await wait_serving(self.addrs[name], proc, timeout_s=timeout_s)

    async def close(self) -> None:
        """Stops the node processes, then the router."""
        for p in self.nodes.values():
            p.close()
        if self.router is not None:
            await self.router.stop(0.5)

    async def fleet(self) -> cpb.GetFleetResponse:
        async with MeshClient(self.router_addr) as c:
            return await c.fleet()

    async def wait_fleet(self, predicate, timeout_s: float = 30.0) -> cpb.GetFleetResponse:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fleet = await self.fleet()
                if predicate(fleet):
                    return fleet
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"fleet never matched: {fleet}")
            await asyncio.sleep(0.1)


def healthy(fleet: cpb.GetFleetResponse) -> set[str]:
    return {n.node_id for n in fleet.nodes if n.state == cpb.NODE_STATE_HEALTHY}


@pytest.fixture(scope="module")
async def mesh(tiny_model_dir, tmp_path_factory):
    m = Mesh()
    tmp = tmp_path_factory.mktemp("mesh")
    await m.start_router()
    try:
        await asyncio.gather(m.start_node("na", "tiny", 0, tiny_model_dir, tmp),
                             m.start_node("nb", "tiny", 1, tiny_model_dir, tmp))
        await m.wait_fleet(lambda f: {"na", "nb"} <= healthy(f))
        m.tmp = tmp
        m.model_dir = tiny_model_dir
        yield m
    finally:
        await m.close()


async def test_stream_and_unary_through_router_match_the_node(mesh):
    req = build_request("Routing through the mesh", model="tiny", max_tokens=16,
                        temperature=0, ignore_eos=True)
    async with MeshClient(mesh.router_addr) as client:
        result = StreamResult()
        chunks = [c async for c in client.stream(req, timeout=60, result=result)]
        unary = await client.generate(req, timeout=60)
    assert result.node_id in ("na", "nb")
    assert result.trailing.get(md.ATTEMPTS) == "1"
    streamed = "".join(c.text for c in chunks)
    assert streamed == unary.text and len(unary.token_ids) == 16
    assert chunks[-1].usage.completion_tokens == 16
    # Same request straight to the node that served it: identical under greedy sampling.
    async with MeshClient(mesh.addrs[result.node_id]) as direct:
        assert (await direct.generate(req, timeout=60)).text == unary.text


async def test_both_nodes_serve_through_the_router(mesh):
    """Eight concurrent requests are all served by the fleet's nodes; with the node that took
    most of them drained, the next ones go to the other node, and after the undrain both are
    healthy again. (The default policy predicts each node's first-token time: it may keep a
    burst on one node it predicts faster, so an even spread is not what is promised here;
    that every node is reachable through the router is.)"""
    async with MeshClient(mesh.router_addr) as client:
        async def one(i):
            r = StreamResult()
            async for _ in client.stream(build_request(f"spread {i}", model="tiny",
                                                       max_tokens=24, ignore_eos=True),
                                         timeout=120, result=r):
                pass
            return r.node_id
        served = await asyncio.gather(*(one(i) for i in range(8)))
        assert len(served) == 8 and set(served) <= {"na", "nb"}, served
        busiest = max(sorted(set(served)), key=served.count)
        other = "nb" if busiest == "na" else "na"
        async with grpc.aio.insecure_channel(mesh.router_addr) as ch:
            stub = cpb_grpc.RouterStub(ch)
            await stub.DrainNode(cpb.DrainNodeRequest(node_id=busiest, reason="test"),
                                 timeout=10)
            try:
                assert [await one(100 + i) for i in range(3)] == [other] * 3
            finally:
                await stub.UndrainNode(cpb.UndrainNodeRequest(node_id=busiest), timeout=10)
    await mesh.wait_fleet(lambda f: healthy(f) == {"na", "nb"}, 30)


async def test_unknown_model_not_found_lists_served(mesh):
    async with MeshClient(mesh.router_addr) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(build_request("x", model="gpt-9"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "tiny" in err.value.details()


async def test_bad_input_from_node_passes_through(mesh):
    async with MeshClient(mesh.router_addr) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(build_request("x", model="tiny", top_p=2.0), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(build_request("x", model="tiny", max_tokens=5000), timeout=10)
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        ok = await client.generate(build_request("fine", model="tiny", max_tokens=2), timeout=30)
        assert ok.usage.completion_tokens >= 1


async def test_cancel_through_router_aborts_in_the_engine(mesh):
    async with MeshClient(mesh.router_addr) as client:
        req = build_request("long", model="tiny", max_tokens=480, ignore_eos=True, per_token=True)
        result = StreamResult()
        gen = client.stream(req, timeout=120, result=result)
        got = 0
        async for _ in gen:
            got += 1
            if got == 3:
                break
        await gen.aclose()
    t_cancel = time.monotonic()
    # The node's heartbeats (engine scheduler stats) show nothing running soon after.
    fleet = await mesh.wait_fleet(
        lambda f: all(n.load.num_running == 0 and n.load.in_flight == 0 and
                      n.last_heartbeat_age_s < time.monotonic() - t_cancel for n in f.nodes),
        timeout_s=15)
    assert all(n.router_in_flight == 0 for n in fleet.nodes)


async def test_deadline_through_router(mesh):
    async with MeshClient(mesh.router_addr) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(build_request("slow", model="tiny", max_tokens=480,
                                                ignore_eos=True), timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await mesh.wait_fleet(lambda f: all(n.load.num_running == 0 for n in f.nodes), 15)


async def test_lookaside_client_streams_from_the_node(mesh):
    # No ticket secret configured on router or nodes: lookaside must fail clearly.
    async with MeshClient(mesh.router_addr, lookaside=True) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(build_request("x", model="tiny", max_tokens=2), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_status_table_shows_real_figures(mesh):
    from gpumesh.status import fleet_table

    async with MeshClient(mesh.router_addr) as client:
        await asyncio.gather(*(client.generate(build_request(f"s{i}", model="tiny",
                                                             max_tokens=64, ignore_eos=True),
                                               timeout=60) for i in range(4)))
    table = fleet_table(await mesh.fleet())
    assert "na" in table and "nb" in table and "healthy" in table


async def test_prefix_locality_with_real_engines(mesh):
    """vLLM's KV events reach the router's prefix index, heartbeats carry the engine's own
    prefix-cache hit rate, and requests sharing a long prefix go to the node holding it."""
    from gpumesh.kvblocks import block_hashes

    prefix = [(7 * i + 3) % 1900 + 20 for i in range(384)]   # 3 CPU KV blocks of 128 tokens

    async def send(tail):
        r = StreamResult()
        async for _ in client.stream(build_request(prefix + tail, model="tiny", max_tokens=2),
                                     timeout=60, result=r):
            pass
        return r.node_id

    async with MeshClient(mesh.router_addr) as client:
        holder = await send([11, 12, 13])
        index = mesh.router.locality.indexes.model("tiny")
        hashes = block_hashes(prefix)
        deadline = time.monotonic() + 30
        while index.match(hashes).get(holder, 0) < len(hashes):
            assert time.monotonic() < deadline, index.match(hashes)
            await asyncio.sleep(0.05)
        assert index.is_precise(holder)
        served = [await send([100 + k, 200 + k]) for k in range(4)]
    assert served == [holder] * 4
    fleet = await mesh.wait_fleet(lambda f: any(
        n.node_id == holder and n.load.prefix_cache_hit_rate > 0.5 for n in f.nodes), 15)
    assert fleet


async def test_router_restart_rebuilds_fleet(mesh):
    await mesh.router.stop(0.5)
    with pytest.raises(grpc.aio.AioRpcError):
        await mesh.fleet()
    await mesh.start_router()
    fleet = await mesh.wait_fleet(lambda f: {"na", "nb"} <= healthy(f), timeout_s=20)
    assert {n.address for n in fleet.nodes} == {mesh.addrs["na"], mesh.addrs["nb"]}
    async with MeshClient(mesh.router_addr) as client:
        resp = await client.generate(build_request("again", model="tiny", max_tokens=4), timeout=60)
    assert resp.usage.completion_tokens >= 1


async def test_node_killed_mid_run_then_two_models_never_cross(mesh):
    """SIGKILL nb while streams run: streams that had tokens from nb fail UNAVAILABLE naming
    it (or were retried transparently if nb had sent nothing); later requests go to na. Then a
    node serving another model joins: each model only ever reaches its own node."""
    outcomes: list[tuple[str, str]] = []

    async def one(i: int, client: MeshClient) -> None:
        r = StreamResult()
        try:
            async for _ in client.stream(build_request(f"k{i}", model="tiny", max_tokens=300,
                                                       ignore_eos=True), timeout=120, result=r):
                pass
            outcomes.append(("ok", r.node_id))
        except grpc.aio.AioRpcError as exc:
            outcomes.append((exc.code().name, exc.details()))

    async with MeshClient(mesh.router_addr) as client:
        tasks = [asyncio.create_task(one(i, client)) for i in range(6)]
        await asyncio.sleep(2.0)
        mesh.nodes["nb"].kill()
        await asyncio.gather(*tasks)
        failed = [o for o in outcomes if o[0] != "ok"]
        assert all(code == "UNAVAILABLE" and "nb" in details for code, details in failed), outcomes
        assert all(node == "na" for code, node in outcomes if code == "ok" and node != "nb")
        await mesh.wait_fleet(lambda f: healthy(f) == {"na"}, timeout_s=10)
        after = []
        for i in range(3):
            r = StreamResult()
            async for _ in client.stream(build_request(f"after {i}", model="tiny", max_tokens=4),
                                         timeout=60, result=r):
                pass
            after.append(r.node_id)
        assert after == ["na"] * 3

        await mesh.start_node("nc", "other", 1, mesh.model_dir, mesh.tmp)
        await mesh.wait_fleet(lambda f: healthy(f) == {"na", "nc"})
        models = await client.list_models()
        assert {m.name: list(m.node_ids) for m in models.models} == {"tiny": ["na"],
                                                                     "other": ["nc"]}
        served = []
        for model in ["tiny", "other"] * 4:
            r = StreamResult()
            async for _ in client.stream(build_request("which", model=model, max_tokens=3),
                                         timeout=60, result=r):
                pass
            served.append((model, r.node_id))
        assert all((m == "tiny") == (n == "na") for m, n in served), served
