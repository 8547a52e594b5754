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
