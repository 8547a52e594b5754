"""Issue 8's data plane over real processes: lookaside mode (Pick + signed ticket + streaming
from the node, retry before the first token, cancellation, smooth credit release) and the
multi-worker router (N processes on one port, every node heartbeating to every worker, exact
per-router accounting). Sim nodes keep it fast; the contract is the same as for vLLM nodes."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from gpumesh.client import MeshClient, StreamResult, build_request
from gpumesh.v1 import control_pb2 as cpb
from gpumesh.v1 import control_pb2_grpc as cpb_grpc
from gpumesh.router.app import RouterServer
from gpumesh.router.config import RouterConfig
from tests.integration.procs import Proc, free_port, node_proc, wait_serving

SECRET = "dataplane-secret"
NODE_TOML = (f'[security]\nticket_secret = "{SECRET}"\n[membership]\nheartbeat_busy_interval_s = 0.1\n'
             'heartbeat_idle_interval_s = 0.3\nreconnect_max_backoff_s = 0.5\n'
             '[engine.sim]\ntime_scale = 1.0\n')


async def wait_for(predicate, timeout_s: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def healthy_ids(fleet: cpb.GetFleetResponse) -> set[str]:
    return {n.node_id for n in fleet.nodes if n.state == cpb.NODE_STATE_HEALTHY}


@pytest.fixture(scope="module")
async def lookaside_mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lookaside")
    router = RouterServer(RouterConfig(serving={"host": "127.0.0.1", "port": 0,
                                                "shutdown_grace_s": 0.5},
                                       security={"ticket_secret": SECRET},
                                       membership={"lease_ttl_s": 2.0, "freshness_s": 1.0,
                                                   "heartbeat_interval_ms": 100}))
    await router.start()
    cfg = tmp / "node.toml"
    cfg.write_text(NODE_TOML)
    nodes = {}
    try:
        for name in ("la", "lb"):
            port = free_port()
            nodes[name] = (node_proc(name, port, [router.address], engine="sim", model="sim",
                                     config=cfg), f"127.0.0.1:{port}")
        for proc, addr in nodes.values():
            await wait_serving(addr, proc, timeout_s=60)
        async with MeshClient(router.address) as c:
            await wait_for(lambda: _has(c, {"la", "lb"}), what="two healthy nodes")
        yield router, nodes
    finally:
        for proc, _ in nodes.values():
            proc.close()
        await router.stop(0.5)


async def _has(client: MeshClient, ids: set[str]) -> bool:
    return ids <= healthy_ids(await client.fleet())


async def test_lookaside_streams_from_the_node_and_credits_clear_by_node_counts(lookaside_mesh):
    router, nodes = lookaside_mesh
    async with MeshClient(router.address, lookaside=True) as client:
        results = []
        for i in range(6):
            r = StreamResult()
            chunks = [c async for c in client.stream(
                build_request(f"lookaside {i} " * 8, model="sim", max_tokens=40,
                              ignore_eos=True), timeout=30, result=r)]
            assert sum(len(c.token_ids) for c in chunks) == 40
            assert chunks[-1].finish_reason and chunks[-1].usage.completion_tokens == 40
            results.append(r.node_id)
        assert set(results) <= {"la", "lb"} and all(results)
        unary = await client.generate(build_request("unary lookaside", model="sim",
                                                    max_tokens=5, ignore_eos=True), timeout=30)
        assert unary.usage.completion_tokens == 5

    # The router never saw those first tokens; its credits for them are released by the
    # nodes' per-router first-token counts in later heartbeats (never wholesale, never stuck).
    async def cleared():
        return all(router.registry.ledger(n).pending_tokens == 0 for n in ("la", "lb"))
    await wait_for(cleared, what="lookaside credits released")
    async with MeshClient(router.address) as c:
        fleet = await c.fleet()
    admitted = sum(a.admitted_requests for n in fleet.nodes for a in n.load.router_accounts
                   if a.router_id == router.config.serving.router_id)
    assert admitted == 7


async def test_lookaside_retries_once_before_the_first_token(lookaside_mesh):
    """A registered node whose address answers nothing (it died between heartbeat and call)
    and which looks best (weight 50): the client's first attempt fails UNAVAILABLE, it asks
    for another pick excluding that node, and the request succeeds there."""
    router, _ = lookaside_mesh
    dead = f"127.0.0.1:{free_port()}"
    stop = asyncio.Event()

    async def ghost_messages():
        yield cpb.NodeMessage(registration=cpb.Registration(
            node_id="ghost", address=dead, incarnation="g1", engine="sim",
            models=[cpb.ServedModel(name="sim", max_context_length=8704,
                                    capacity_weight=50.0)]))
        seq = 0
        while not stop.is_set():
            seq += 1
            yield cpb.NodeMessage(heartbeat=cpb.Heartbeat(
                seq=seq, load=cpb.LoadReport(prompt_tokens_per_s=1e6)))
            await asyncio.sleep(0.1)

    async with grpc.aio.insecure_channel(router.address) as ch:
        call = cpb_grpc.ControlPlaneStub(ch).Connect(ghost_messages())
        try:
            async with MeshClient(router.address, lookaside=True) as client, \
                    MeshClient(router.address) as proxy:
                await wait_for(lambda: _has(client, {"ghost", "la", "lb"}), what="ghost")
                # Keep the real nodes busy so the idle-looking ghost is the unique best pick
                # (idle nodes all score the same and would tie): add streams until both real
                # nodes have REPORTED running requests (a proxy credit is gone at the first
                # token, so until that report a node that just took a stream still looks idle).
                async def both_busy() -> bool:
                    running = {n.node_id: n.load.num_running for n in (await client.fleet()).nodes}
                    return running.get("la", 0) > 0 and running.get("lb", 0) > 0

                busy = []
                while len(busy) < 12 and not await both_busy():
                    b = proxy.stream(build_request(f"busy {len(busy)}", model="sim",
                                                   max_tokens=4000, ignore_eos=True), timeout=60)
                    await anext(b)
                    busy.append(b)
                    await asyncio.sleep(0.15)   # a busy node's heartbeat interval
                await wait_for(both_busy, what="both real nodes reporting running requests")
                r = StreamResult()
                chunks = [c async for c in client.stream(
                    build_request("retry me", model="sim", max_tokens=8, ignore_eos=True),
                    timeout=30, result=r)]
                for b in busy:
                    await b.aclose()
            assert chunks[-1].usage.completion_tokens == 8
            assert r.attempts == 2 and r.node_id in ("la", "lb")
        finally:
            stop.set()
            call.cancel()


async def test_lookaside_cancel_aborts_on_the_node(lookaside_mesh):
    router, _ = lookaside_mesh
    async with MeshClient(router.address, lookaside=True) as client:
        gen = client.stream(build_request("long", model="sim", max_tokens=100_000 // 20,
                                          ignore_eos=True, per_token=True), timeout=60)
        n = 0
        async for _ in gen:
            n += 1
            if n == 3:
                break
        await gen.aclose()

    async def idle():
        async with MeshClient(router.address) as c:
            fleet = await c.fleet()
        return all(n.load.in_flight == 0 and n.load.num_running == 0 for n in fleet.nodes)
    await wait_for(idle, timeout_s=5, what="the node to abort the cancelled request")


async def test_pick_of_unknown_model_is_not_found(lookaside_mesh):
    router, _ = lookaside_mesh
    async with MeshClient(router.address, lookaside=True) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(build_request("x", model="nope"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_multi_worker_router_every_worker_sees_the_fleet_and_accounts_exactly(tmp_path):
    port = free_port()
    router = Proc("router-mw", ["router", "--host", "127.0.0.1", "--port", str(port),
                                "--workers", "2", "--membership.freshness-s", "1.0"])
    cfg = tmp_path / "node.toml"
    cfg.write_text(NODE_TOML)
    nodes = []
    try:
        await asyncio.sleep(1.0)
        for name in ("wa", "wb"):
            nport = free_port()
            nodes.append((node_proc(name, nport, [f"127.0.0.1:{port}"], engine="sim",
                                    model="sim", config=cfg), f"127.0.0.1:{nport}"))
        for proc, addr in nodes:
            await wait_serving(addr, proc, timeout_s=60)
        seen: dict[str, set[str]] = {}

        async def both_workers_full():
            # New channels land on either worker (SO_REUSEPORT spreads connections).
            async with MeshClient(f"127.0.0.1:{port}") as c:
                fleet = await c.fleet()
            seen[fleet.router_id] = healthy_ids(fleet)
            return len(seen) == 2 and all(v == {"wa", "wb"} for v in seen.values())
        await wait_for(both_workers_full, timeout_s=30, what="both workers to see both nodes")
        worker_ids = set(seen)

        sent = 0
        for i in range(12):  # a fresh channel each time: spread over both workers
            async with MeshClient(f"127.0.0.1:{port}") as c:
                resp = await c.generate(build_request(f"mw {i}", model="sim", max_tokens=4,
                                                      ignore_eos=True), timeout=30)
                assert resp.usage.completion_tokens == 4
                sent += 1

        async def accounts_add_up():
            async with MeshClient(f"127.0.0.1:{port}") as c:
                fleet = await c.fleet()
            per_router: dict[str, int] = {}
            for n in fleet.nodes:
                for a in n.load.router_accounts:
                    per_router[a.router_id] = per_router.get(a.router_id, 0) + a.admitted_requests
            return per_router if (set(per_router) <= worker_ids
                                  and sum(per_router.values()) == sent) else None
        per_router = await wait_for(accounts_add_up, what="per-router accounts to add up")
        assert sum(per_router.values()) == 12
    finally:
        for proc, _ in nodes:
            proc.close()
        router.close()


async def test_spread_client_round_robins_over_every_worker():
    """SO_REUSEPORT hashes a connection to one worker: a plain client's calls all land on one
    worker; ``MeshClient.spread`` (GetFleet's worker_addresses + round_robin) reaches all."""
    port = free_port()
    router = Proc("router-spread", ["router", "--host", "127.0.0.1", "--port", str(port),
                                    "--workers", "3"])
    try:
        target = f"127.0.0.1:{port}"
        await wait_serving(target, router, timeout_s=30)
        async with MeshClient(target) as plain:
            fleet = await plain.fleet()
            assert len(fleet.worker_addresses) == 3
            assert len({(await plain.fleet()).router_id for _ in range(9)}) == 1
        async with await MeshClient.spread(target) as spread:
            assert spread.target.startswith("ipv4:")
            seen: set[str] = set()
            for _ in range(200):   # workers still starting are skipped until they serve
                seen.add((await spread.fleet()).router_id)
                if len(seen) == 3:
                    break
                await asyncio.sleep(0.05)
            assert len(seen) == 3, seen
        # A node (no Router service) or a single-process router: the target as given.
        single = RouterServer(RouterConfig(serving={"host": "127.0.0.1", "port": 0}))
        await single.start()
        try:
            async with await MeshClient.spread(single.address) as c:
                assert c.target == single.address
                assert not (await c.fleet()).worker_addresses
        finally:
            await single.stop(0.1)
    finally:
        router.close()
