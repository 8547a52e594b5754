"""``gpumesh calibrate``: its arguments, the engine it starts (the node's, built by
``gpumesh.node.app.build_engine`` from the node's own configuration) and the profile it writes.
The measurement itself is ``gpumesh.node.engines.vllm.calibrate``; the CLI prints."""

from __future__ import annotations

import argparse
import asyncio
import tomllib
from dataclasses import dataclass
from pathlib import Path

from gpumesh.node.config import NodeConfig, load_node_config
from gpumesh.node.engines.vllm.calibrate import CalibrationPlan
from gpumesh.profiles import EngineProfile

# NodeConfig keys that shape the engine: calibrate takes them as `gpumesh node` does, each
# as a flag of its key's name (--model, --max-model-len, --kv-events)
ENGINE_KEYS = (
    "engine.model", "engine.served_name", "engine.tokenizer", "engine.dtype",
    "engine.max_model_len", "engine.tensor_parallel_size", "engine.gpu_memory_utilization",
    "engine.load_format", "engine.enforce_eager", "engine.num_gpu_blocks_override",
    "engine.stream_interval", "membership.kv_events",
)


class PlatformMismatch(Exception):
    """``--platform`` names another platform than the one vLLM runs on."""


@dataclass(frozen=True)
class CalibrationJob:
    """One ``gpumesh calibrate`` invocation, validated."""

    config: NodeConfig
    plan: CalibrationPlan
    name: str
    out: Path
    platform: str      # "" = any
    quadratic: bool


def add_arguments(cal: argparse.ArgumentParser) -> None:
    """The command's flags: the node's engine flags and the measurement's own."""
    cal.add_argument("--out", required=True, help="profile TOML to write")
    cal.add_argument("--name", default="", help="profile name (default: the --out file's stem)")
    cal.add_argument("--platform", choices=["cpu", "cuda"], default="",
                     help="refuse to measure unless vLLM runs on this platform")
    cal.add_argument("--config", help="node TOML config file (its engine settings are used)")
    for where in ENGINE_KEYS:
        section, key = where.split(".")
        model = NodeConfig.model_fields[section].annotation
        f = model.model_fields[key]  # type: ignore[union-attr]
        extra = ({"nargs": "?", "const": "true", "metavar": "BOOL"} if f.annotation is bool
                 else {"metavar": key.upper()})
        cal.add_argument("--" + key.replace("_", "-"), dest=where, default=None,
                         help=f"{f.description} (node key {where}, default {f.default!r})",
                         **extra)
    cal.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                     help="a vllm AsyncEngineArgs field (repeat), as the node's engine_args: "
                          "max_num_seqs=64")
    cal.add_argument("--batches", default="1,2,4,8,16,32,64",
                     help="decode batch sizes (capped at max_num_seqs)")
    cal.add_argument("--prompts", default="16,128,256,512,1024,1536",
                     help="prefill prompt lengths in tokens (capped below max_model_len)")
    cal.add_argument("--decode-tokens", type=int, default=64,
                     help="tokens each request decodes in a decode sample")
    cal.add_argument("--repeats", type=int, default=5,
                     help="rounds: every shape once per round, each sample the median")
    cal.add_argument("--held-out-batch", type=int, default=16,
                     help="decode batch left out of the fit (its error is reported)")
    cal.add_argument("--held-out-prompt", type=int, default=512,
                     help="prompt length left out of the fit")
    cal.add_argument("--contexts", default="16x1024,4x1536,8x512",
                     help="BATCHxPROMPT decode samples over long contexts (the attention term)")
    cal.add_argument("--held-out-context", default="8x512",
                     help="the BATCHxPROMPT of --contexts left out of the fit")
    cal.add_argument("--linear", action="store_true", help="no quadratic decode term")


