"""Engine profiles: how one inference engine performs, in one versioned TOML file.

A profile says what a step of the engine costs as a function of what the step holds, what
its scheduler admits, how much KV cache it has, and what a request pays outside the steps.
``gpumesh calibrate`` measures one from a real vLLM engine; the simulator
(``SimEngineConfig.from_profile``) runs on one; built-in profiles ship with the package
(:func:`builtin_profile`, :func:`builtin_names`).

Step model (ms; tokens are the tokens the step schedules)::

    step_ms = a_ms + b_decode_ms * decode_tokens + c_decode_ms * decode_tokens**2
                   + b_prefill_ms * prefill_tokens
                   + b_decode_context_ms * decode_context + c_prefill_ms * prefill_pairs

where ``decode_context`` is the context the step's decoding sequences attend to (the sum of
their lengths: reading their KV cache) and ``prefill_pairs`` the (prompt token, earlier token)
pairs its prefill chunks attend over (a chunk of n tokens after c computed ones: n*c +
n*(n+1)/2): attention, which grows with context. Both terms are 0 where it does not matter.

A lone request's prefill (:meth:`EngineProfile.prefill_ms`) is the steps of its uncached
prompt in chunks of at most ``max_num_batched_tokens``; its time to first token
(:meth:`EngineProfile.ttft_ms`) adds ``request_overhead_ms``, the fixed cost outside the
steps (input and output processing in the front end), which the step model does not hold.

The serving path's CPU work (all 0 = not measured; ``gpumesh_bench.sim.frontcal`` measures
them on a live node and router): the node front end's process spends ``cpu_request_ms`` per
request plus ``cpu_prompt_token_ms`` per prompt token, ``cpu_output_ms`` per engine output
(one request's token of one step) and ``cpu_message_ms`` per stream message it sends; the
router's process ``cpu_request_ms`` per request plus ``cpu_prompt_token_ms`` per prompt
token and ``cpu_message_ms`` per stream message it relays. The simulator serves them as
queues (one process each), which is where a loaded fleet's TTFT tail comes from.

TOML layout (every key is described in docs/simulator.md, "Engine profiles")::

    format = "gpumesh.engine-profile/1"
    [engine]     name, platform ("cpu" | "cuda"), model, vllm_version, measured, source
    [scheduler]  max_num_seqs, max_num_batched_tokens, max_model_len
    [kv]         capacity_tokens, block_size, prefix_caching, bytes_per_token
    [step]       a_ms, b_decode_ms, c_decode_ms, b_prefill_ms, b_decode_context_ms,
                 c_prefill_ms
    [front_end]  tokens_per_s (0 = no ceiling), request_overhead_ms, cpu_request_ms,
                 cpu_output_ms, cpu_message_ms, cpu_prompt_token_ms
    [router]     cpu_request_ms, cpu_message_ms, cpu_prompt_token_ms
    [[samples]]  kind ("decode" | "prefill"), batch, prompt_tokens, cached_tokens,
                 context_tokens, measured_ms, fit_ms, held_out

A profile is validated when built or loaded (``gpumesh.profile_schema``): every number finite
and in range, no unknown key; a ``ProfileError`` names the offending key (``step.a_ms``,
``samples[3].batch``).
"""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from gpumesh.profile_schema import TOML_LAYOUT, ProfileError, validate

FORMAT = "gpumesh.engine-profile/1"
BUILTIN_PACKAGE = "gpumesh"
BUILTIN_FOLDER = "engine_profiles"


@dataclass(frozen=True)
class Sample:
    """One raw measurement a profile was fitted on.

    ``kind = "decode"``: ``batch`` requests decoding together after prompts of
    ``prompt_tokens``, ``measured_ms`` = one step; ``context_tokens`` = each sequence's mean
    length over the measured steps (0 = not recorded: no context term). ``kind = "prefill"``: one request of
    ``prompt_tokens`` tokens (``cached_tokens`` of them a prefix-cache hit) alone with
    ``max_tokens = 1``, ``measured_ms`` = its time to first token. ``fit_ms`` = what the
    profile's model predicts for it (0 = not computed); ``held_out`` = left out of the fit.
    """

    kind: str
    measured_ms: float
    batch: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    context_tokens: int = 0
    fit_ms: float = 0.0
    held_out: bool = False

    @property
    def error(self) -> float:
        """Relative error of the fit, ``fit_ms / measured_ms - 1`` (0 without a fit)."""
        return self.fit_ms / self.measured_ms - 1.0 if self.fit_ms and self.measured_ms else 0.0


