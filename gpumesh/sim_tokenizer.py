"""The simulated engine's prompt tokenizer and chat template.

A simulated node (``gpumesh.node.engines.sim``) computes its prompts' token ids with it, and a
router computes the same ids (for a ``sim`` prefix tokenizer, ``gpumesh.router.tokenizers``)
to hash a prompt's blocks as the node's cache holds them; so it lives in the core, which both
import.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence

SIM_VOCAB_SIZE = 32_000   # the simulated engine's default vocabulary (SimEngineConfig)

# Whitespace then up to four non-space characters: ~1 token per short word, ~4 chars per
# token in longer ones, so a benchmark's prompt lengths come out close to what a BPE gives.
_PIECE = re.compile(r"\s*\S{1,4}|\s+")


class SimTokenizer:
    """Text -> ids: one id per piece (see ``_PIECE``), a CRC of the piece modulo the vocab;
    a chat renders in the ChatML template (``<|im_start|>role ... <|im_end|>``) and is
    encoded the same way."""

    __slots__ = ("_memo", "_vocab")

    def __init__(self, vocab_size: int = SIM_VOCAB_SIZE) -> None:
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

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        parts = [f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages]
        parts.append("<|im_start|>assistant\n")
        return self.encode("".join(parts))
