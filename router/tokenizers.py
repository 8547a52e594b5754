"""The router's tokenizers: one per model source, loaded once off the event loop, shared by
prefix locality (``router.fleet.locality``: a prompt's block hashes) and the stock vLLM gRPC
workers' translation (``router.backends.vllm_grpc``: prompts to token ids, ids to text).

A tokenizer is named by a spec: ``sim`` (the simulated engine's, ``gpumesh.sim_tokenizer``)
or an HF tokenizer folder or name (``transformers``). ``RouterTokenizers`` holds the loaded
ones by spec and says which one a model's prompts are hashed with:

- ``prompt_tokenizer(model)``: the model's tokenizer for prefix hashing. The model's spec is
  its ``prefix_tokenizers`` entry, else ``sim`` when its nodes registered a simulated engine,
  else none (no hashes for text and chat prompts of that model). Loaded on first use; a
  load that fails leaves the model without one (logged).
- ``models_changed(models)``: the registry's change listener (wired in ``router.app`` while
  locality is on): a model the router meets for the first time has its tokenizer loaded
  there and then, so the first requests for it do not wait for the load (an HF tokenizer of
  a 150k-token vocabulary takes seconds).
- ``worker_tokenizer(path)``: a stock worker's HF tokenizer with its stream decoder (raises
  when it cannot be loaded: the worker is not joined).

Every load of one spec is one load: callers that arrive while it runs wait for it (a load
each would queue behind one another and ahead of every prompt).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, TypeVarTuple

from gpumesh.serial_worker import INLINE_DECODE_IDS, INLINE_PROMPT_CHARS, SerialWorker
from gpumesh.sim_tokenizer import SimTokenizer

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


class PromptTokenizer:
    """A model's prompt tokenizer on its own ``SerialWorker``: the sync ``encode`` /
    ``render_chat`` (what tests and scripts call, and what runs on the worker), and the async
    forms the router's request path awaits, inline for a short prompt and on the worker's
    thread for a long one, one call at a time either way (an HF fast tokenizer must not be
    called concurrently: "Already borrowed"). ``WorkerClosed`` once the router is stopping."""

    def __init__(self, thread_name: str) -> None:
        self._worker = SerialWorker(thread_name)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        raise NotImplementedError

    async def encode_prompt(self, text: str) -> list[int]:
        return await self._worker.run(self.encode, text, inline=len(text) < INLINE_PROMPT_CHARS)

    async def render_chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return await self._worker.run(self.render_chat, messages,
                                      inline=chat_chars(messages) < INLINE_PROMPT_CHARS)

    async def call(self, fn: Callable[[*_Ts], _T], *args: *_Ts, inline: bool) -> _T:
        """``fn(*args)`` serial with every other call into this tokenizer (a caller's own
        step around ``encode`` or ``render_chat``, such as hashing the ids it gets)."""
        return await self._worker.run(fn, *args, inline=inline)

    def close(self) -> None:
        self._worker.close()


def chat_chars(messages: Sequence[tuple[str, str]]) -> int:
    """A chat's size for the inline threshold: its roles and contents together."""
    return sum(len(r) + len(c) for r, c in messages)


class SimPromptTokenizer(PromptTokenizer):
    """The simulated engine's tokenizer and chat template (what a ``sim`` node computes)."""

    def __init__(self) -> None:
        super().__init__("gpumesh-tokenize-sim")
        self._tok = SimTokenizer()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return self._tok.render_chat(messages)


class _Decoder:
    """``decode`` on one HF tokenizer object: the text of ``ids``, special tokens skipped."""

    def __init__(self, hf: Any) -> None:
        self._hf = hf

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._hf.decode(list(ids), skip_special_tokens=True))


