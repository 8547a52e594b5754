"""Workloads: determinism, distributions, arrivals, prompt synthesis, traces."""

from __future__ import annotations

import itertools
import statistics

import pytest

from gpumesh_bench.workload import (
    LengthDist,
    WorkloadSpec,
    iter_requests,
    load_trace,
    prompt_text,
    save_trace,
    synth_prompt,
)
from gpumesh.node.engines.sim import SimEngine


def take(spec: WorkloadSpec, n: int):
    return list(itertools.islice(iter_requests(spec), n))


def test_same_seed_same_stream_other_seed_differs() -> None:
    spec = WorkloadSpec(LengthDist.parse("lognormal:256:0.8"), LengthDist.parse("uniform:16:512"), seed=3, rate=10)
    assert take(spec, 200) == take(spec, 200)
    other = take(WorkloadSpec(spec.prompt, spec.output, seed=4, rate=10), 200)
    assert [r.prompt_tokens for r in other] != [r.prompt_tokens for r in take(spec, 200)]
    assert synth_prompt(50, 1, 7) == synth_prompt(50, 1, 7) != synth_prompt(50, 1, 8)


@pytest.mark.parametrize(
    ("spec", "lo", "hi"),
    [("fixed:100", 100, 100), ("uniform:10:20", 10, 20), ("lognormal:100:1.0", 1, 1600),
     ("lognormal:100:1.0:300", 1, 300), ("bimodal:100:4000:0.2", 80, 4800)],
)
def test_distributions_stay_in_range(spec: str, lo: int, hi: int) -> None:
    reqs = take(WorkloadSpec(LengthDist.parse(spec), LengthDist.parse(spec)), 2000)
    ps = [r.prompt_tokens for r in reqs]
    assert lo <= min(ps) and max(ps) <= hi
    assert str(LengthDist.parse(spec)).startswith(spec.split(":")[0])


def test_lognormal_median_and_bimodal_mix() -> None:
    reqs = take(WorkloadSpec(LengthDist.parse("lognormal:200:0.7"), LengthDist.parse("fixed:1")), 4000)
    assert statistics.median(r.prompt_tokens for r in reqs) == pytest.approx(200, rel=0.08)
    mix = take(WorkloadSpec(LengthDist.parse("bimodal:100:4000:0.25"), LengthDist.parse("bimodal:300:50:0.25")), 4000)
    long = [r for r in mix if r.prompt_tokens > 1000]
    assert len(long) / len(mix) == pytest.approx(0.25, abs=0.03)
    # one draw picks the mode of both dimensions: long documents get the long-mode output (50)
    assert all(r.max_tokens <= 60 for r in long)
    assert all(r.max_tokens >= 240 for r in mix if r.prompt_tokens < 1000)


def test_poisson_arrivals() -> None:
    reqs = take(WorkloadSpec(rate=50.0, seed=1), 5000)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(reqs)]
    assert reqs[0].arrival_s == 0.0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.08)  # exponential: sd = mean
    assert {r.arrival_s for r in take(WorkloadSpec(rate=0.0), 10)} == {0.0}


def test_bad_specs() -> None:
    for bad in ("gauss:1", "fixed", "fixed:0", "uniform:5:1", "bimodal:1:2:3", "lognormal:1"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_synthesized_prompt_hits_token_target() -> None:
    eng = SimEngine()
    for n in (1, 17, 512, 4096):
        assert len(eng.tokenize(synth_prompt(n, 0, n))) == n


def test_trace_round_trip(tmp_path) -> None:
    reqs = take(WorkloadSpec(LengthDist.parse("uniform:5:50"), LengthDist.parse("fixed:8"), rate=5, model="m"), 20)
    path = tmp_path / "t.jsonl"
    assert save_trace(reqs, path) == 20
    back = load_trace(path)
    assert [(r.index, r.prompt_tokens, r.max_tokens, r.model) for r in back] == \
        [(r.index, r.prompt_tokens, r.max_tokens, r.model) for r in reqs]
    assert [r.arrival_s for r in back] == pytest.approx([r.arrival_s for r in reqs], abs=1e-6)
    assert prompt_text(back[3], 0) == prompt_text(reqs[3], 0)
    # text prompts, "t" offsets, unsorted input, comments, a default model, time scaling
    path.write_text('# recorded\n{"t": 2, "prompt": "hello there", "max_tokens": 4}\n'
                    '{"arrival_s": 1, "prompt_tokens": 9, "max_tokens": 3, "model": "x"}\n')
    back = load_trace(path, model="dflt", time_scale=0.5)
    assert [(r.arrival_s, r.model, r.prompt_text) for r in back] == [(0.5, "x", None), (1.0, "dflt", "hello there")]
    path.write_text('{"prompt_tokens": 9}\n')
    with pytest.raises(ValueError, match="t.jsonl:1"):
        load_trace(path)
