"""The disaggregated prefill/decode mesh shared by the tests that need one: a router
(in-process, real gRPC) and two real vLLM CPU node processes on the tiny model, one
``--role prefill`` (core 0), one ``--role decode`` (core 1), the KV cache moved between them
by vLLM's NIXL connector; and the warm-up every such mesh needs before a test measures it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from gpumesh import metadata as md
from gpumesh.client import MeshClient, StreamResult, build_request
from tests.integration.test_mesh_vllm import Mesh, healthy

PD_TOML = ('[engine]\nmax_model_len = 1024\nserved_name = "tiny"\nnum_gpu_blocks_override = 64\n'
           'enforce_eager = true\n[membership]\nheartbeat_busy_interval_s = 0.1\n'
           'heartbeat_idle_interval_s = 0.5\nreconnect_max_backoff_s = 0.5\n'
           '[serving]\ndrain_timeout_s = 10\nrole = "{role}"\n')


async def warm_up(router_addr: str, attempts: int = 8, in_a_row: int = 2) -> None:
    """Until ``in_a_row`` requests in a row through the router at ``router_addr`` are served
    disaggregated: an engine's first requests and the connectors' first transfers (NIXL's
    handshake between the two engines) take far longer than later ones, more than a leg's
    deadline on a busy machine; a test measures the steady state, not that first exchange."""
    req = build_request("warm up " * 40, model="tiny", max_tokens=2, temperature=0)
    done = 0
    for _ in range(attempts):
        result = StreamResult()
        try:
            async with MeshClient(router_addr) as client:
                async for _chunk in client.stream(req, timeout=60, result=result):
                    pass
        except grpc.aio.AioRpcError:
            done = 0
            continue
        done = done + 1 if result.trailing.get(md.PREFILL_NODE_ID) else 0
        if done == in_a_row:
            return
    raise AssertionError(f"no {in_a_row} requests in a row were served disaggregated in "
                         f"{attempts} tries")


async def direct_warm_up(node_addr: str, requests: int = 3) -> None:
    """A few whole requests of the warm-up's length straight to one node."""
    async with MeshClient(node_addr) as client:
        for i in range(requests):
            await client.generate(build_request(f"{i} warm up " * 40, model="tiny",
                                                max_tokens=2, temperature=0), timeout=120)


class PdMesh(Mesh):
    leg_timeout_s = 10.0   # the router's disagg_leg_timeout_s

    async def start_router(self) -> None:
        from gpumesh.router.app import RouterServer
        from gpumesh.router.config import RouterConfig

        # leases long enough for engines starting side by side on a busy machine
        self.router = RouterServer(RouterConfig(
            serving={"host": "127.0.0.1", "port": self.router_port, "shutdown_grace_s": 1.0},
            membership={"lease_ttl_s": 15.0, "freshness_s": 5.0, "heartbeat_interval_ms": 100},
            dispatch={"stall_s": 5.0, "disagg_leg_timeout_s": self.leg_timeout_s}))
        await self.router.start()

    async def start_pd_node(self, name: str, role: str, core: int, model_dir: Path,
                            tmp: Path) -> None:
        await self.start_node(name, "tiny", core, model_dir, tmp,
                              toml=PD_TOML.format(role=role), timeout_s=480)


@contextlib.asynccontextmanager
async def started_pd_mesh(model_dir: Path, tmp: Path,
                          leg_timeout_s: float = PdMesh.leg_timeout_s) -> AsyncIterator[PdMesh]:
    """A started, warmed-up mesh: prefill node "pre", decode node "dec" (module doc)."""
    m = PdMesh()
    m.leg_timeout_s = leg_timeout_s
    await m.start_router()
    try:
        await asyncio.gather(m.start_pd_node("pre", "prefill", 0, model_dir, tmp),
                             m.start_pd_node("dec", "decode", 1, model_dir, tmp))
        await m.wait_fleet(lambda f: {"pre", "dec"} <= healthy(f))
        # each engine's first prefills on a CPU run far slower than later ones (kernels are
        # prepared per shape), longer than a short leg deadline: served whole, directly,
        # before the router's legs are timed
        for name in ("pre", "dec"):
            await direct_warm_up(m.addrs[name])
        await warm_up(m.router_addr, attempts=16)
        yield m
    finally:
        await m.close()
