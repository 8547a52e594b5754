"""Incremental detokenization of a stock vLLM gRPC worker's streamed ids.

A stock worker takes and answers token ids only, so the router tokenizes text and chat prompts
(``router.tokenizers``) and detokenizes the worker's ids here (``Detokenizer``: never splits a
multi-byte character).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Decodes(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


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

    def __init__(self, tok: _Decodes) -> None:
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
