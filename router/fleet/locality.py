"""Prefix locality: which node already holds a request's prompt prefix in its KV cache.

``PrefixLocality`` is the router's one entry point for it:

- ``hashes(request, model)``: the prompt's token count and block hashes
  (``gpumesh.kvblocks``), as the engine computes them. Token-id prompts are hashed directly;
  text and chat prompts are tokenized with the model's tokenizer (``prefix_tokenizers``: ``sim`` for the simulator's, or an HF
  tokenizer path; simulated nodes get ``sim`` without configuration), on a worker thread for
  a long prompt so the event loop never waits. No tokenizer: no hashes (locality plays no
  part for that request).
- ``models_changed(models)``: the registry's change listener (wired in ``app``): a model the
  router meets for the first time has its tokenizer loaded there and then, on the worker
  thread, so the first requests for it do not wait for that load (an HF tokenizer of a
  150k-token vocabulary takes seconds to load; requests arriving during the load wait for it).
- ``annotate(info)``: the request's ``cached_tokens`` per node from the model's
  ``PrefixIndex``: what the expected-wait scorer subtracts from the prefill each node would
  still do.
- ``prefill_tokens(info, node_id)``: the prompt less what the node holds: what the router
  charges that node for the request (its credit, and the CHARGED_TOKENS it tells the node).
- ``routed(info, node_id)``: the router's record of where it sent which prefix: approximate
  entries for nodes that stream no KV events (every node in ``approximate`` mode), pending
  ones on nodes that do, until their events confirm them (``PrefixIndex``).
- ``apply(node_id, update)``: a node's ``KvCacheUpdate`` (precise mode). Returns the model
  whose updates have a gap (the caller asks that node for a snapshot), else None.

Modes (``prefix_locality``): ``auto`` (precise for nodes that stream events, approximate for
the others), ``precise`` (events only), ``approximate`` (records only, events ignored),
``off``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Protocol

from gpumesh.kvblocks import BLOCK_SIZE, block_hashes, namespace_seed
from gpumesh.router.fleet.prefix_index import PrefixIndexes
from gpumesh.router.scheduling.types import RequestInfo
from gpumesh.serial_worker import INLINE_PROMPT_CHARS, SerialWorker
from gpumesh.v1 import control_pb2, inference_pb2

log = logging.getLogger(__name__)

MODES = ("auto", "precise", "approximate", "off")
_EMPTY: Mapping[str, int] = MappingProxyType({})


class PromptTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: list[tuple[str, str]]) -> list[int]: ...


class _SimTokenizer:
    """The simulated engine's tokenizer and chat template (what a ``sim`` node computes)."""

    def __init__(self) -> None:
        # the simulator's text model lives with the node; only its tokenizer is needed here
        from gpumesh.node.engines.sim.text import SimTokenizer

        self._tok = SimTokenizer()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def render_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        parts = [f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages]
        parts.append("<|im_start|>assistant\n")
        return self._tok.encode("".join(parts))


class _HfTokenizer:
    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def render_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        rendered = self._tok.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages], tokenize=False,
            add_generation_prompt=True)
        return list(self._tok.encode(rendered, add_special_tokens=False))


def load_tokenizer(spec: str) -> PromptTokenizer:
    """``sim`` or an HF tokenizer path / name."""
    return _SimTokenizer() if spec == "sim" else _HfTokenizer(spec)