@dataclass(frozen=True)
class EngineProfile:
    """One engine's performance (module docstring: the model and the TOML keys)."""

    # [engine]: what was measured
    name: str
    platform: str = "cuda"
    model: str = ""
    vllm_version: str = ""
    measured: str = ""
    source: str = ""
    # [scheduler]
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 16384
    max_model_len: int = 8704
    # [kv]
    kv_capacity_tokens: int = 10_200_000
    kv_block_size: int = 16
    prefix_caching: bool = True
    # bytes of KV cache one token takes (2 x layers x KV heads x head dim x dtype bytes,
    # :func:`kv_bytes_per_token`): what moving a prompt's KV to another engine transfers;
    # 0 = unknown
    kv_bytes_per_token: int = 0
    # [step], ms
    a_ms: float = 0.0
    b_decode_ms: float = 0.0
    c_decode_ms: float = 0.0
    b_prefill_ms: float = 0.0
    b_decode_context_ms: float = 0.0
    c_prefill_ms: float = 0.0
    # [front_end]
    front_end_tokens_per_s: float = 0.0
    request_overhead_ms: float = 0.0
    front_end_cpu_request_ms: float = 0.0
    front_end_cpu_output_ms: float = 0.0
    front_end_cpu_message_ms: float = 0.0
    front_end_cpu_prompt_token_ms: float = 0.0
    # [router]: the router's CPU work per request, per relayed stream message and per
    # prompt token, ms
    router_cpu_request_ms: float = 0.0
    router_cpu_message_ms: float = 0.0
    router_cpu_prompt_token_ms: float = 0.0
    samples: tuple[Sample, ...] = ()

    def __post_init__(self) -> None:
        validate(self)

    def step_ms(self, decode_seqs: int, decode_tokens: int, prefill_tokens: int,
                decode_context: int = 0, prefill_pairs: int = 0) -> float:
        """One engine step in ms holding ``decode_seqs`` decoding sequences that schedule
        ``decode_tokens`` tokens (one each without speculative decoding) and
        ``prefill_tokens`` prompt tokens (chunked prefill included); ``decode_context`` and
        ``prefill_pairs`` as in the module docstring (0: the context terms left out). The
        model prices tokens; ``decode_seqs`` is accepted so callers state the batch."""
        if (decode_seqs < 0 or decode_tokens < decode_seqs or prefill_tokens < 0
                or decode_context < 0 or prefill_pairs < 0):
            raise ValueError("need 0 <= decode_seqs <= decode_tokens and the rest >= 0")
        d = float(decode_tokens)
        return (self.a_ms + self.b_decode_ms * d + self.c_decode_ms * d * d
                + self.b_prefill_ms * prefill_tokens
                + self.b_decode_context_ms * decode_context + self.c_prefill_ms * prefill_pairs)

    def prefill_chunks(self, prompt_tokens: int, cached_tokens: int = 0) -> list[tuple[int, int]]:
        """``(tokens, pairs)`` of each step that prefills one request alone: its uncached
        tokens (at least one: the engine always computes the last prompt token) in chunks of
        at most ``max_num_batched_tokens``."""
        if prompt_tokens < 1 or not 0 <= cached_tokens <= prompt_tokens:
            raise ValueError("need prompt_tokens >= 1 and 0 <= cached_tokens <= prompt_tokens")
        done = min(cached_tokens if self.prefix_caching else 0, prompt_tokens - 1)
        chunks = []
        while done < prompt_tokens:
            n = min(prompt_tokens - done, self.max_num_batched_tokens)
            chunks.append((n, prefill_pairs(done, n)))
            done += n
        return chunks

    def prefill_ms(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Engine time in ms to prefill one request alone (the steps of
        :meth:`prefill_chunks`); without ``request_overhead_ms`` (see :meth:`ttft_ms`)."""
        return sum(self.step_ms(0, 0, n, prefill_pairs=pairs)
                   for n, pairs in self.prefill_chunks(prompt_tokens, cached_tokens))

    def ttft_ms(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """A lone request's time to first token in ms: ``request_overhead_ms`` + its prefill."""
        return self.request_overhead_ms + self.prefill_ms(prompt_tokens, cached_tokens)

    def predict(self, s: Sample) -> float:
        """What this profile's model says ``s`` measured (ms)."""
        if s.kind == "decode":
            return self.step_ms(s.batch, s.batch, 0, decode_context=s.batch * s.context_tokens)
        return self.ttft_ms(s.prompt_tokens, s.cached_tokens)


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
                "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def kv_bytes_per_token(config: Mapping[str, Any], kv_cache_dtype: str = "") -> int:
    """Bytes of KV cache one token takes in a model with the Hugging Face ``config``
    (``config.json``): 2 (K and V) x ``num_hidden_layers`` x ``num_key_value_heads`` x
    ``head_dim`` x the bytes of ``kv_cache_dtype`` (default: the model's ``torch_dtype``).
    ``head_dim`` defaults to ``hidden_size // num_attention_heads``, ``num_key_value_heads``
    to ``num_attention_heads``. ``ProfileError`` when a field is missing or not a positive
    integer, or the dtype is not known."""
    def field(key: str, default: Any = None) -> int:
        v = config.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ProfileError(f"model config {key}: must be a positive integer, got {v!r}")
        return v

    layers = field("num_hidden_layers")
    heads = field("num_attention_heads")
    kv_heads = field("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or field("hidden_size") // heads
    dtype = kv_cache_dtype or str(config.get("torch_dtype") or config.get("dtype") or "")
    if dtype not in _DTYPE_BYTES:
        raise ProfileError(f"model config torch_dtype: unknown dtype {dtype!r}; known: "
                           f"{sorted(_DTYPE_BYTES)}")
    return 2 * layers * kv_heads * int(head_dim) * _DTYPE_BYTES[dtype]


def prefill_pairs(computed: int, tokens: int) -> int:
    """(token, earlier token) pairs a prefill chunk of ``tokens`` after ``computed`` tokens
    attends over (each token attends to every token up to itself)."""
    return tokens * computed + tokens * (tokens + 1) // 2


# -- TOML ---------------------------------------------------------------------------------

_SAMPLE_KEYS = tuple(f.name for f in fields(Sample))
_SAMPLE_DEFAULTS = {f.name: f.default for f in fields(Sample)}


def from_mapping(doc: Mapping[str, Any]) -> EngineProfile:
    """An ``EngineProfile`` from a parsed TOML document; ``ProfileError`` names a bad key."""
    fmt = doc.get("format")
    if fmt != FORMAT:
        raise ProfileError(f"format: must be {FORMAT!r}, got {fmt!r}")
    unknown = set(doc) - {"format", "samples", *TOML_LAYOUT}
    if unknown:
        raise ProfileError(f"{sorted(unknown)[0]}: unknown table or key")
    kwargs: dict[str, Any] = {}
    for table, pairs in TOML_LAYOUT.items():
        section = doc.get(table, {})
        if not isinstance(section, Mapping):
            raise ProfileError(f"{table}: must be a table")
        for key in section:
            if key not in pairs:
                raise ProfileError(f"{table}.{key}: unknown key")
        for key, attr in pairs.items():
            if key in section:
                kwargs[attr] = section[key]
    if "name" not in kwargs:
        raise ProfileError("engine.name: missing")
    raw = doc.get("samples", [])
    if not isinstance(raw, list):
        raise ProfileError("samples: must be an array of tables ([[samples]])")
    samples = []
    for i, row in enumerate(raw):
        if not isinstance(row, Mapping):
            raise ProfileError(f"samples[{i}]: must be a table")
        for key in row:
            if key not in _SAMPLE_KEYS:
                raise ProfileError(f"samples[{i}].{key}: unknown key")
        if "kind" not in row or "measured_ms" not in row:
            raise ProfileError(f"samples[{i}]: needs kind and measured_ms")
        samples.append(Sample(**row))
    return EngineProfile(**kwargs, samples=tuple(samples))


def loads_profile(text: str, origin: str = "<string>") -> EngineProfile:
    """Parse and validate a profile's TOML text; ``ProfileError`` says where and what."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{origin}: not valid TOML: {e}") from e
    try:
        return from_mapping(doc)
    except ProfileError as e:
        raise ProfileError(f"{e} (in {origin})") from e


def load_profile(path: str | Path) -> EngineProfile:
    """Read and validate the profile at ``path`` (blocking file I/O: callers on an event loop
    use ``asyncio.to_thread``)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ProfileError(f"{p}: cannot read: {e.strerror or e}") from e
    return loads_profile(text, str(p))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # finite (validated); repr round-trips exactly
    s = str(v)
    escaped = s.replace("\\", "\\\\").replace('"', '\\"')
    escaped = "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in escaped)
    return f'"{escaped}"'


def dumps_profile(p: EngineProfile) -> str:
    """The TOML text of ``p``; ``loads_profile`` gives ``p`` back exactly."""
    validate(p)
    lines = [f"format = {_toml_value(FORMAT)}"]
    for table, pairs in TOML_LAYOUT.items():
        lines += ["", f"[{table}]"]
        lines += [f"{key} = {_toml_value(getattr(p, attr))}" for key, attr in pairs.items()]
    for s in p.samples:  # keys at their default are left out (kind and measured_ms never)
        lines += ["", "[[samples]]"]
        lines += [f"{k} = {_toml_value(getattr(s, k))}" for k in _SAMPLE_KEYS
                  if k in ("kind", "measured_ms") or getattr(s, k) != _SAMPLE_DEFAULTS[k]]
    return "\n".join(lines) + "\n"


def dump_profile(profile: EngineProfile, path: str | Path) -> None:
    """Write ``profile`` to ``path`` as TOML (blocking file I/O)."""
    Path(path).write_text(dumps_profile(profile), encoding="utf-8")


# -- built-in profiles --------------------------------------------------------------------

def builtin_names() -> list[str]:
    """Names of the profiles shipped with gpumesh (``builtin_profile`` takes them)."""
    folder = resources.files(BUILTIN_PACKAGE) / BUILTIN_FOLDER
    return sorted(f.name[:-5] for f in folder.iterdir() if f.name.endswith(".toml"))


@functools.lru_cache(maxsize=64)
def builtin_profile(name: str) -> EngineProfile:
    """The built-in profile ``name`` (case-insensitive); ``ProfileError`` if there is none."""
    key = name.lower()
    if key not in builtin_names():
        raise ProfileError(f"unknown built-in profile {name!r}; known: {builtin_names()}")
    f = resources.files(BUILTIN_PACKAGE) / BUILTIN_FOLDER / f"{key}.toml"
    return loads_profile(f.read_text(encoding="utf-8"), f"built-in profile {key}")
