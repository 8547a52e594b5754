"""The simulated engine built from an engine profile: every built-in shape through
``from_profile`` equals ``for_shape``, and the simulator's steps are the profile's."""

from __future__ import annotations

import dataclasses

import pytest

from gpumesh.node.engines.sim import SimEngineConfig
from gpumesh.node.engines.sim.scheduler import SimScheduler
from gpumesh.profiles import builtin_names, builtin_profile

SHAPES = ("0.5b", "7b", "0.5b-h200", "7b-h200")


def test_the_simulator_shapes_are_built_in_profiles() -> None:
    assert set(SHAPES) <= set(builtin_names())


@pytest.mark.parametrize("name", builtin_names())
def test_from_profile_matches_for_shape(name: str) -> None:
    profile = builtin_profile(name)
    assert SimEngineConfig.from_profile(profile) == SimEngineConfig.for_shape(name)
    assert SimEngineConfig.for_shape(name.upper(), speed=2.0) == dataclasses.replace(
        SimEngineConfig.from_profile(profile), speed=2.0)


@pytest.mark.parametrize("name", builtin_names())
def test_simulated_step_is_the_profiles_step(name: str) -> None:
    profile = builtin_profile(name)
    s = SimScheduler(SimEngineConfig.from_profile(profile))
    for decode, prefill in ((1, 0), (64, 0), (512, 0), (0, 2048), (32, 480)):
        assert s.step_time_s(decode, prefill) * 1000 == pytest.approx(
            profile.step_ms(decode, decode, prefill))


def test_the_shapes_keep_their_calibrated_values() -> None:
    """The shapes' numbers before they became profiles (the benchmarks recorded with them
    keep their meaning)."""
    half = SimEngineConfig.for_shape("0.5b")
    assert (half.model_name, half.step_a_ms, half.step_b_decode_ms, half.step_b_prefill_ms,
            half.kv_capacity_tokens, half.max_num_seqs, half.max_num_batched_tokens,
            half.max_context_length) == ("sim-qwen2.5-0.5b", 2.29, 0.0242, 0.00612,
                                         10_200_000, 1024, 16384, 8704)
    assert half == SimEngineConfig()
    seven = SimEngineConfig.for_shape("7b-h200")
    assert (seven.model_name, seven.step_a_ms, seven.step_b_decode_ms, seven.step_c_decode_ms,
            seven.step_b_prefill_ms, seven.kv_capacity_tokens) == (
        "sim-qwen2.5-7b", 4.799, 0.01107, 3.636e-5, 0.02367, 1_910_000)


def test_unknown_shape_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown shape"):
        SimEngineConfig.for_shape("13b")


def test_attention_terms_of_a_profile_drive_the_simulated_steps() -> None:
    """A profile with the context terms: the simulated prefill of a lone request (in chunks)
    and the decode steps after it cost what the profile's model says."""
    import random

    from gpumesh.node.engines.sim.request import SimRequest

    profile = dataclasses.replace(builtin_profile("0.5b-h200"), max_num_batched_tokens=512,
                                  b_decode_context_ms=2e-4, c_prefill_ms=3e-6)
    s = SimScheduler(SimEngineConfig.from_profile(profile, time_scale=0.0))
    s.add(SimRequest("a", 1200, 3, random.Random(0), 0.0, ()))
    s.add(SimRequest("b", 100, 3, random.Random(1), 0.0, ()))
    prefill_s = 0.0
    steps = []
    while not s.idle:
        step = s.begin_step()
        assert step is not None
        steps.append(step)
        s.end_step(step, 0.0)
    # "a" prefills in chunks of 512, 512, 176 (pairs over what came before); "b" joins the
    # third step with its whole prompt
    expected = [profile.step_ms(0, 0, 512, prefill_pairs=512 * 513 // 2),
                profile.step_ms(0, 0, 512, prefill_pairs=512 * 512 + 512 * 513 // 2),
                profile.step_ms(0, 0, 276, prefill_pairs=176 * 1024 + 176 * 177 // 2
                                + 100 * 101 // 2)]
    # then both decode: context = computed + 1 for each (1200 + 1, 100 + 1, then + 1 each)
    expected += [profile.step_ms(2, 2, 0, decode_context=1201 + 101),
                 profile.step_ms(2, 2, 0, decode_context=1202 + 102)]
    assert [st.duration_s * 1000 for st in steps] == pytest.approx(expected)
    prefill_s = sum(st.duration_s for st in steps[:2]) * 1000
    assert prefill_s == pytest.approx(sum(profile.step_ms(0, 0, n, prefill_pairs=p)
                                          for n, p in profile.prefill_chunks(1200)[:2]))
