"""SimEngine: determinism, timing model, KV pressure, abort, stop strings, load figures."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from gpumesh.node.engines.base import (
    Engine,
    EngineOutput,
    EngineRequest,
    Finish,
    PromptTooLong,
    Sampling,
)
from gpumesh.node.engines.sim import SimEngine, SimEngineConfig

FAST = SimEngineConfig(time_scale=0.0)  # steps back to back: simulated time only


async def started(cfg: SimEngineConfig = FAST) -> SimEngine:
    eng = SimEngine(cfg)
    await eng.start()
    return eng


def req(rid: str, n_prompt: int = 8, **sampling: object) -> EngineRequest:
    return EngineRequest(rid, tuple(range(1, n_prompt + 1)), Sampling(**sampling))  # type: ignore[arg-type]


async def collect(eng: SimEngine, r: EngineRequest) -> list[EngineOutput]:
    return [o async for o in eng.generate(r)]


def joined(outs: list[EngineOutput]) -> tuple[list[int], str]:
    return [t for o in outs for t in o.token_ids], "".join(o.text for o in outs)


async def test_is_an_engine_and_labelled() -> None:
    eng = await started()
    try:
        assert isinstance(eng, Engine)
        assert eng.kind == "sim"
        assert eng.model.name == "sim-qwen2.5-0.5b"
    finally:
        await eng.shutdown()


async def test_deterministic_given_seed() -> None:
    a, b = await started(), await started()
    c = await started(dataclasses.replace(FAST, seed=1))
    try:
        ra = joined(await collect(a, req("r1", max_tokens=40)))
        rb = joined(await collect(b, req("r1", max_tokens=40)))
        rc = joined(await collect(c, req("r1", max_tokens=40)))
        r2 = joined(await collect(a, req("r2", max_tokens=40)))
        assert ra == rb and len(ra[0]) == 40
        assert ra != rc and ra != r2
        # an explicit sampling seed wins over engine seed and request id
        s1 = joined(await collect(a, req("x", max_tokens=20, seed=7)))
        s2 = joined(await collect(c, req("y", max_tokens=20, seed=7)))
        assert s1 == s2
        # greedy: same prompt, same output
        g1 = joined(await collect(a, req("g1", max_tokens=20, temperature=0.0)))
        g2 = joined(await collect(c, req("g2", max_tokens=20, temperature=0.0)))
        assert g1 == g2
    finally:
        for e in (a, b, c):
            await e.shutdown()


async def test_text_is_utf8_and_multibyte_occurs() -> None:
    eng = await started()
    try:
        outs = await collect(eng, req("u", max_tokens=400))
        text = joined(outs)[1]
        assert any(ord(ch) > 127 for ch in text)
        text.encode("utf-8")  # never a lone surrogate or split character
        assert outs[-1].finish is Finish.LENGTH and all(o.finish is None for o in outs[:-1])
    finally:
        await eng.shutdown()


async def test_step_time_model_and_speed() -> None:
    cfg = SimEngineConfig(step_a_ms=20.0, step_b_decode_ms=0.0, step_b_prefill_ms=0.0)
    slow, fast = SimEngine(cfg), SimEngine(dataclasses.replace(cfg, speed=2.0))
    assert fast.step_time_s(10, 100) == pytest.approx(slow.step_time_s(10, 100) / 2)
    base = SimEngine()
    assert base.step_time_s(128, 0) * 1000 == pytest.approx(2.29 + 0.0242 * 128)
    seven = SimEngine(SimEngineConfig.for_shape("7b"))
    assert seven.step_time_s(120, 0) * 1000 == pytest.approx(4.74 + 0.0109 * 120)  # ~6.05 ms
    # The front-end ceiling: 120 tokens at 17,500 tok/s take 6.86 ms whatever the GPU does;
    # small batches stay GPU-bound, and speed (a GPU factor) does not lift the ceiling.
    capped = SimEngineConfig(front_end_tokens_per_s=17_500.0)
    assert SimEngine(capped).step_time_s(120, 0) == pytest.approx(120 / 17_500)
    assert SimEngine(dataclasses.replace(capped, speed=4.0)).step_time_s(120, 0) == \
        pytest.approx(120 / 17_500)
    assert SimEngine(capped).step_time_s(1, 0) == pytest.approx(base.step_time_s(1, 0))
    with pytest.raises(ValueError, match="front_end_tokens_per_s"):
        SimEngineConfig(front_end_tokens_per_s=-1.0)
    walls = []
    for eng in (slow, fast):
        await eng.start()
        t = time.perf_counter()
        outs = await collect(eng, req("t", max_tokens=6))
        walls.append(time.perf_counter() - t)
        assert len(joined(outs)[0]) == 6
        assert eng.stats.steps == 6  # one prefill step + five decode steps
        await eng.shutdown()
    assert slow.stats.busy_s == pytest.approx(0.120)
    assert fast.stats.busy_s == pytest.approx(0.060)
    assert walls[0] >= 0.115 and walls[1] >= 0.055
    assert walls[1] < walls[0] * 0.85


async def test_time_scale_slows_wall_clock() -> None:
    cfg = SimEngineConfig(step_a_ms=5.0, step_b_decode_ms=0.0, step_b_prefill_ms=0.0, time_scale=10.0)
    eng = await started(cfg)
    try:
        t = time.perf_counter()
        await collect(eng, req("t", max_tokens=3))
        assert time.perf_counter() - t >= 0.145  # 3 steps x 5 ms x 10
        assert eng.stats.busy_s == pytest.approx(0.015)
    finally:
        await eng.shutdown()


async def test_chunked_prefill_respects_budget() -> None:
    eng = await started(dataclasses.replace(FAST, max_num_batched_tokens=100))
    try:
        await collect(eng, req("p", n_prompt=450, max_tokens=2))
        # 450 prompt tokens in chunks of 100 -> 5 steps, then one decode step
        assert eng.stats.steps == 6
        assert eng.stats.prefill_tokens == 450
    finally:
        await eng.shutdown()


KV_TINY = SimEngineConfig(
    kv_capacity_tokens=64, kv_block_size=16, max_context_length=64,
    step_a_ms=30.0, step_b_decode_ms=0.0, step_b_prefill_ms=0.0,
)


async def test_kv_full_requests_wait() -> None:
    eng = await started(KV_TINY)
    try:
        tasks = [asyncio.create_task(collect(eng, req(f"w{i}", n_prompt=40, max_tokens=3))) for i in range(3)]
        await asyncio.sleep(0.01)  # the first step is scheduled
        load = eng.load()
        assert (load.num_running, load.num_waiting) == (1, 2)
        assert load.kv_cache_usage == pytest.approx(0.75)  # 3 of 4 blocks
        results = await asyncio.gather(*tasks)
        assert all(r[-1].finish is Finish.LENGTH and len(joined(r)[0]) == 3 for r in results)
        assert eng.stats.preemptions == 0
        assert eng.free_kv_blocks == 4
    finally:
        await eng.shutdown()


async def test_preemption_when_decode_runs_out_of_kv() -> None:
    cfg = dataclasses.replace(KV_TINY, time_scale=0.0)
    eng = await started(cfg)
    ref = await started(dataclasses.replace(cfg, kv_capacity_tokens=1024))
    try:
        # two 30-token prompts fit (2 + 2 blocks) but cannot both grow to 50 tokens
        rs = [req("a", n_prompt=30, max_tokens=20), req("b", n_prompt=30, max_tokens=20)]
        got = await asyncio.gather(*(collect(eng, r) for r in rs))
        want = await asyncio.gather(*(collect(ref, r) for r in rs))
        assert eng.stats.preemptions >= 1 and ref.stats.preemptions == 0
        # recompute preemption keeps generated tokens: outputs are unchanged
        assert [joined(g) for g in got] == [joined(w) for w in want]
        assert eng.stats.prefill_tokens > ref.stats.prefill_tokens  # the recompute
        assert eng.free_kv_blocks == 4
    finally:
        await eng.shutdown()
        await ref.shutdown()


async def test_abort_and_cancel_free_kv() -> None:
    eng = await started(dataclasses.replace(KV_TINY, step_a_ms=5.0))
    try:
        outs: list[EngineOutput] = []

        async def consume(rid: str) -> None:
            async for o in eng.generate(req(rid, n_prompt=20, max_tokens=40)):
                outs.append(o)

        t = asyncio.create_task(consume("ab"))
        while len(outs) < 2:
            await asyncio.sleep(0.005)
        assert eng.free_kv_blocks < 4
        await eng.abort("ab")
        assert eng.free_kv_blocks == 4  # immediately
        await t
        assert outs[-1].finish is Finish.ABORT

        outs.clear()
        t = asyncio.create_task(consume("cx"))
        while len(outs) < 2:
            await asyncio.sleep(0.005)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert eng.free_kv_blocks == 4
        assert eng.load().num_running == 0
        assert eng.stats.aborted == 2
        await eng.abort("unknown")  # no-op
    finally:
        await eng.shutdown()


async def test_stop_strings() -> None:
    eng = await started()
    try:
        full_ids, full = joined(await collect(eng, req("s", max_tokens=60)))
        stop = full[100:106]
        cut = full.index(stop)
        outs = await collect(eng, req("s", max_tokens=60, stop=("zzzz-never", stop)))
        ids, text = joined(outs)
        assert outs[-1].finish is Finish.STOP
        assert text == full[:cut]
        assert ids == full_ids[: len(ids)] and len(ids) < 60
        assert all(stop not in o.text for o in outs)
        # a stop string that never appears changes nothing
        outs = await collect(eng, req("s", max_tokens=60, stop=("zzzz-never",)))
        assert joined(outs) == (full_ids, full) and outs[-1].finish is Finish.LENGTH
    finally:
        await eng.shutdown()


async def test_eos_probability() -> None:
    eng = await started(dataclasses.replace(FAST, eos_probability=0.2))
    try:
        lens = [len(joined(await collect(eng, req(f"e{i}", max_tokens=200)))[0]) for i in range(10)]
        assert max(lens) < 200
        outs = await collect(eng, req("e0", max_tokens=200, ignore_eos=True))
        assert len(joined(outs)[0]) == 200 and outs[-1].finish is Finish.LENGTH
    finally:
        await eng.shutdown()


async def test_validation_errors() -> None:
    eng = await started(dataclasses.replace(FAST, max_context_length=100))
    try:
        with pytest.raises(PromptTooLong):
            await collect(eng, req("long", n_prompt=100))
        outs = await collect(eng, req("clip", n_prompt=90, max_tokens=50))
        assert len(joined(outs)[0]) == 10 and outs[-1].finish is Finish.LENGTH
    finally:
        await eng.shutdown()
    with pytest.raises(ValueError):
        SimEngineConfig(kv_capacity_tokens=100, max_context_length=200)


async def test_tokenizer_and_chat() -> None:
    eng = SimEngine(FAST)
    text = "The quick brown fox jumps over the lazy dog, extraordinarily unexpectedly. " * 20
    ids = eng.tokenize(text)
    assert ids == eng.tokenize(text)
    assert 3.0 <= len(text) / len(ids) <= 5.0
    assert len(eng.tokenize(" the" * 50)) == 50
    chat = eng.render_chat([("system", "be brief"), ("user", "hi there")])
    assert len(chat) > 4 and chat == eng.render_chat([("system", "be brief"), ("user", "hi there")])


async def test_load_figures_and_idle() -> None:
    cfg = SimEngineConfig(step_a_ms=2.0, step_b_decode_ms=0.0, step_b_prefill_ms=0.0)
    eng = await started(cfg)
    try:
        seen = []

        async def watch() -> None:
            while True:
                seen.append(eng.load())
                await asyncio.sleep(0.01)

        w = asyncio.create_task(watch())
        await asyncio.gather(*(collect(eng, req(f"l{i}", n_prompt=64, max_tokens=50)) for i in range(8)))
        w.cancel()
        busy = [ld for ld in seen if ld.num_running]
        assert busy and max(ld.num_running for ld in busy) == 8
        assert all(0.0 < ld.kv_cache_usage <= 1.0 for ld in busy)
        final = eng.load()
        assert (final.num_running, final.num_waiting, final.kv_cache_usage) == (0, 0, 0.0)
        # 400 tokens over a wall-clock window of >= 1 s
        assert 50 < final.generation_tokens_per_s <= 400
        assert final.prompt_tokens_per_s > 0 and final.prefix_cache_hit_rate == 0.0
        steps = eng.stats.steps
        await asyncio.sleep(0.05)
        assert eng.stats.steps == steps  # idle: no stepping
    finally:
        await eng.shutdown()


async def test_200_concurrent_requests_finish() -> None:
    eng = await started(SimEngineConfig(time_scale=0.1, max_num_seqs=128))
    try:
        rs = [req(f"c{i}", n_prompt=16 + i, max_tokens=10 + i % 30) for i in range(200)]
        results = await asyncio.gather(*(collect(eng, r) for r in rs))
        for r, outs in zip(rs, results):
            assert outs[-1].finish is Finish.LENGTH
            assert len(joined(outs)[0]) == r.sampling.max_tokens
        assert eng.stats.finished == 200
        assert eng.load().num_running == 0 and eng.free_kv_blocks == 10_200_000 // 16
    finally:
        await eng.shutdown()


async def test_shutdown_aborts_in_flight() -> None:
    eng = await started(SimEngineConfig(step_a_ms=5.0))
    t = asyncio.create_task(collect(eng, req("z", max_tokens=1000)))
    await asyncio.sleep(0.03)
    await eng.shutdown()
    outs = await t
    assert outs[-1].finish is Finish.ABORT


async def test_slow_consumer_still_gets_every_token_and_the_finish():
    """Regression: a consumer suspended at the yield while the request finishes must still
    receive the last delta (it was dropped when finish was re-read after the yield)."""
    import asyncio as _asyncio

    from gpumesh.node.engines.base import EngineRequest, Sampling
    from gpumesh.node.engines.sim import SimEngine, SimEngineConfig

    eng = SimEngine(SimEngineConfig(model_name="m", time_scale=0))
    await eng.start()
    try:
        async def one(i):
            outs = []
            async for o in eng.generate(EngineRequest(f"s{i}", (1, 2, 3),
                                                      Sampling(max_tokens=5, ignore_eos=True))):
                outs.append(o)
                await _asyncio.sleep(0.002)  # slower than the engine's steps
            return outs

        results = await _asyncio.gather(*(one(i) for i in range(64)))
        for outs in results:
            assert sum(len(o.token_ids) for o in outs) == 5
            assert outs[-1].finish is not None
    finally:
        await eng.shutdown()


async def test_load_reports_prefill_capacity_from_the_step_model() -> None:
    # A full-budget prefill step: 16384 tokens in 2.29 + 0.00612 * 16384 ms (0.5B defaults),
    # per wall-clock second (time_scale divides it), per simulated second at time_scale 0.
    step_s = (2.29 + 0.00612 * 16384) / 1000
    assert SimEngine(FAST).load().prefill_capacity_tokens_per_s == pytest.approx(16384 / step_s)
    slowed = SimEngine(SimEngineConfig(time_scale=10.0))
    assert slowed.load().prefill_capacity_tokens_per_s == pytest.approx(16384 / step_s / 10)
    fast = SimEngine(SimEngineConfig(time_scale=10.0, speed=2.0))
    assert fast.load().prefill_capacity_tokens_per_s == pytest.approx(2 * 16384 / step_s / 10)
    small = SimEngine(dataclasses.replace(FAST, max_num_batched_tokens=100, step_a_ms=1.0,
                                          step_b_prefill_ms=0.01))
    assert small.load().prefill_capacity_tokens_per_s == pytest.approx(100 / 0.002)
    # Capacity, not throughput: it does not move with what arrived (the observed rate does).
    eng = await started(SimEngineConfig(time_scale=1.0))
    try:
        before = eng.load().prefill_capacity_tokens_per_s
        await collect(eng, req("c", n_prompt=32, max_tokens=2))
        after = eng.load()
        assert after.prefill_capacity_tokens_per_s == before
        assert 0 < after.prompt_tokens_per_s < before / 100
    finally:
        await eng.shutdown()


async def test_load_reports_the_decode_step_in_wall_clock_seconds() -> None:
    # 5 ms simulated steps slowed 4x: 20 ms a step on the wall clock, whatever the batch.
    cfg = SimEngineConfig(step_a_ms=5.0, step_b_decode_ms=0.0, step_b_prefill_ms=0.0,
                          time_scale=4.0)
    eng = await started(cfg)
    try:
        assert eng.load().decode_step_s == 0.0            # no step yet
        await asyncio.gather(*(collect(eng, req(f"r{i}", max_tokens=10, ignore_eos=True))
                               for i in range(3)))
        assert eng.load().decode_step_s == pytest.approx(0.020)
        assert eng.load().decode_step_s == pytest.approx(0.020)   # kept while idle
    finally:
        await eng.shutdown()


async def test_load_reports_the_mean_output_of_finished_requests() -> None:
    eng = await started(SimEngineConfig(step_a_ms=1.0, step_b_decode_ms=0.0,
                                        step_b_prefill_ms=0.0))
    try:
        assert eng.load().output_tokens_mean == 0.0       # none finished yet
        await asyncio.gather(*(collect(eng, req(f"r{i}", max_tokens=n, ignore_eos=True))
                               for i, n in enumerate((4, 8, 12))))
        assert eng.load().output_tokens_mean == pytest.approx(8.0)
    finally:
        await eng.shutdown()
