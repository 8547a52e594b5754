"""Hostile peers against a real router and a real simulated node, in each security mode
(tests/security/hostile.py): every attack ends with its exact status, and nothing the
router keeps changes (fleet, quarantine, accounts), and the victim's traffic still goes to
the victim."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from gpumesh.v1 import control_pb2 as cpb
from tests.integration.procs import free_port
from tests.security.hostile import (
    CREDS,
    MODES,
    assert_unchanged,
    expected,
    secured_mesh,
    state,
)
from tests.security.mesh import HostileNode, heartbeat, registration, restart, served_by

S = grpc.StatusCode


def garbage_registration(node_id: str) -> cpb.NodeMessage:
    return registration(node_id, f"127.0.0.1:{free_port()}",
                        [cpb.ServedModel(name="sim", capacity_weight=float("nan"))])


@pytest.fixture(scope="module", params=MODES)
async def secured(request, tmp_path_factory):
    async with secured_mesh(request.param, tmp_path_factory.mktemp(request.param)) as s:
        yield s


async def _attack(s, cred: str, messages: list[cpb.NodeMessage]) -> grpc.StatusCode:
    ch, md = s.attacker(cred)
    async with ch:
        evil = HostileNode(ch, md)
        for msg in messages:
            await evil.send(msg)
        while await evil.read() is not None:
            pass
        code = await evil.code()
        evil.close()
        return code


async def _victim_served(s, n: int = 6) -> None:
    async with s.client() as client:
        assert await served_by(client, n) == {"good": n}


@pytest.mark.parametrize("cred", CREDS)
async def test_garbage_registration_for_the_victims_id(secured, cred):
    """Attack 1: an out-of-range registration claiming the live node's id."""
    s = secured
    before = await state(s)
    assert await _attack(s, cred, [garbage_registration("good")]) == expected(s.mode, cred)
    assert_unchanged(before, await state(s))
    await _victim_served(s)


@pytest.mark.parametrize("cred", ["none", "bad"])
async def test_made_up_ids_leave_no_quarantine(secured, cred):
    """Attack 1: thirty made-up ids with garbage from a caller without a node credential."""
    s = secured
    before = await state(s)
    codes = await asyncio.gather(*(_attack(s, cred, [garbage_registration(f"ghost-{i}")])
                                   for i in range(30)))
    assert set(codes) == {expected(s.mode, cred)}
    assert_unchanged(before, await state(s))
    await _victim_served(s)


async def test_a_member_cannot_quarantine_another_id(secured):
    """With a certificate, a garbage registration for an id that is not the certificate's
    is refused before its content is read: no quarantine for that id. (Under the join
    token every token holder is a member that may claim any free id.)"""
    s = secured
    if s.mode == "token":
        pytest.skip("a join token holder may claim any id")
    before = await state(s)
    assert await _attack(s, "member", [garbage_registration("ghost")]) == S.PERMISSION_DENIED
    assert_unchanged(before, await state(s))


async def test_victim_restart_under_a_flood_of_garbage_for_its_id(secured):
    """Attack 1: the real node restarts (SIGTERM, same id and port) while a caller without
    a node credential keeps sending garbage registrations for its id; it rejoins at once."""
    from tests.integration.procs import node_proc

    s = secured
    proc, addr = s.mesh.nodes["good"]
    stop = asyncio.Event()
    codes: list[grpc.StatusCode] = []

    async def flood() -> None:
        while not stop.is_set():
            codes.append(await _attack(s, "bad", [garbage_registration("good")]))

    task = asyncio.create_task(flood())
    try:
        proc.close()
        await asyncio.sleep(0.5)
        s.mesh.nodes["good"] = (restart(proc), addr)
        t0 = time.monotonic()
        async with s.operator() as op:
            while True:
                fleet = await op.fleet(timeout=30)
                states = {n.node_id: n.state for n in fleet.nodes}
                if states.get("good") == cpb.NODE_STATE_HEALTHY:
                    break
                assert time.monotonic() - t0 < 60, states
                await asyncio.sleep(0.2)
        joined_s = time.monotonic() - t0
    finally:
        stop.set()
        await task
    assert codes and set(codes) == {expected(s.mode, "bad")}
    assert all(n.state != cpb.NODE_STATE_QUARANTINED for n in (await _fleet(s)).nodes)
    assert joined_s < 30, joined_s   # the sim node starts in a few seconds; no quarantine wait
    await _victim_served(s)


async def _fleet(s) -> cpb.GetFleetResponse:
    async with s.operator() as op:
        return await op.fleet(timeout=30)
