"""router.backends.vllm_grpc.Detokenizer on the real tiny-model tokenizer (byte-level BPE,
like Qwen's):
random chunkings of real multi-byte text, with special tokens mixed in, detokenize to exactly
the one-shot decode; no delta but the last ends in a held-back U+FFFD; and the work per push
stays proportional to the new ids (the old one re-decoded everything each time)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from gpumesh.router.backends.vllm_grpc import Detokenizer, Tokenizer

TEXTS = [
    "The mesh routes tokens to nodes.",
    "héllo wörld, ça va? Ünïcödé àccents: ñ, ø, ß, œ.",
    "中文分词测试：路由器把请求发给节点。日本語のテキストも。한국어 텍스트.",
    "emoji 😀🚀👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and 🧪 mixed with text 🎉!",
    "math ∑∫√∞ ≠ ≤ ≥ and symbols € £ ¥ ₹ ™ © ® → ←",
    "\ufffd literal replacement char, then more text",
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(str(tiny_model_dir))


def _chunks(ids: Sequence[int], rng: random.Random, max_size: int) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_size)
        out.append(list(ids[i:i + n]))
        i += n
    return out


def _stream(tok: Tokenizer, chunks: list[list[int]]) -> list[str]:
    d = Detokenizer(tok)
    deltas = [d.push(c) for c in chunks]
    deltas.append(d.push((), final=True))
    return deltas


def _check(tok: Tokenizer, ids: list[int], chunks: list[list[int]]) -> None:
    deltas = _stream(tok, chunks)
    assert "".join(deltas) == tok.decode(ids)
    for delta in deltas[:-1]:
        assert not delta.endswith("\ufffd"), (deltas, ids)


@pytest.mark.parametrize("max_chunk", [1, 2, 3, 5, 16])
def test_random_chunkings_match_the_one_shot_decode(tok, max_chunk):
    rng = random.Random(max_chunk)
    specials = tok._tok.all_special_ids
    assert specials
    for trial in range(60):
        text = " ".join(rng.sample(TEXTS, rng.randint(1, len(TEXTS))))
        ids = tok.encode(text)
        # Special tokens anywhere, even between the bytes of one character: skipped.
        for _ in range(rng.randint(0, 6)):
            ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        chunks = [[i] for i in ids] if trial % 3 == 0 else _chunks(ids, rng, max_chunk)
        _check(tok, ids, chunks)


def test_random_ids_from_the_whole_vocab(tok):
    """Not valid text at all (stray UTF-8 bytes): still the one-shot decode."""
    rng = random.Random(7)
    vocab = len(tok._tok)
    for trial in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        _check(tok, ids, _chunks(ids, rng, 1 + trial % 4))


def test_a_split_character_is_held_back_until_completed(tok):
    ids = tok.encode("a😀b")
    assert len(ids) >= 5  # "a", four byte tokens for the emoji (in the tiny vocab), "b"
    d = Detokenizer(tok)
    out = [d.push([i]) for i in ids]
    assert out[0] == "a"
    assert "".join(out) == "a😀b" and "😀" in out
    assert all(o in ("", "a", "😀", "b") for o in out)
    # Ending inside a character: the end flushes the U+FFFD.
    d = Detokenizer(tok)
    assert d.push(tok.encode("x😀")[:-1]) == "x"
    assert d.push((), final=True) == "\ufffd"


class _CountingTok:
    """Instrumentation over the real tokenizer: how many ids each push decodes."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.decoded = 0

    def decode(self, ids: Sequence[int]) -> str:
        self.decoded += len(ids)
        return self._tok.decode(ids)


def test_work_per_push_is_proportional_to_the_new_ids(tok):
    ids = (tok.encode(" ".join(TEXTS)) * 40)[:2000]
    counting = _CountingTok(tok)
    d = Detokenizer(counting)  # type: ignore[arg-type]
    text = "".join(d.push([i]) for i in ids) + d.push((), final=True)
    assert text == tok.decode(ids)
    # A window of a few pushes per step (~3 decodes of <= a held-back character's ids), not
    # the whole stream (2,000 pushes re-decoding everything: ~2M ids).
    assert counting.decoded < 12 * len(ids), counting.decoded
