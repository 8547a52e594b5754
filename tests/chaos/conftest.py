"""Chaos tests: a real mesh (routers and simulated nodes as processes on loopback) under a
closed-loop load while something breaks. Each case prints its tally (sent / succeeded /
migrated / retried / failed by code / lost) — the source of the figures in
docs/reliability.md — and asserts lost = 0 where the design promises it."""

from __future__ import annotations

import pytest

from gpumesh_bench.reliability.faultmesh import FaultMesh, MeshSpec


@pytest.fixture
async def make_mesh():
    meshes: list[FaultMesh] = []

    async def make(**kw) -> FaultMesh:  # type: ignore[no-untyped-def]
        mesh = FaultMesh(MeshSpec(**kw))
        meshes.append(mesh)
        await mesh.start()
        return mesh

    yield make
    for m in meshes:
        m.stop()
