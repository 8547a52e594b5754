"""The model's tokenizer for a stock vLLM gRPC worker, and incremental detokenization.

A stock worker takes and answers token ids only, so the router tokenizes text and chat prompts
and detokenizes the worker's ids (``Detokenizer``: never splits a multi-byte character).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpumesh.serial_worker import INLINE_DECODE_IDS, INLINE_PROMPT_CHARS, SerialWorker


class _Decoder:
    """``decode`` on one HF tokenizer object: the text of ``ids``, special tokens skipped."""

    def __init__(self, hf: Any) -> None:
        self._hf = hf

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._hf.decode(list(ids), skip_special_tokens=True))


class Tokenizer:
    """The model's HF tokenizer (``transformers``), loaded once per worker connection.

    Two tokenizer objects, because an HF fast tokenizer must not be called concurrently
    ("Already borrowed"): the main one serves prompts and one-shot decodes, every call
    serial on its ``SerialWorker`` and the long ones off the event loop (a long prompt's
    encode would otherwise stall every stream of the router); ``stream_decoder`` (a second
    copy) serves the streams' incremental decode steps, only ever called inline on the event
    loop's thread, so a step never waits behind a long encode on the worker (the price: a
    second copy of the tokenizer in memory per worker connection). The async
    ``encode_prompt`` / ``render_chat_prompt`` / ``decode_all`` go through the worker
    (``WorkerClosed`` once the router is stopping); the sync ``encode`` / ``render_chat`` /
    ``decode`` are what they run, and what tests and scripts call.
    """

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - environment
            raise RuntimeError("foreign nodes need the `transformers` package to tokenize and "
                               "detokenize for vLLM gRPC workers") from exc
        self._tok: Any = AutoTokenizer.from_pretrained(path)
        self._decoder = _Decoder(self._tok)
        self.stream_decoder = _Decoder(AutoTokenizer.from_pretrained(path))
        self._worker = SerialWorker("gpumesh-foreign-tokenize")

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        rendered = self._tok.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages], tokenize=False,
            add_generation_prompt=True)
        return list(self._tok.encode(rendered, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._decoder.decode(ids)

    async def encode_prompt(self, text: str) -> list[int]:
        return await self._worker.run(self.encode, text, inline=len(text) < INLINE_PROMPT_CHARS)

    async def render_chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        chars = sum(len(r) + len(c) for r, c in messages)
        return await self._worker.run(self.render_chat, messages, inline=chars < INLINE_PROMPT_CHARS)

    async def decode_all(self, ids: Sequence[int]) -> str:
        return await self._worker.run(self.decode, ids, inline=len(ids) < INLINE_DECODE_IDS)

    def close(self) -> None:
        self._worker.close()


class Detokenizer:
    """Incremental detokenization: emits the text added since the last call, holding back a
    trailing incomplete UTF-8 character (U+FFFD) until the next ids complete it (or the end).
    The deltas concatenate to ``tok.decode(all_ids)`` (special tokens skipped) for byte-level
    BPE tokenizers. Each ``push`` costs O(ids since the last fully emitted push), not O(all).

    Why a window over ``tok.decode`` rather than ``tokenizers.decoders.DecodeStream``: it uses
    the same ``decode`` as a one-shot detokenization (skip_special_tokens, transformers'
    clean-up), works for any HF tokenizer (DecodeStream needs a fast one, and only recent
    ``tokenizers``, which pyproject does not pin), and it still emits the complete text
    before a trailing incomplete character as soon as it has it. It is vLLM's
    ``detokenize_incrementally`` / HF ``TextStreamer`` scheme: the window starts at the ids
    of the last push that decoded cleanly, kept as context (a SentencePiece decoder strips the
    first token's leading space), and ``_sent`` counts the window's characters already out.
    """

    def __init__(self, tok: Tokenizer | _Decoder) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._start = 0   # the window: ids[_start:]
        self._read = 0    # ids[:_read] are out in full (the window slides to here)
        self._sent = 0    # characters of decode(ids[_start:]) already emitted

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        self._ids.extend(ids)
        text = self._tok.decode(self._ids[self._start:])
        end = len(text) if final else len(text.rstrip("\ufffd"))
        delta = text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        if end == len(text) and len(self._ids) > self._read:
            # All out, no character pending: slide the window to the ids since the last slide.
            if self._read > self._start:
                self._start = self._read
                text = self._tok.decode(self._ids[self._start:])
            self._read, self._sent = len(self._ids), len(text)
        return delta
