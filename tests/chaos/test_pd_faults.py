"""Disaggregated prefill/decode under faults: a router and two real vLLM CPU node processes
(``--role prefill`` and ``--role decode``, NIXL between them). The prefill node is frozen
(SIGSTOP: its port and its KV side channel stay open, nothing moves) or killed (SIGKILL)
while requests are in their prefill leg or their KV transfer: every request completes, with
the tokens a single node gives, within its deadline (the router's leg deadline, then the
request served whole on the decode node).

Ordered: the freeze first (the node is resumed after), the kill last.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from gpumesh import metadata as md
from gpumesh.client import MeshClient, StreamResult, build_request
from gpumesh.v1 import inference_pb2 as pb
from tests.integration.pd import PdMesh, started_pd_mesh
from tests.integration.test_mesh_vllm import healthy

pytestmark = [pytest.mark.chaos, pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("nixl")

LEG_TIMEOUT_S = 3.0
DEADLINE_S = 60.0
PROMPT = "a prompt long enough to need its KV moved between nodes " * 12


@pytest.fixture(scope="module")
async def pd_mesh(tiny_model_dir, tmp_path_factory):
    async with started_pd_mesh(tiny_model_dir, tmp_path_factory.mktemp("pdchaos"),
                               leg_timeout_s=LEG_TIMEOUT_S) as m:
        yield m


def _request(i: int) -> pb.GenerateRequest:
    return build_request(f"{i}: {PROMPT}", model="tiny", max_tokens=16, temperature=0,
                         ignore_eos=True)


async def _one(target: str, req: pb.GenerateRequest) -> tuple[list[int], StreamResult, float]:
    result = StreamResult()
    ids: list[int] = []
    t0 = time.monotonic()
    async with MeshClient(target) as client:
        async for chunk in client.stream(req, timeout=DEADLINE_S, result=result):
            ids.extend(chunk.token_ids)
    return ids, result, time.monotonic() - t0


async def _burst(mesh: PdMesh, first: int, n: int, fault, delay_s: float
                 ) -> list[tuple[list[int], StreamResult, float] | BaseException]:
    """``n`` concurrent requests through the router, ``fault()`` ``delay_s`` after they
    started; each request's (tokens, result, seconds) or its exception."""
    tasks = [asyncio.create_task(_one(mesh.router_addr, _request(first + i)))
             for i in range(n)]
    await asyncio.sleep(delay_s)
    fault()
    return list(await asyncio.gather(*tasks, return_exceptions=True))


async def _expected(mesh: PdMesh, first: int, n: int) -> list[list[int]]:
    """The same requests served whole by the decode node."""
    return [(await _one(mesh.addrs["dec"], _request(first + i)))[0] for i in range(n)]


async def test_disaggregation_works_before_the_faults(pd_mesh):
    ids, result, _ = await _one(pd_mesh.router_addr, _request(0))
    assert len(ids) == 16 and result.trailing.get(md.PREFILL_NODE_ID) == "pre"


async def test_frozen_prefill_node_falls_back_within_the_deadline(pd_mesh):
    proc = pd_mesh.nodes["pre"]
    try:
        outcomes = await _burst(pd_mesh, 100, 4, lambda: proc.signal(signal.SIGSTOP),
                                0.3)
        # and requests that arrive while it is frozen (before the router sees it stale)
        later = await asyncio.gather(*(_one(pd_mesh.router_addr, _request(200 + i))
                                       for i in range(2)), return_exceptions=True)
    finally:
        proc.signal(signal.SIGCONT)
    errors = [o for o in [*outcomes, *later] if isinstance(o, BaseException)]
    assert not errors, errors
    expected = await _expected(pd_mesh, 100, 4) + await _expected(pd_mesh, 200, 2)
    got = [o[0] for o in [*outcomes, *later]]
    assert got == expected
    assert all(o[2] < DEADLINE_S for o in [*outcomes, *later])
    # the late ones could not have been disaggregated: served whole, by the decode node
    assert all(o[1].node_id == "dec" and not o[1].trailing.get(md.PREFILL_NODE_ID)
               for o in later)
    print(f"\nfrozen prefill node: {len(got)} requests, 0 lost, slowest "
          f"{max(o[2] for o in [*outcomes, *later]):.1f}s (leg deadline {LEG_TIMEOUT_S}s)")


async def test_killed_prefill_node_loses_no_request(pd_mesh):
    await pd_mesh.wait_fleet(lambda f: {"pre", "dec"} <= healthy(f), timeout_s=60)
    proc = pd_mesh.nodes["pre"]
    outcomes = await _burst(pd_mesh, 300, 6, lambda: proc.signal(signal.SIGKILL), 0.3)
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert not errors, errors
    assert [o[0] for o in outcomes] == await _expected(pd_mesh, 300, 6)
    whole = sum(1 for o in outcomes if not o[1].trailing.get(md.PREFILL_NODE_ID))
    print(f"\nkilled prefill node: {len(outcomes)} requests, 0 lost, {whole} served whole")
    # afterwards: served whole on the decode node
    ids, result, _ = await _one(pd_mesh.router_addr, _request(400))
    assert len(ids) == 16 and result.node_id == "dec"
