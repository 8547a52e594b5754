"""Engine profiles (gpumesh.profiles): the TOML round trip, validation naming the bad key,
the step and prefill model, and the simulator built from a profile."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from gpumesh.profiles import (
    EngineProfile,
    ProfileError,
    Sample,
    builtin_names,
    builtin_profile,
    dump_profile,
    dumps_profile,
    load_profile,
    loads_profile,
)

GOOD = EngineProfile(
    name="test-engine", platform="cpu", model="models/tiny", vllm_version="0.0",
    measured="2026-01-01T00:00:00Z", source='a "quoted" source\\ with a backslash',
    max_num_seqs=64, max_num_batched_tokens=512, max_model_len=2048,
    kv_capacity_tokens=40_000, kv_block_size=16, prefix_caching=True,
    a_ms=3.5, b_decode_ms=0.125, c_decode_ms=1e-4, b_prefill_ms=0.01,
    front_end_tokens_per_s=900.0, request_overhead_ms=1.25,
    samples=(Sample("decode", 3.6, batch=1, fit_ms=3.6251),
             Sample("prefill", 7.0, prompt_tokens=300, cached_tokens=256, fit_ms=6.1,
                    held_out=True)),
)


def test_round_trip_exact(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    dump_profile(GOOD, path)
    assert load_profile(path) == GOOD
    assert loads_profile(dumps_profile(GOOD)) == GOOD


@pytest.mark.parametrize("name", builtin_names())
def test_builtin_profiles_load_and_round_trip(name: str) -> None:
    p = builtin_profile(name)
    assert p.name == name
    assert loads_profile(dumps_profile(p)) == p
    for s in p.samples:  # the recorded fit is the profile's own prediction
        assert s.fit_ms == pytest.approx(p.predict(s), abs=1e-3), s


def _swap(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


BAD = [
    ("a_ms = 3.5", "a_ms = nan", "step.a_ms"),
    ("a_ms = 3.5", "a_ms = inf", "step.a_ms"),
    ("b_decode_ms = 0.125", "b_decode_ms = -0.1", "step.b_decode_ms"),
    ("b_prefill_ms = 0.01", 'b_prefill_ms = "fast"', "step.b_prefill_ms"),
    ("max_num_seqs = 64", "max_num_seqs = 0", "scheduler.max_num_seqs"),
    ("max_num_batched_tokens = 512", "max_num_batched_tokens = 1.5",
     "scheduler.max_num_batched_tokens"),
    ("capacity_tokens = 40000", "capacity_tokens = 8", "kv.capacity_tokens"),
    ("block_size = 16", "block_size = true", "kv.block_size"),
    ("prefix_caching = true", "prefix_caching = 1", "kv.prefix_caching"),
    ('platform = "cpu"', 'platform = "tpu"', "engine.platform"),
    ("tokens_per_s = 900.0", "tokens_per_s = -1.0", "front_end.tokens_per_s"),
    ("a_ms = 3.5", "a_ms = 3.5\nd_ms = 1.0", "step.d_ms"),
    ('format = "gpumesh.engine-profile/1"', 'format = "gpumesh.engine-profile/2"', "format"),
    ("[front_end]", "[frontend]\nx = 1\n[front_end]", "frontend"),
    ('kind = "decode"', 'kind = "warmup"', "samples[0].kind"),
    ("measured_ms = 7.0", "measured_ms = 0.0", "samples[1].measured_ms"),
    ("cached_tokens = 256", "cached_tokens = 301", "samples[1].cached_tokens"),
    ("batch = 1", "batch = 0", "samples[0].batch"),
    ("held_out = true", "held_out = true\nnotes = 1", "samples[1].notes"),
]


@pytest.mark.parametrize(("old", "new", "key"), BAD, ids=[b[2] for b in BAD])
def test_bad_profile_refused_naming_the_key(old: str, new: str, key: str) -> None:
    with pytest.raises(ProfileError) as e:
        loads_profile(_swap(dumps_profile(GOOD), old, new), "bad.toml")
    assert str(e.value).startswith(key), str(e.value)
    assert "bad.toml" in str(e.value)


def test_all_zero_step_model_and_missing_name_refused() -> None:
    zero = _swap(_swap(_swap(_swap(dumps_profile(GOOD), "a_ms = 3.5", "a_ms = 0.0"),
                             "b_decode_ms = 0.125", "b_decode_ms = 0.0"),
                       "c_decode_ms = 0.0001", "c_decode_ms = 0.0"),
                 "b_prefill_ms = 0.01", "b_prefill_ms = 0.0")
    with pytest.raises(ProfileError, match=r"^step\.a_ms"):
        loads_profile(zero)
    with pytest.raises(ProfileError, match=r"^engine\.name"):
        loads_profile(_swap(dumps_profile(GOOD), 'name = "test-engine"\n', ""))
    with pytest.raises(ProfileError, match="not valid TOML"):
        loads_profile("format = ")


def test_missing_file_and_unknown_builtin(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "none.toml")
    with pytest.raises(ProfileError, match="unknown built-in profile"):
        builtin_profile("no-such-engine")


def test_step_and_prefill_model() -> None:
    p = GOOD
    assert p.step_ms(0, 0, 0) == 3.5
    assert p.step_ms(10, 10, 100) == pytest.approx(3.5 + 1.25 + 1e-2 + 1.0)
    # 1300 uncached tokens in chunks of 512: two full chunks and one of 276
    full = p.step_ms(0, 0, 512)
    assert p.prefill_ms(1300) == pytest.approx(2 * full + p.step_ms(0, 0, 276))
    assert p.prefill_ms(1300, cached_tokens=1024) == pytest.approx(p.step_ms(0, 0, 276))
    # a fully cached prompt still computes its last token
    assert p.prefill_ms(256, cached_tokens=256) == pytest.approx(p.step_ms(0, 0, 1))
    assert p.ttft_ms(256) == pytest.approx(1.25 + p.prefill_ms(256))
    no_cache = dataclasses.replace(p, prefix_caching=False)
    assert no_cache.prefill_ms(1300, cached_tokens=1024) == p.prefill_ms(1300)
    with pytest.raises(ValueError):
        p.step_ms(4, 2, 0)
    with pytest.raises(ValueError):
        p.prefill_ms(10, cached_tokens=11)
    assert math.isfinite(p.predict(p.samples[1]))


def test_constructing_a_bad_profile_in_code_is_refused_too() -> None:
    with pytest.raises(ProfileError, match=r"^step\.a_ms"):
        dataclasses.replace(GOOD, a_ms=float("nan"))
    with pytest.raises(ProfileError, match=r"^samples\[0\]\.measured_ms"):
        dataclasses.replace(GOOD, samples=(Sample("decode", -1.0, batch=1),))
