"""The simulator's deterministic text: a fixed word list its token ids render to (with
multi-byte characters, so streaming code sees them). Its prompt tokenizer, ``SimTokenizer``,
is in the core (``gpumesh.sim_tokenizer``: a router computes the same ids)."""

from __future__ import annotations

from collections.abc import Sequence

from gpumesh.node.engines.base import Finish
from gpumesh.node.engines.sim.config import VOCAB_SIZE
from gpumesh.node.engines.sim.request import SimRequest
from gpumesh.sim_tokenizer import SimTokenizer

__all__ = ["EOS_TOKEN_ID", "NWORDS", "WORDS", "SimTokenizer", "check_stop", "detokenize"]

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


def check_stop(req: SimRequest, tid: int) -> None:
    """Appends token ``tid``'s text to ``req`` and, when one of its stop strings appears
    (looking back only as far as one could straddle the last token), cuts the text there and
    finishes the request (``Finish.STOP``)."""
    start = max(0, len(req.text) - req.hold)
    req.text += WORDS[tid % NWORDS]
    best = -1
    for s in req.stop:
        k = req.text.find(s, start)
        if k != -1 and (best == -1 or k < best):
            best = k
    if best != -1:
        req.text = req.text[:best]
        req.finish = Finish.STOP