def _hf(path: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - environment
        raise RuntimeError("the router needs the `transformers` package for HF tokenizers "
                           "(prefix hashing of text prompts, stock vLLM gRPC workers)") from exc
    return AutoTokenizer.from_pretrained(path)


class Tokenizer(PromptTokenizer):
    """A model's HF tokenizer (``transformers``) from ``path``.

    Besides the prompt forms, ``decode`` / ``decode_all`` (one-shot, special tokens skipped)
    and ``stream_decoder``: a second copy of the tokenizer for the incremental decode steps
    of a stock worker's streams, only ever called inline on the event loop's thread, so a
    step never waits behind a long encode on the worker (the price: a second copy in memory).
    ``stream_decoder=False`` loads without it (prefix hashing alone needs none);
    ``with_stream_decoder`` adds it.
    """

    def __init__(self, path: str, *, stream_decoder: bool = True) -> None:
        super().__init__(f"gpumesh-tokenize-{path.rstrip('/').rsplit('/', 1)[-1][:16]}")
        self.path = path
        self._tok: Any = _hf(path)
        self._decoder = _Decoder(self._tok)
        self._stream: _Decoder | None = None
        if stream_decoder:
            self.load_stream_decoder()

    def load_stream_decoder(self) -> None:
        if self._stream is None:
            self._stream = _Decoder(_hf(self.path))

    async def with_stream_decoder(self) -> Tokenizer:
        """This tokenizer, its stream decoder loaded (on a thread when it was not)."""
        if self._stream is None:
            await asyncio.to_thread(self.load_stream_decoder)
        return self

    @property
    def stream_decoder(self) -> _Decoder:
        if self._stream is None:
            raise RuntimeError(f"tokenizer {self.path!r} was loaded without a stream decoder")
        return self._stream

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        rendered = self._tok.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages], tokenize=False,
            add_generation_prompt=True)
        return list(self._tok.encode(rendered, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._decoder.decode(ids)

    async def decode_all(self, ids: Sequence[int]) -> str:
        return await self._worker.run(self.decode, ids, inline=len(ids) < INLINE_DECODE_IDS)


def load_tokenizer(spec: str) -> PromptTokenizer:
    """``sim`` or an HF tokenizer path / name (without a stream decoder). Blocking."""
    return SimPromptTokenizer() if spec == "sim" else Tokenizer(spec, stream_decoder=False)


class RouterTokenizers:
    """See the module docstring. ``specs``: model -> spec (``prefix_tokenizers``);
    ``engine_of(model)``: the engine kind its nodes registered with ("sim", "vllm", ...; ""
    while none is known)."""

    def __init__(self, specs: Mapping[str, str] | None = None,
                 engine_of: Callable[[str], str] | None = None) -> None:
        self._specs = dict(specs or {})
        self._engine_of = engine_of
        self._loaded: dict[str, PromptTokenizer] = {}
        self._loading: dict[str, asyncio.Future[PromptTokenizer]] = {}
        self._models: dict[str, PromptTokenizer | None] = {}   # decided: the model's or none
        self._starting: set[str] = set()

    # --- prefix hashing ----------------------------------------------------------------

    def models_changed(self, models: frozenset[str]) -> None:
        """Starts the tokenizer load of each model in ``models`` not decided or starting yet
        (the registry calls this on every membership change, heartbeats included: a set
        lookup per model when there is nothing to do). Without a running event loop (a
        registry driven synchronously) nothing starts: the first request loads it then."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        for model in models:
            if model not in self._models and model not in self._starting:
                self._starting.add(model)
                task = loop.create_task(self.prompt_tokenizer(model))
                task.add_done_callback(lambda _t, m=model: self._starting.discard(m))

    def started(self, model: str) -> bool:
        """Whether the model's tokenizer load has begun (or is decided)."""
        return model in self._models or model in self._starting

    def ready(self, model: str) -> bool:
        """Whether the model's tokenizer is decided (loaded, or none for it)."""
        return model in self._models

    async def prompt_tokenizer(self, model: str) -> PromptTokenizer | None:
        """The model's tokenizer for prefix hashing; None without one (also while no node of
        the model is known: decided again on the next call)."""
        if model in self._models:
            return self._models[model]
        spec = self._specs.get(model, "")
        if not spec and self._engine_of is not None:
            engine = self._engine_of(model)
            if not engine:
                return None
            spec = "sim" if engine == "sim" else ""
        tok: PromptTokenizer | None = None
        if spec:
            try:
                tok = await self._load(spec)
            except Exception:  # noqa: BLE001 - a missing tokenizer disables locality only
                log.warning("no prefix tokenizer for %s (%s): no prefix locality", model, spec,
                            exc_info=True)
        self._models[model] = tok
        return tok

    # --- stock vLLM gRPC workers --------------------------------------------------------

    async def worker_tokenizer(self, path: str) -> Tokenizer:
        """The HF tokenizer at ``path`` with its stream decoder (loaded once, shared with
        prefix hashing when that names the same path). Raises when it cannot be loaded."""
        tok = await self._load(path)
        if not isinstance(tok, Tokenizer):
            raise RuntimeError(f"{path!r} is not an HF tokenizer")
        return await tok.with_stream_decoder()

    # --- loads -------------------------------------------------------------------------

    async def _load(self, spec: str) -> PromptTokenizer:
        tok = self._loaded.get(spec)
        if tok is not None:
            return tok
        pending = self._loading.get(spec)
        if pending is None:
            pending = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, spec))
            self._loading[spec] = pending
            pending.add_done_callback(lambda f: self._loaded_one(spec, f))
        # shielded: one waiter's cancellation must not cancel the load the others wait for
        return await asyncio.shield(pending)

    def _loaded_one(self, spec: str, done: asyncio.Future[PromptTokenizer]) -> None:
        self._loading.pop(spec, None)
        if not done.cancelled() and done.exception() is None:
            self._loaded[spec] = done.result()

    def close(self) -> None:
        """Refuses new thread calls on every loaded tokenizer (the router is stopping)."""
        for tok in self._loaded.values():
            tok.close()
