"""One simulated request (its prompt, sampling limits, tokens so far, KV blocks and the future
its stream waits on) and one scheduled step: the values the sim scheduler moves around."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass

from gpumesh.node.engines.base import Finish
from gpumesh.profiles import prefill_pairs


class SimRequest:
    """One request's progress in the simulated engine (its ids, KV blocks and consumer)."""

    __slots__ = (
        "blocks",
        "cached",
        "computed",
        "eos_p",
        "finish",
        "hashes",
        "hold",
        "id",
        "keep_kv",
        "max_out",
        "out",
        "prompt_len",
        "remote",
        "rng",
        "sent",
        "stop",
        "text",
        "text_sent",
        "upto",
        "waiter",
    )

    def __init__(self, rid: str, prompt_len: int, max_out: int, rng: random.Random,
                 eos_p: float, stop: tuple[str, ...], hashes: tuple[int, ...] = (), *,
                 remote: bool = False, keep_kv: bool = False) -> None:
        self.id = rid
        # disaggregated serving (transfer.py): ``remote`` = its prompt's KV comes from another
        # engine (the engine computes only the last prompt token); ``keep_kv`` = its KV stays
        # after it finishes, until the driver releases it (the KV another engine reads)
        self.remote = remote
        self.keep_kv = keep_kv
        # prefix caching (prefix_cache.py): the prompt's full-block hashes, those this request
        # holds a cache reference on (counted in ``blocks`` too), blocks looked at so far
        self.hashes = hashes
        self.cached: list[int] = []
        self.upto = 0
        self.prompt_len = prompt_len
        self.max_out = max_out
        self.rng = rng
        self.eos_p = eos_p
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1  # chars held back for stops
        self.out: list[int] = []  # generated ids
        self.sent = 0  # ids delivered
        self.text = ""  # full text, kept only when there are stop strings
        self.text_sent = 0
        self.computed = 0  # tokens whose KV is computed
        self.blocks = 0
        self.finish: Finish | None = None
        self.waiter: asyncio.Future[None] | None = None


@dataclass(frozen=True)
class SimStep:
    """One scheduled step: (request, tokens) pairs, its decode / prefill token counts and its
    simulated duration (seconds, before ``time_scale``)."""

    scheduled: list[tuple[SimRequest, int]]
    decode_tokens: int
    prefill_tokens: int
    duration_s: float


def attention_context(scheduled: Sequence[tuple[SimRequest, int]]) -> tuple[int, int]:
    """What a step's scheduled tokens attend to, before the step runs (each request's
    ``computed`` tokens are those before it): the decoding sequences' lengths summed and the
    (token, earlier token) pairs of its prefill chunks (``gpumesh.profiles``' context
    terms)."""
    decode_context = pairs = 0
    for req, n in scheduled:
        if n == 1 and req.out:
            decode_context += req.computed + 1
        else:
            pairs += prefill_pairs(req.computed, n)
    return decode_context, pairs
