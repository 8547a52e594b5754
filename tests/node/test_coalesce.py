"""Coalescing contract: first output alone and at once, then merged by interval / token cap,
final flushed at once, a stalled engine never holds a token longer than one interval."""

import asyncio

from gpumesh.node.streaming.budget import MAX_FLUSH_INTERVAL_S, CoalescePolicy
from gpumesh.node.streaming.coalesce import coalesce
from gpumesh.node.engines.base import EngineOutput, Finish


async def _script(steps):
    """steps: (delay_s, EngineOutput)"""
    for delay, out in steps:
        await asyncio.sleep(delay)
        yield out


def _tok(i, text=None, finish=None):
    return EngineOutput((i,), text if text is not None else f"t{i} ", finish)


async def _collect(gen):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    got = []
    async for out in gen:
        got.append((loop.time() - t0, out))
    return got


async def test_first_token_alone_then_merged_and_final_at_once():
    steps = [(0.0, _tok(0))] + [(0.001, _tok(i)) for i in range(1, 20)] + [
        (0.001, _tok(20, finish=Finish.LENGTH))]
    got = await _collect(coalesce(_script(steps), CoalescePolicy(0.5, 1000)))
    assert got[0][1].token_ids == (0,)
    assert len(got) == 2  # first alone, then everything else with the finish
    assert got[-1][1].finish is Finish.LENGTH
    assert got[-1][1].token_ids == tuple(range(1, 21))
    assert "".join(o.text for _, o in got) == "".join(f"t{i} " for i in range(21))


async def test_token_cap_splits():
    steps = [(0.0, _tok(i)) for i in range(10)] + [(0.0, _tok(10, finish=Finish.STOP))]
    got = await _collect(coalesce(_script(steps), CoalescePolicy(10.0, 4)))
    assert [len(o.token_ids) for _, o in got] == [1, 4, 4, 2]


async def test_stalled_engine_flushes_within_one_interval():
    # token 1 arrives, then the engine stalls for 0.5 s: token 1 must go out after ~0.05 s.
    steps = [(0.0, _tok(0)), (0.01, _tok(1)), (0.5, _tok(2, finish=Finish.STOP))]
    got = await _collect(coalesce(_script(steps), CoalescePolicy(0.05, 100)))
    assert [o.token_ids for _, o in got] == [(0,), (1,), (2,)]
    assert got[1][0] < 0.3


async def test_per_token_passthrough_and_multibyte_text_joined_intact():
    parts = ["h", "é", "🙂", "漢字"]
    steps = [(0.0, _tok(i, text=t)) for i, t in enumerate(parts)]
    steps[-1] = (0.0, _tok(3, text="漢字", finish=Finish.STOP))
    per_token = await _collect(coalesce(_script(steps), CoalescePolicy(0.0, 1)))
    assert [o.text for _, o in per_token] == parts
    merged = await _collect(coalesce(_script(steps), CoalescePolicy(1.0, 100)))
    assert "".join(o.text for _, o in merged) == "hé🙂漢字"


async def test_closing_early_closes_the_engine_generator():
    closed = asyncio.Event()

    async def engine():
        try:
            i = 0
            while True:
                yield _tok(i)
                i += 1
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    gen = coalesce(engine(), CoalescePolicy(0.02, 100))
    async for _ in gen:
        break
    await gen.aclose()
    assert closed.is_set()


async def test_engine_error_mid_stream_delivers_the_tokens_before_it_then_raises():
    async def engine():
        yield _tok(0)
        await asyncio.sleep(0.005)
        yield _tok(1)
        yield _tok(2)
        raise RuntimeError("engine died")

    got = []
    try:
        async for out in coalesce(engine(), CoalescePolicy(0.5, 100)):
            got.append(out)
    except RuntimeError as e:
        assert "engine died" in str(e)
    else:
        raise AssertionError("the engine's error was swallowed")
    assert [o.token_ids for o in got] == [(0,), (1, 2)]


async def test_cancelling_the_consumer_cancels_the_engine_iteration():
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def engine():
        yield _tok(0)
        started.set()
        try:
            await asyncio.sleep(30)  # an engine step that never ends
            yield _tok(1)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def consume():
        async for _ in coalesce(engine(), CoalescePolicy(0.02, 100)):
            pass

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 1)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    assert cancelled.is_set()


def test_a_message_budget_widens_the_interval_with_the_streams_in_flight():
    fixed = CoalescePolicy(0.02, 64)
    budget = CoalescePolicy(0.02, 64, messages_per_s=2000)
    assert [fixed.interval(s) for s in (1, 128, 10_000)] == [0.02, 0.02, 0.02]
    # 40 streams x 50 messages/s = the budget: the base interval holds up to there
    assert [budget.interval(s) for s in (1, 40)] == [0.02, 0.02]
    assert budget.interval(128) == 128 / 2000       # 64 ms
    assert budget.interval(10_000) == MAX_FLUSH_INTERVAL_S
    # a base interval above the cap is kept
    assert CoalescePolicy(0.5, 64, messages_per_s=1).interval(10_000) == 0.5


async def test_the_budget_sends_fewer_messages_when_many_streams_are_in_flight():
    # An output every 5 ms for 0.4 s. Fixed 10 ms interval: ~40 messages. With a budget of 40
    # messages/s and 4 streams in flight the interval is 0.1 s: about 5. (A stalled loop only
    # merges more, so the bound cannot flake.)
    steps = [(0.0, _tok(0))] + [(0.005, _tok(i)) for i in range(1, 80)] + [
        (0.005, _tok(80, finish=Finish.STOP))]
    got = await _collect(coalesce(_script(steps), CoalescePolicy(0.01, 1000, messages_per_s=40),
                                  streams=lambda: 4))
    assert len(got) <= 8, [len(o.token_ids) for _, o in got]
    assert [t for _, o in got for t in o.token_ids] == list(range(81))
    assert got[0][1].token_ids == (0,)  # the first token still goes out alone, at once
