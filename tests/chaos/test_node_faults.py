"""Nodes that die (SIGKILL of their own pid), hang (SIGSTOP: TCP open, nothing moves) or run
10x slower, under load: every request completes, through retry or mid-stream continuation."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from gpumesh_bench.reliability.faultmesh import InFlight, Tally, closed_loop, lookaside_loop
from tests.chaos.orphans import descendants, wait_gone

pytestmark = [pytest.mark.chaos]

# A long prompt (~900 tokens) on nodes whose prefill is slowed (~1 s per prompt): a fault
# catches most requests before their first token.
LONG_PROMPT = "one more word " * 300
SLOW_PREFILL = {"tell me a story about a mesh": 0.0, LONG_PROMPT: 0.05}


async def _run_with_fault(mesh, fault, *, concurrency=12, before_s=1.5, after_s=3.0,
                          prompt="tell me a story about a mesh"):
    """Load for ``before_s``, ``fault()`` (returns a label), load for ``after_s``; the
    tally and what was in flight at the fault (with output, without)."""
    tally, stop, inflight = Tally(), asyncio.Event(), InFlight()
    load = asyncio.create_task(closed_loop(mesh.router_addresses, tally, stop,
                                           concurrency=concurrency, prompt=prompt,
                                           inflight=inflight))
    await asyncio.sleep(before_s)
    at_fault = inflight.snapshot()
    t_fault = time.monotonic()
    await fault()
    await asyncio.sleep(after_s)
    stop.set()
    await asyncio.wait_for(load, 60)
    return tally, at_fault, t_fault


@pytest.mark.parametrize("prompt", ["tell me a story about a mesh", LONG_PROMPT],
                         ids=["mid-stream", "before-first-token"])
async def test_node_sigkill_under_load_loses_nothing(make_mesh, prompt):
    mesh = await make_mesh(nodes=3, prefill_ms_per_token=SLOW_PREFILL[prompt])
    victim = mesh.nodes[0]
    tree = descendants(victim.pid) | {victim.pid}

    async def kill():
        mesh.signal_node(0, signal.SIGKILL)

    tally, (mid, before), _ = await _run_with_fault(mesh, kill, prompt=prompt)
    print(f"\n{tally.line('node SIGKILL')} in flight at the kill: {mid} streaming, "
          f"{before} before their first token")
    left, _ = wait_gone(tree, 10)
    assert not left, "the killed node left processes behind"
    assert tally.lost == 0 and tally.incomplete == 0
    assert tally.migrated + tally.retried > 0


@pytest.mark.parametrize("prompt", ["tell me a story about a mesh", LONG_PROMPT],
                         ids=["mid-stream", "before-first-token"])
async def test_node_sigstop_under_load_loses_nothing(make_mesh, prompt):
    mesh = await make_mesh(nodes=3, prefill_ms_per_token=SLOW_PREFILL[prompt])

    async def freeze():
        mesh.signal_node(0, signal.SIGSTOP)

    try:
        tally, (mid, before), _ = await _run_with_fault(mesh, freeze, prompt=prompt)
    finally:
        mesh.signal_node(0, signal.SIGCONT)
    print(f"\n{tally.line('node SIGSTOP')} in flight at the stop: {mid} streaming, "
          f"{before} before their first token")
    assert tally.lost == 0 and tally.incomplete == 0
    assert tally.migrated + tally.retried > 0


async def test_hung_node_unroutable_within_two_heartbeats(make_mesh):
    """A frozen node is STALE (no new work) within 2 heartbeat intervals (0.5 s) + a sweep."""
    mesh = await make_mesh(nodes=2)
    mesh.signal_node(0, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        while True:
            views = {v.node_id: v for v in await mesh.fleet()}
            if views["n0"].state != 1:   # NODE_STATE_HEALTHY
                break
            await asyncio.sleep(0.02)
        took = time.monotonic() - t0
    finally:
        mesh.signal_node(0, signal.SIGCONT)
    print(f"\nhung node unroutable after {took:.3f}s")
    assert took < 5.0   # the target (0.5 s) is measured, not asserted: busy machines


async def test_node_slowed_10x_loses_nothing(make_mesh):
    mesh = await make_mesh(nodes=3, node_speed=(0.1, 1.0, 1.0))

    async def nothing():
        return None

    tally, _, _ = await _run_with_fault(mesh, nothing, before_s=1.0, after_s=5.0)
    print(f"\n{tally.line('one node 10x slower')}")
    assert tally.lost == 0 and tally.incomplete == 0


async def test_node_sigkill_lookaside_loses_nothing(make_mesh):
    """Lookaside clients (Pick, then the node directly) continue a stream whose node died on
    another node themselves."""
    mesh = await make_mesh(nodes=3, ticket_secret="chaos-secret")
    tally, stop = Tally(), asyncio.Event()
    load = asyncio.create_task(lookaside_loop(mesh.router_addresses[0], tally, stop,
                                              concurrency=12))
    await asyncio.sleep(1.5)
    mesh.signal_node(0, signal.SIGKILL)
    await asyncio.sleep(3.0)
    stop.set()
    await asyncio.wait_for(load, 60)
    print(f"\n{tally.line('node SIGKILL, lookaside clients')}")
    assert tally.lost == 0 and tally.incomplete == 0
    assert tally.migrated + tally.retried > 0
