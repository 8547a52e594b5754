"""The simulated scheduler always makes progress on a small KV cache with the prefix cache on:
multi-turn conversations (shared, growing prefixes) at saturation finish within a bounded
number of steps, and a waiting request never holds KV blocks."""

from __future__ import annotations

import random

import pytest

from gpumesh.kvblocks import block_hashes
from gpumesh.node.engines.sim import SimEngineConfig
from gpumesh.node.engines.sim.request import SimRequest
from gpumesh.node.engines.sim.scheduler import SimScheduler

# a node like the small ones of the simulator's hetero-kv fleet: the KV holds one full context
SMALL = SimEngineConfig(time_scale=0.0, kv_capacity_tokens=4096, max_context_length=4096,
                        max_num_seqs=32, max_num_batched_tokens=2048)


def _conversations(sched: SimScheduler, seed: int, sessions: int, outstanding: int,
                   total: int, max_steps: int) -> int:
    """Closed loop: ``outstanding`` requests in flight, each a session's next turn (its whole
    history as the prompt, so turns share their prefix); returns the steps ``total``
    completions took. Fails when a step schedules nothing while requests wait, when a
    waiting request holds KV blocks, or after ``max_steps`` steps."""
    rng = random.Random(seed)
    system = [rng.randrange(32000) for _ in range(200)]   # shared by every session
    history = {s: list(system) for s in range(sessions)}
    busy: dict[str, int] = {}
    cfg = sched.config
    sent = done = steps = 0

    def send() -> None:
        nonlocal sent
        s = rng.choice([x for x in history if x not in busy.values()])
        h = history[s]
        h += [rng.randrange(32000) for _ in range(rng.randint(20, 400))]
        if len(h) > cfg.max_context_length - 600:        # conversation too long: a new one
            del h[len(system):]
            h += [rng.randrange(32000) for _ in range(rng.randint(20, 400))]
        out = min(rng.randint(50, 500), cfg.max_context_length - len(h))
        req = SimRequest(str(sent), len(h), out, random.Random(sent), 0.0, (),
                         tuple(block_hashes(h, cfg.kv_block_size)))
        busy[req.id] = s
        sched.add(req)
        sent += 1

    for _ in range(outstanding):
        send()
    while done < total:
        step = sched.begin_step()
        assert step is not None, f"no step with {len(sched._waiting)} waiting (done {done})"
        steps += 1
        assert steps <= max_steps, f"{done} of {total} done after {steps} steps"
        _, finished = sched.end_step(step, steps * step.duration_s)
        assert all(r.blocks == 0 and not r.cached for r in sched._waiting)
        for req in finished:
            s = busy.pop(req.id)
            history[s] += [rng.randrange(32000) for _ in range(len(req.out))]
            done += 1
            if sent < total + outstanding:
                send()
    return steps


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_small_kv_prefix_cache_conversations_finish(seed: int) -> None:
    sched = SimScheduler(SMALL)
    steps = _conversations(sched, seed, sessions=60, outstanding=48, total=300, max_steps=60_000)
    assert sched.stats.finished == 300 and sched.stats.preemptions > 0   # KV was the limit
    assert sched.free_kv_blocks <= 4096 // 16 and steps > 0


def test_request_that_cannot_fit_alone_is_rejected() -> None:
    sched = SimScheduler(SMALL)
    with pytest.raises(ValueError, match="exceed the KV cache"):
        sched.add(SimRequest("big", 4000, 200, random.Random(0), 0.0, ()))
    assert sched.idle
