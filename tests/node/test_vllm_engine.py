"""VllmEngine against the real vLLM CPU engine on the tiny model (one engine per session),
plus the pieces that need no engine: the tiny model builder, the stats adapter, the GPU sampler.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpumesh.tiny_model import build_tiny_model, is_complete_model
from gpumesh.node.engines.base import (
    Engine,
    EngineOutput,
    EngineRequest,
    Finish,
    InvalidRequest,
    PromptTooLong,
    Sampling,
)
from gpumesh.node.gpu import GpuSampler, visible_device_ids
from gpumesh.node.engines.vllm import VllmEngine, VllmEngineConfig
from gpumesh.node.engines.vllm.engine_args import engine_kwargs
from gpumesh.node.engines.vllm.stats import LoadStatLogger
from gpumesh.types import GpuSample

GREEDY = Sampling(max_tokens=24, temperature=0.0, ignore_eos=True)
_ids = iter(range(1_000_000))


def req(engine: VllmEngine, sampling: Sampling = GREEDY, prompt: str = "Hello there, router",
        request_id: str | None = None) -> EngineRequest:
    rid = request_id or f"t{next(_ids)}"
    return EngineRequest(rid, tuple(engine.tokenize(prompt)), sampling)


async def collect(engine: VllmEngine, request: EngineRequest) -> list[EngineOutput]:
    return [o async for o in engine.generate(request)]


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def text(outs: list[EngineOutput]) -> str:
    return "".join(o.text for o in outs)


async def wait_for(pred, timeout: float = 5.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(interval)
    return pred()


# -- tiny model (no engine) -----------------------------------------------------------------


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_tiny_model_builds_fast_and_deterministically(tmp_path: Path) -> None:
    t0 = time.monotonic()
    a = build_tiny_model(tmp_path / "a", seed=0)
    elapsed = time.monotonic() - t0
    b = build_tiny_model(tmp_path / "b", seed=0)
    c = build_tiny_model(tmp_path / "c", seed=1)
    assert elapsed < 30, elapsed
    assert is_complete_model(a) and is_complete_model(b)
    assert _digests(a) == _digests(b)
    assert _digests(a)["model.safetensors"] != _digests(c)["model.safetensors"]
    assert _digests(a)["tokenizer.json"] == _digests(c)["tokenizer.json"]

    cfg = json.loads((a / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == cfg["head_dim"] == 64
    assert cfg["max_position_embeddings"] == 2048
    tok = json.loads((a / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"])
    assert 2000 <= vocab <= 4096 and cfg["vocab_size"] >= vocab

    # Idempotent: a second call reuses the folder without rewriting it.
    before = (a / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(a, seed=5) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == before


def test_tiny_model_never_clobbers_a_foreign_folder(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "weights.bin").write_bytes(b"precious")
    with pytest.raises(FileExistsError):
        build_tiny_model(tmp_path / "m")
    assert (tmp_path / "m" / "weights.bin").read_bytes() == b"precious"


def test_tiny_model_tokenizer_loads_with_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert tok.eos_token == "<|im_end|>"
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    s = "The router balances load. Ünïcödé ✓"
    assert tok.decode(tok.encode(s, add_special_tokens=False)) == s


# -- stats adapter (no engine) --------------------------------------------------------------


def _sched(running: int, waiting: int, kv: float, requests: int = 0, queries: int = 0,
           hits: int = 0) -> SimpleNamespace:
    pc = SimpleNamespace(reset=False, requests=requests, queries=queries, hits=hits)
    return SimpleNamespace(num_running_reqs=running, num_waiting_reqs=waiting,
                           num_skipped_waiting_reqs=0, kv_cache_usage=kv,
                           prefix_cache_stats=pc)


def _iter(gen: int, prompt: int = 0) -> SimpleNamespace:
    return SimpleNamespace(num_generation_tokens=gen,
                           prompt_token_stats=SimpleNamespace(computed=prompt))


def test_stat_adapter_counts_rates_and_prefix_window() -> None:
    now = [100.0]
    s = LoadStatLogger(rate_window_s=2.0, prefix_window_requests=4, clock=lambda: now[0])
    assert s.snapshot().num_running == 0

    s.record(_sched(3, 2, 0.5, requests=2, queries=100, hits=50), _iter(3, prompt=40))
    now[0] = 101.0
    s.record(_sched(3, 1, 0.6), _iter(5))
    snap = s.snapshot()
    assert (snap.num_running, snap.num_waiting, snap.kv_cache_usage) == (3, 1, 0.6)
    assert snap.generation_tokens_per_s == pytest.approx(8 / 2.0)
    assert snap.prompt_tokens_per_s == pytest.approx(40 / 2.0)
    assert snap.prefix_cache_hit_rate == pytest.approx(0.5)

    # Rates decay with time even without new records (vLLM stays silent when idle).
    now[0] = 102.5
    assert s.snapshot().generation_tokens_per_s == pytest.approx(5 / 2.0)
    now[0] = 104.0
    assert s.snapshot().generation_tokens_per_s == 0.0

    # The prefix window keeps the most recent requests (4): the first update falls out.
    s.record(_sched(0, 0, 0.0, requests=3, queries=10, hits=10), None)
    assert s.snapshot().prefix_cache_hit_rate == pytest.approx(1.0)
    assert s.snapshot().prefix_cache_hit_rate == pytest.approx(1.0)  # kept while idle


def test_stat_adapter_measures_prefill_capacity_over_spans_of_steps() -> None:
    now = [100.0]
    s = LoadStatLogger(rate_window_s=3.0, clock=lambda: now[0], capacity_span_s=0.05,
                        capacity_window_s=10.0, capacity_windows=2)

    def step(dt: float, prompt: int, gen: int = 0) -> None:
        now[0] += dt
        s.record(_sched(1, 0, 0.1), _iter(gen, prompt=prompt))

    assert s.snapshot().prefill_capacity_tokens_per_s == 0.0
    step(0.0, 0, gen=1)                 # the first call: its step's start is unknown
    step(5.0, 0, gen=1)                 # idle gap, decode only: no span opens
    assert s.snapshot().prefill_capacity_tokens_per_s == 0.0
    # A prefill of 4000 tokens in 20 ms, then decode steps until the span reaches 50 ms:
    # 4000 / 0.06 s (decode steps inside a span only lower the sample).
    step(0.02, 4000, gen=4)
    step(0.01, 0, gen=4)
    assert s.snapshot().prefill_capacity_tokens_per_s == 0.0   # span still open (30 ms)
    step(0.03, 0, gen=4)
    snap = s.snapshot()
    assert snap.prefill_capacity_tokens_per_s == pytest.approx(4000 / 0.06)
    # The observed prompt rate is throughput over the rate window, far below it.
    assert snap.prompt_tokens_per_s == pytest.approx(4000 / 3.0)
    # Calls that come back to back (the output handler catching up) are absorbed by the span:
    # 10 records 1 ms apart with 1000 tokens each, then one 50 ms step: 10000 / 0.06 s.
    for _ in range(10):
        step(0.001, 1000)
    step(0.05, 0, gen=4)
    assert s.snapshot().prefill_capacity_tokens_per_s == pytest.approx(10000 / 0.06)
    # A slower sample keeps the maximum; an idle engine keeps the figure.
    step(0.1, 100)
    now[0] += 600.0
    assert s.snapshot().prefill_capacity_tokens_per_s == pytest.approx(10000 / 0.06)
    # Windows that saw prefill age the maximum out (2 windows here): 2 windows later only
    # the recent, smaller samples count.
    for _ in range(2):
        step(11.0, 50)      # a new window; a span of >= 11 s: a low sample
        step(0.06, 3000)    # a new span: 3000 tokens in 60 ms = 50k
    assert s.snapshot().prefill_capacity_tokens_per_s == pytest.approx(3000 / 0.06)



def test_stat_adapter_times_the_engine_steps_while_requests_run() -> None:
    now = [100.0]
    s = LoadStatLogger(clock=lambda: now[0], step_window_s=1.0)

    def step(dt: float, running: int) -> None:
        now[0] += dt
        s.record(_sched(running, 0, 0.1), _iter(running))

    assert s.snapshot().decode_step_s == 0.0
    step(0.0, 8)                           # the first call: its step's start is unknown
    assert s.snapshot().decode_step_s == 0.0
    for _ in range(5):
        step(0.010, 8)                     # 10 ms steps
    assert s.snapshot().decode_step_s == pytest.approx(0.010)
    step(0.010, 0)                         # the last request finished in this step
    step(30.0, 4)                          # 30 s idle before the next step: not a step
    assert s.snapshot().decode_step_s == pytest.approx(0.010)
    # The output handler catching up: one 50 ms interval, then 4 steps recorded at once:
    # 5 steps in 50 ms, 10 ms each (the mean over the window, not the last interval).
    for _ in range(10):
        step(0.020, 4)                     # the window (1 s) now holds 20 ms steps only
    assert s.snapshot().decode_step_s == pytest.approx(0.020)
    step(0.010, 0)                         # idle for 2 s: the window then holds the burst
    step(2.0, 4)
    step(0.050, 4)
    for _ in range(4):
        step(0.0, 4)
    assert s.snapshot().decode_step_s == pytest.approx(0.010)
    # Scheduler stats absent (vLLM sends them every step; a call without them is not a step).
    s.record(None, _iter(1))
    assert s.snapshot().decode_step_s == pytest.approx(0.010)

# -- GPU sampler (no GPU here) ------------------------------------------------------------


async def test_gpu_sampler_returns_nothing_without_nvidia_driver() -> None:
    sampler = GpuSampler()
    assert await sampler.sample() == ()
    assert sampler.latest == ()
    assert not sampler.available
    await asyncio.wait_for(sampler.run(0.05), timeout=5)  # returns at once without NVML
    await sampler.close()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"CUDA_VISIBLE_DEVICES": ""}, ()),
        ({"CUDA_VISIBLE_DEVICES": "0,2"}, ("0", "2")),
        ({"CUDA_VISIBLE_DEVICES": " 1 , 3 "}, ("1", "3")),
        ({"CUDA_VISIBLE_DEVICES": "1,foo,2"}, ("1",)),
        ({"CUDA_VISIBLE_DEVICES": "2,-1,3"}, ("2",)),
        ({"CUDA_VISIBLE_DEVICES": "GPU-abc,MIG-def"}, ("GPU-abc", "MIG-def")),
    ],
)
def test_visible_device_ids(env: dict[str, str], expected: tuple[str, ...] | None) -> None:
    assert visible_device_ids(env) == expected


class _FakeSampler:
    latest = (GpuSample(index=3, utilization=0.5, memory_used_bytes=1, memory_total_bytes=2),)


def test_load_includes_attached_gpu_samples() -> None:
    engine = VllmEngine(VllmEngineConfig(model="/nowhere/m"), gpu_sampler=_FakeSampler())  # type: ignore[arg-type]
    assert engine.load().gpus == _FakeSampler.latest
    assert engine.model.name == "m"


# -- the real engine ------------------------------------------------------------------------

vllm_only = pytest.mark.vllm


@vllm_only
async def test_engine_protocol_and_model_spec(vllm_engine: VllmEngine) -> None:
    assert isinstance(vllm_engine, Engine)
    assert vllm_engine.kind == "vllm"
    spec = vllm_engine.model
    assert (spec.name, spec.aliases, spec.max_context_length) == ("tiny", ("tiny-alias",), 512)


@vllm_only
async def test_greedy_is_deterministic(vllm_engine: VllmEngine) -> None:
    a = await collect(vllm_engine, req(vllm_engine))
    b = await collect(vllm_engine, req(vllm_engine))
    assert tokens(a) == tokens(b) and len(tokens(a)) == GREEDY.max_tokens
    assert text(a) == text(b) and text(a)
    assert all(o.finish is None for o in a[:-1]) and a[-1].finish is Finish.LENGTH

    seeded = Sampling(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=7,
                      ignore_eos=True)
    c = await collect(vllm_engine, req(vllm_engine, seeded))
    d = await collect(vllm_engine, req(vllm_engine, seeded))
    assert tokens(c) == tokens(d)


@vllm_only
async def test_max_tokens_finishes_with_length(vllm_engine: VllmEngine) -> None:
    outs = await collect(vllm_engine, req(vllm_engine, Sampling(max_tokens=7, temperature=0.0,
                                                                 ignore_eos=True)))
    assert len(tokens(outs)) == 7
    assert outs[-1].finish is Finish.LENGTH
    assert [o.finish for o in outs[:-1]] == [None] * (len(outs) - 1)


@vllm_only
async def test_stop_string_ends_with_stop_and_is_excluded(vllm_engine: VllmEngine) -> None:
    prompt = "The quick brown fox"
    full = text(await collect(vllm_engine, req(vllm_engine, Sampling(
        max_tokens=40, temperature=0.0, ignore_eos=True), prompt)))
    # A stop string from the middle of the greedy output (clean ASCII, first seen past 5).
    stop = next(
        full[i:i + 3] for i in range(5, len(full) - 3)
        if full[i:i + 3].isascii() and full[i:i + 3].strip() == full[i:i + 3]
        and full.find(full[i:i + 3]) >= 5
    )
    expected = full[:full.find(stop)]
    outs = await collect(vllm_engine, req(vllm_engine, Sampling(
        max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,)), prompt))
    assert outs[-1].finish is Finish.STOP
    assert text(outs) == expected
    assert stop not in text(outs)


@vllm_only
async def test_load_reports_running_requests_and_kv_usage(vllm_engine: VllmEngine) -> None:
    seen: list = []

    async def run(n: int) -> list[EngineOutput]:
        outs = []
        async for o in vllm_engine.generate(req(vllm_engine, Sampling(
                max_tokens=120, temperature=0.0, ignore_eos=True), prompt=f"request {n}")):
            outs.append(o)
            if len(outs) == 5:
                seen.append(vllm_engine.load())
        return outs

    results = await asyncio.gather(*(run(i) for i in range(3)))
    assert all(len(tokens(r)) == 120 for r in results)
    assert seen and max(s.num_running for s in seen) >= 2
    assert all(s.num_running >= 1 and s.kv_cache_usage > 0 for s in seen)
    assert all(0.0 <= s.kv_cache_usage <= 1.0 for s in seen)
    after = vllm_engine.load()
    assert after.generation_tokens_per_s > 0 and after.prompt_tokens_per_s > 0
    assert after.kv_capacity_tokens > 0 and after.kv_capacity_tokens % 16 == 0   # blocks x 16
    # Measured from the steps that prefilled: above the observed (arrival-limited) rate.
    assert after.prefill_capacity_tokens_per_s > after.prompt_tokens_per_s > 0
    assert await wait_for(lambda: vllm_engine.load().num_running == 0)
    assert vllm_engine.load().kv_cache_usage == 0.0


@vllm_only
async def test_cancelling_the_consumer_aborts_in_the_engine(vllm_engine: VllmEngine) -> None:
    got: list[EngineOutput] = []
    running_seen = asyncio.Event()

    async def consume() -> None:
        async for o in vllm_engine.generate(req(vllm_engine, Sampling(
                max_tokens=480, temperature=0.0, ignore_eos=True))):
            got.append(o)
            if len(got) == 5 and vllm_engine.load().num_running >= 1:
                running_seen.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(running_seen.wait(), timeout=30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(got) < 480
    # The engine core reports the abort in its next stats update.
    assert await wait_for(lambda: vllm_engine.load().num_running == 0, timeout=5)
    assert vllm_engine.load().kv_cache_usage == 0.0
    # ...and is healthy afterwards.
    assert len(tokens(await collect(vllm_engine, req(vllm_engine)))) == GREEDY.max_tokens


@vllm_only
async def test_abort_by_id_ends_the_stream_with_abort(vllm_engine: VllmEngine) -> None:
    request = req(vllm_engine, Sampling(max_tokens=480, temperature=0.0, ignore_eos=True))
    outs: list[EngineOutput] = []

    async def consume() -> None:
        async for o in vllm_engine.generate(request):
            outs.append(o)

    task = asyncio.create_task(consume())
    assert await wait_for(lambda: len(outs) >= 3, timeout=30)
    await vllm_engine.abort(request.request_id)
    await asyncio.wait_for(task, timeout=10)
    assert outs[-1].finish is Finish.ABORT
    assert len(tokens(outs)) < 480
    assert await wait_for(lambda: vllm_engine.load().num_running == 0)
    await vllm_engine.abort("no-such-request")  # unknown ids are ignored


@vllm_only
async def test_render_chat_and_tokenize(vllm_engine: VllmEngine) -> None:
    ids = vllm_engine.render_chat([("system", "Be brief."), ("user", "Hello!")])
    assert ids and all(isinstance(i, int) for i in ids)
    tok = vllm_engine._tokenizer
    assert tok.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                               "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n")
    assert vllm_engine.tokenize("Hello!") == tok.encode("Hello!")
    outs = await collect(vllm_engine, EngineRequest("chat-1", tuple(ids), GREEDY))
    assert outs[-1].finish is Finish.LENGTH


@vllm_only
async def test_prompt_over_the_context_window_is_prompt_too_long(
        vllm_engine: VllmEngine) -> None:
    with pytest.raises(PromptTooLong):
        await collect(vllm_engine, EngineRequest("long", tuple([100] * 600), GREEDY))


@vllm_only
async def test_token_id_out_of_vocabulary_is_invalid_request(vllm_engine: VllmEngine) -> None:
    with pytest.raises(InvalidRequest):
        await collect(vllm_engine, EngineRequest("oov", (5, 10**9), GREEDY))
    assert len(tokens(await collect(vllm_engine, req(vllm_engine)))) == GREEDY.max_tokens


@vllm_only
async def test_stream_interval_hands_over_tokens_in_groups(vllm_engine: VllmEngine) -> None:
    """The session engine runs with stream_interval 3: the first token alone (no TTFT cost),
    then groups of 3, the last group whatever is left; nothing lost or reordered."""
    outs = await collect(vllm_engine, req(vllm_engine, Sampling(max_tokens=11, temperature=0.0,
                                                                 ignore_eos=True)))
    sizes = [len(o.token_ids) for o in outs]
    assert sum(sizes) == 11 and sizes[0] == 1
    assert sizes[1:-1] and all(s == 3 for s in sizes[1:-1]) and 1 <= sizes[-1] <= 3
    assert outs[-1].finish is Finish.LENGTH


def test_stream_interval_from_node_toml_reaches_the_engine_args(tmp_path: Path) -> None:
    from gpumesh.node.app import build_engine
    from gpumesh.node.config import load_node_config

    toml = tmp_path / "node.toml"
    toml.write_text('[engine]\nkind = "vllm"\nmodel = "/nowhere/m"\nstream_interval = 4\n')
    engine = build_engine(load_node_config(toml, environ={}))
    assert engine_kwargs(engine._config)["stream_interval"] == 4   # type: ignore[attr-defined]
    assert engine_kwargs(VllmEngineConfig(model="/m"))["stream_interval"] == 1
    toml.write_text('[engine]\nkind = "vllm"\nmodel = "/nowhere/m"\nstream_interval = 0\n')
    with pytest.raises(ValueError, match="engine.stream_interval: must be >= 1"):
        load_node_config(toml, environ={})


def test_cuda_nodes_ask_for_full_cuda_graphs_unless_told_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import gpumesh.node.engines.vllm.engine_args as ve
    from vllm.engine.arg_utils import AsyncEngineArgs

    assert "compilation_config" not in engine_kwargs(VllmEngineConfig(model="/m"))  # CPU here
    monkeypatch.setattr(ve, "current_platform",
                        lambda: SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: True))
    kwargs = engine_kwargs(VllmEngineConfig(model="/m"))
    assert kwargs["compilation_config"] == {"cudagraph_mode": "FULL"}
    assert "worker_extension_cls" not in kwargs
    assert AsyncEngineArgs(model="/m", compilation_config=kwargs["compilation_config"]
                           ).compilation_config.cudagraph_mode.name == "FULL"
    assert "compilation_config" not in engine_kwargs(VllmEngineConfig(model="/m",
                                                                      enforce_eager=True))
    mine = {"cudagraph_mode": "FULL_AND_PIECEWISE"}
    assert engine_kwargs(VllmEngineConfig(model="/m", extra={"compilation_config": mine})
                         )["compilation_config"] == mine
    assert ve.CUDA_COMPILATION_CONFIG == {"cudagraph_mode": "FULL"}  # not mutated by a node
