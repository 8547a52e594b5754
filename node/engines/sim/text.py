"""The simulator's deterministic text: a fixed word list its token ids render to (with
multi-byte characters, so streaming code sees them) and a BPE-like tokenizer for prompts."""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence

from gpumesh.node.engines.sim.config import VOCAB_SIZE

EOS_TOKEN_ID = VOCAB_SIZE  # outside the sampled range, so it is never drawn by accident

_SYLLABLES = ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "an", "el", "or", "us", "in", "ve")
_MULTIBYTE = (" café", " naïve", " über", " 東京", " 日本語", " →", " 🙂", " Ωmega", " żółw", " ½")


def _build_words() -> tuple[str, ...]:
    words: list[str] = []
    n = len(_SYLLABLES)
    for i in range(1024):
        if i % 41 == 7:
            words.append(_MULTIBYTE[(i // 41) % len(_MULTIBYTE)])
            continue
        w = _SYLLABLES[i % n] + _SYLLABLES[(i // n) % n]
        if i % 3 == 0:
            w += _SYLLABLES[(i * 7) % n]
        words.append(("." if i % 97 == 5 else "") + " " + w)
    return tuple(words)


WORDS = _build_words()
NWORDS = len(WORDS)


def detokenize(token_ids: Sequence[int], eos: int = EOS_TOKEN_ID) -> str:
    """The simulator's text for generated ids (EOS renders as nothing)."""
    return "".join([WORDS[t % NWORDS] for t in token_ids if t != eos])


# Whitespace then up to four non-space characters: ~1 token per short word, ~4 chars per
# token in longer ones, so a benchmark's prompt lengths come out close to what a BPE gives.
_PIECE = re.compile(r"\s*\S{1,4}|\s+")


class SimTokenizer:
    """Text -> ids: one id per piece (see ``_PIECE``), a CRC of the piece modulo the vocab."""

    __slots__ = ("_memo", "_vocab")

    def __init__(self, vocab_size: int = VOCAB_SIZE) -> None:
        self._memo: dict[str, int] = {}
        self._vocab = vocab_size

    def encode(self, text: str) -> list[int]:
        memo = self._memo
        out: list[int] = []
        for piece in _PIECE.findall(text):
            tid = memo.get(piece)
            if tid is None:
                tid = zlib.crc32(piece.encode()) % self._vocab
                if len(memo) < 200_000:
                    memo[piece] = tid
            out.append(tid)
        return out