def engine_arg(item: str) -> tuple[str, object]:
    """KEY=VALUE with VALUE read as a TOML value (64, 0.5, true, "x"), else as a string."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--engine-arg {item!r}: expected KEY=VALUE")
    try:
        return key.strip(), tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return key.strip(), value


def batch_by_prompt(item: str) -> tuple[int, int]:
    """``"16x1024"`` -> ``(16, 1024)``."""
    b, sep, p = item.partition("x")
    if not sep:
        raise ValueError(f"{item!r}: expected BATCHxPROMPT, e.g. 16x1024")
    return int(b), int(p)


def prepare(args: argparse.Namespace) -> CalibrationJob:
    """The job the arguments describe: the node's configuration the node's way (defaults <
    ``--config`` < ``GPUMESH_NODE_*`` < flags, engine forced to vllm). Raises ``ConfigError``,
    ``ValueError`` or ``OSError`` naming what is wrong, before anything starts."""
    given: dict[str, dict[str, object]] = {"engine": {"kind": "vllm"}}
    for where in ENGINE_KEYS:
        if (value := getattr(args, where)) is not None:
            section, key = where.split(".")
            given.setdefault(section, {})[key] = value
    cfg = load_node_config(args.config, given)
    extra = dict(engine_arg(item) for item in args.engine_arg or ())
    if extra:
        cfg = cfg.replace(engine={"engine_args": {**cfg.engine.engine_args, **extra}})
    if not cfg.engine.model:
        raise ValueError("--model PATH is required")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: no folder {out.parent}")
    plan = CalibrationPlan(
        decode_batches=tuple(int(x) for x in args.batches.split(",") if x),
        prefill_prompts=tuple(int(x) for x in args.prompts.split(",") if x),
        repeats=args.repeats, decode_tokens=args.decode_tokens,
        held_out_batch=args.held_out_batch, held_out_prompt=args.held_out_prompt,
        contexts=tuple(batch_by_prompt(x) for x in args.contexts.split(",") if x),
        held_out_context=batch_by_prompt(args.held_out_context))
    return CalibrationJob(cfg, plan, args.name or out.stem, out, args.platform,
                          not args.linear)


async def run(job: CalibrationJob) -> EngineProfile:
    """Start the engine, measure it, stop it, write the profile. Raises ``PlatformMismatch``,
    ``EngineError`` (vLLM failed), ``CalibrationError``, ``ValueError`` (the fit) or
    ``OSError`` (writing)."""
    from gpumesh.node.app import build_engine
    from gpumesh.node.engines.vllm import VllmEngine
    from gpumesh.node.engines.vllm.calibrate import engine_facts, measure_profile
    from gpumesh.profiles import dump_profile

    engine = build_engine(job.config)
    if not isinstance(engine, VllmEngine):
        raise TypeError("calibrate measures a vLLM engine")
    try:
        await engine.start()
        platform = engine_facts(engine).platform
        if job.platform and platform != job.platform:
            raise PlatformMismatch(f"--platform {job.platform}, but vLLM runs on {platform}")
        profile = await measure_profile(engine, job.name, job.plan,
                                        model=job.config.engine.model,
                                        quadratic=job.quadratic)
    finally:
        await engine.shutdown()
    await asyncio.to_thread(dump_profile, profile, job.out)
    return profile


def profile_table(profile: EngineProfile) -> str:
    """The fitted coefficients and every sample with its fit, as the command prints them."""
    lines = [" ".join(f"{k}={getattr(profile, k):.4g}" for k in (
        "a_ms", "b_decode_ms", "c_decode_ms", "b_prefill_ms", "b_decode_context_ms",
        "c_prefill_ms", "request_overhead_ms")),
        f"{'sample':<36}{'measured_ms':>12}{'fit_ms':>9}{'error':>8}"]
    for s in profile.samples:
        what = (f"decode batch {s.batch} after {s.prompt_tokens}" if s.kind == "decode" else
                f"prefill {s.prompt_tokens}" + (f" ({s.cached_tokens} cached)"
                                                if s.cached_tokens else ""))
        what += " (held out)" if s.held_out else ""
        lines.append(f"{what:<36}{s.measured_ms:>12.3f}{s.fit_ms:>9.3f}{s.error * 100:>+7.1f}%")
    return "\n".join(lines)