class PrefixLocality:
    """See the module docstring. ``clock``: monotonic seconds (approximate entries' age);
    ``engine_of(model)``: the engine kind its nodes registered with ("sim", "vllm", ...)."""

    def __init__(self, mode: str, indexes: PrefixIndexes, clock: Callable[[], float],
                 tokenizers: Mapping[str, str] | None = None,
                 engine_of: Callable[[str], str] | None = None,
                 max_prompt_blocks: int = 2048) -> None:
        if mode not in MODES:
            raise ValueError(f"prefix_locality must be one of {MODES}, not {mode!r}")
        self.mode = mode
        self.indexes = indexes
        self.clock = clock
        self._specs = dict(tokenizers or {})
        self._engine_of = engine_of
        self._tokenizers: dict[str, PromptTokenizer | None] = {}
        self._loading: dict[str, asyncio.Future[PromptTokenizer | None]] = {}
        self._worker: SerialWorker | None = None
        self.max_prompt_blocks = max_prompt_blocks
        self.gaps = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    # --- membership --------------------------------------------------------------------

    def models_changed(self, models: frozenset[str]) -> None:
        """Starts the tokenizer load of each model in ``models`` not loaded or loading yet
        (the registry calls this on every membership change, heartbeats included: a set
        lookup per model when there is nothing to do). Without a running event loop (a
        registry driven synchronously) nothing starts: the first request loads it then."""
        if not self.enabled:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        for model in models:
            if model not in self._tokenizers and model not in self._loading:
                self._start_load(model)

    def tokenizer_ready(self, model: str) -> bool:
        """Whether the model's tokenizer load has finished (with a tokenizer or none)."""
        return model in self._tokenizers

    # --- requests ----------------------------------------------------------------------

    async def _tokenizer(self, model: str) -> PromptTokenizer | None:
        """The model's tokenizer, loaded once on the worker thread (an HF tokenizer takes
        a while); None without one (no node of the model known yet: decided again later).
        Requests that arrive while it loads wait for that one load: a load each would queue
        on the serial worker ahead of every prompt's tokenization (a burst of N first
        requests would wait N loads)."""
        if model in self._tokenizers:
            return self._tokenizers[model]
        pending = self._loading.get(model) or self._start_load(model)
        # shielded: one waiter's cancellation must not cancel the load the others wait for
        return await asyncio.shield(pending)

    def _start_load(self, model: str) -> asyncio.Future[PromptTokenizer | None]:
        pending = asyncio.ensure_future(self._load(model))
        self._loading[model] = pending
        pending.add_done_callback(lambda _f: self._loading.pop(model, None))
        return pending

    async def _load(self, model: str) -> PromptTokenizer | None:
        spec = self._specs.get(model, "")
        if not spec and self._engine_of is not None:
            engine = self._engine_of(model)
            if not engine:
                return None
            spec = "sim" if engine == "sim" else ""
        tok: PromptTokenizer | None = None
        if spec:
            try:
                tok = await self._thread().run(load_tokenizer, spec)
            except Exception:  # noqa: BLE001 - a missing tokenizer disables locality only
                log.warning("no prefix tokenizer for %s (%s): no prefix locality", model, spec,
                            exc_info=True)
        self._tokenizers[model] = tok
        return tok

    def _thread(self) -> SerialWorker:
        if self._worker is None:
            self._worker = SerialWorker("gpumesh-prefix-tokenize")
        return self._worker

    async def hashes(self, req: inference_pb2.GenerateRequest, model: str
                     ) -> tuple[int, tuple[int, ...]]:
        """(the prompt's exact token count, its block hashes); (0, ()) when locality is off or
        there is no tokenizer for the model."""
        if not self.enabled:
            return 0, ()
        kind = req.WhichOneof("prompt")
        limit = self.max_prompt_blocks
        seed = namespace_seed(req.adapter)   # an adapter's blocks are its own
        if kind == "token_ids":
            ids = req.token_ids.ids
            return len(ids), tuple(block_hashes(ids, BLOCK_SIZE, seed, limit))
        if kind not in ("text", "chat"):
            return 0, ()
        tok = await self._tokenizer(model)
        if tok is None:
            return 0, ()
        if kind == "text":
            text = req.text
            return await self._thread().run(_hash_text, tok, text, seed, limit,
                                            inline=len(text) < INLINE_PROMPT_CHARS)
        messages = [(m.role, m.content) for m in req.chat.messages]
        chars = sum(len(r) + len(c) for r, c in messages)
        return await self._thread().run(_hash_chat, tok, messages, seed, limit,
                                        inline=chars < INLINE_PROMPT_CHARS)

    def annotate(self, info: RequestInfo) -> RequestInfo:
        """``info`` with ``cached_tokens`` filled from the model's index (unchanged when it
        has no hashes or no node holds any of them)."""
        if not info.prefix_hashes or not self.enabled:
            return info
        ix = self.indexes.get(info.model)
        if ix is None:
            return info
        depth = ix.match(info.prefix_hashes, self.clock())
        if not depth:
            return info
        cached = MappingProxyType({n: min(d * BLOCK_SIZE, info.prompt_tokens)
                                   for n, d in depth.items()})
        return replace(info, cached_tokens=cached)

    def routed(self, info: RequestInfo, node_id: str) -> None:
        """The router sent this prompt to ``node_id``: an approximate record for a node
        without events, a pending one (until its events confirm it) for a node with them;
        ``precise`` mode records nothing for a node without events."""
        if not info.prefix_hashes or self.mode == "off":
            return
        ix = self.indexes.model(info.model)
        if self.mode == "precise" and not ix.is_precise(node_id):
            return
        ix.add(node_id, info.prefix_hashes, self.clock(), precise=False)

    # --- node events -------------------------------------------------------------------

    def apply(self, node_id: str, update: control_pb2.KvCacheUpdate) -> str | None:
        """Mirrors one update into the model's index; returns the model when it shows a gap
        (the node must send a snapshot), else None."""
        if self.mode in ("off", "approximate"):
            return None
        if update.block_size and update.block_size != BLOCK_SIZE:
            return None   # another block size: its hashes cannot match ours
        ix = self.indexes.model(update.model)
        if update.snapshot:
            ix.replace(node_id, update.stored, update.seq)
            return None
        if ix.awaiting_snapshot(node_id):
            return None   # asked already
        if not ix.is_precise(node_id) or update.seq != ix.last_seq(node_id) + 1:
            self.gaps += 1
            ix.lost_track(node_id)
            return update.model
        ix.advance(node_id, update.seq)
        if update.cleared:
            ix.clear_node(node_id)
        if update.removed:
            ix.remove(node_id, update.removed)
        if update.stored:
            ix.add(node_id, update.stored)
        return None

    def node_left(self, node_id: str) -> None:
        self.indexes.forget(node_id)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()


def prefill_tokens(info: RequestInfo, node_id: str) -> int:
    """The prompt tokens ``node_id`` would still prefill for ``info``: its prompt less the
    prefix the node holds (what the router charges the node and tells it it charged)."""
    return max(info.prompt_tokens - info.cached_tokens.get(node_id, 0), 0)


def _hash_text(tok: PromptTokenizer, text: str, seed: int,
               limit: int) -> tuple[int, tuple[int, ...]]:
    ids = tok.encode(text)
    return len(ids), tuple(block_hashes(ids, BLOCK_SIZE, seed, limit))


def _hash_chat(tok: PromptTokenizer, messages: list[tuple[str, str]], seed: int,
               limit: int) -> tuple[int, tuple[int, ...]]:
    ids = tok.render_chat(messages)
    return len(ids), tuple(block_hashes(ids, BLOCK_SIZE, seed, limit))
