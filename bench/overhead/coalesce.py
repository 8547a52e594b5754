"""CPU per engine output through the node's stream coalescing (``node.coalesce.coalesce``).

The node's process is the ceiling of a GPU node (docs/benchmarks-gpu.md, "Where the cores
go"), so its per-token work matters. This isolates gpumesh's share of it: ``--streams``
streams, an engine step every ``--step-ms`` that gives each stream one output (as vLLM's
per-request output queues are woken once per step), the default 20 ms / 64-token coalescing,
``--steps`` steps; CPU time of this process per engine output. ``--compare FILE`` runs another
implementation of ``coalesce`` (e.g. ``git show REV:node/coalesce.py > old.py``) in
alternating rounds (ABAB) and prints the ratio of medians.

  python -m gpumesh_bench.overhead.coalesce --compare /tmp/coalesce_old.py --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from gpumesh.node.streaming.budget import CoalescePolicy
from gpumesh.node.streaming.coalesce import coalesce
from gpumesh.node.engines.base import EngineOutput, Finish

Coalesce = Callable[..., AsyncIterator[EngineOutput]]


def load_impl(path: str) -> Coalesce:
    name = f"_coalesce_impl_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.coalesce  # type: ignore[no-any-return]


async def run_once(impl: Coalesce, streams: int, steps: int, step_s: float) -> tuple[float, int]:
    """(CPU seconds, messages sent) for ``streams`` x ``steps`` engine outputs."""
    queues: list[asyncio.Queue[EngineOutput]] = [asyncio.Queue() for _ in range(streams)]

    async def engine(q: asyncio.Queue[EngineOutput]) -> AsyncIterator[EngineOutput]:
        while True:
            out = await q.get()
            yield out
            if out.finish is not None:
                return

    msgs = 0

    async def consume(q: asyncio.Queue[EngineOutput]) -> None:
        nonlocal msgs
        async for _ in impl(engine(q), CoalescePolicy(0.02, 64)):
            msgs += 1

    tasks = [asyncio.create_task(consume(q)) for q in queues]
    c0 = time.process_time()
    for s in range(steps):
        fin = Finish.LENGTH if s == steps - 1 else None
        for q in queues:
            q.put_nowait(EngineOutput((s,), "x", fin))
        await asyncio.sleep(step_s)
    await asyncio.gather(*tasks)
    return time.process_time() - c0, msgs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpumesh_bench.overhead.coalesce",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", default="", help="a file with another coalesce() to compare")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--step-ms", type=float, default=5.0)
    a = p.parse_args(argv)
    impls: dict[str, Coalesce] = {"current": coalesce}
    if a.compare:
        impls["compare"] = load_impl(a.compare)
    res: dict[str, list[float]] = {k: [] for k in impls}
    names = list(impls)
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else list(reversed(names)):
            cpu, msgs = asyncio.run(run_once(impls[name], a.streams, a.steps, a.step_ms / 1000))
            us = 1e6 * cpu / (a.streams * a.steps)
            res[name].append(us)
            print(f"round {r} {name:8} {us:6.2f} us CPU per engine output, {msgs} messages",
                  flush=True)
    med: dict[str, Any] = {k: statistics.median(v) for k, v in res.items()}
    for k, v in med.items():
        print(f"{k}: median {v:.2f} us per engine output over {a.rounds} rounds")
    if a.compare:
        print(f"current / compare = {med['current'] / med['compare']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
