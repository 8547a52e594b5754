"""The fidelity check's traces: one request list that both the live fleet and the simulator
run (``gpumesh sim validate``).

Two workloads with the same length distributions:

- ``shared-prefix``: ``tenants`` tenants, each with a system prompt of ``system_tokens``
  tokens (a multiple of the 16-token KV block); a request is its tenant's system prompt (the
  tenant drawn with Zipf(1) popularity) followed by a user part of its own (lognormal,
  median 48 tokens, 8..512);
- ``unique``: the same arrivals and lengths (system_tokens + the user part), every token the
  request's own: no two prompts share a block.

Outputs: lognormal, median 16 tokens, 4..128, always generated in full (``ignore_eos``).
Arrivals: Poisson at ``rate`` requests per second.

The simulator gets each prompt's block structure (``Arrival.blocks``: one id per full block,
equal id = equal block with equal content before it); the live fleet gets token ids built
from the same structure: a block's 16 ids come from an RNG seeded by the block's id, the
partial tail block from one seeded by the request, so equal block chains are equal token
prefixes and nothing else is shared.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from gpumesh_bench.sim.workloads import BLOCK, Arrival, Workload

KINDS = ("shared-prefix", "unique")
_ID_LO = 10   # token ids drawn from [_ID_LO, vocab - 1): clear of special tokens at 0..9


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(median * math.exp(sigma * rng.gauss(0.0, 1.0)))))


def build(kind: str, n: int, rate: float, seed: int = 1, tenants: int = 16,
          system_tokens: int = 512, salt: int = 0) -> Workload:
    """``n`` requests of workload ``kind`` at ``rate`` req/s (module docstring). ``salt``
    (0..4095) changes the block ids, so the token contents, and nothing else: two salts are
    the same trace that shares no cached block with the other."""
    if kind not in KINDS:
        raise ValueError(f"unknown fidelity workload {kind!r}; choose one of {KINDS}")
    if n < 1 or rate <= 0 or tenants < 1 or system_tokens % BLOCK or not 0 <= salt < 4096:
        raise ValueError("n >= 1, rate > 0, tenants >= 1, system_tokens a multiple of 16, "
                         "0 <= salt < 4096")
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) for k in range(tenants)]
    t = 0.0
    out: list[Arrival] = []
    for i in range(n):
        t += rng.expovariate(rate)
        user = _lognormal(rng, 48, 0.8, 8, 512)
        output = _lognormal(rng, 16, 0.7, 4, 128)
        tenant = rng.choices(range(tenants), weights)[0]   # drawn for both: same lengths
        prompt = system_tokens + user
        full = prompt // BLOCK
        if kind == "shared-prefix":
            head = [(salt << 48) | (tenant << 24) | j for j in range(system_tokens // BLOCK)]
        else:
            head = []
        own = [(1 << 62) | (salt << 48) | (i << 12) | j for j in range(full - len(head))]
        out.append(Arrival(i, t, prompt, output, tuple(head + own)))
    return Workload(kind, out, [])


def token_ids(a: Arrival, vocab_size: int, seed: int = 1) -> list[int]:
    """The prompt's token ids (module docstring): ``a.prompt_tokens`` ids."""
    hi = vocab_size - 1
    ids: list[int] = []
    for b in a.blocks:
        r = random.Random(b)
        ids += [r.randrange(_ID_LO, hi) for _ in range(BLOCK)]
    r = random.Random((seed << 32) ^ (a.index + 7) * 2654435761)
    ids += [r.randrange(_ID_LO, hi) for _ in range(a.prompt_tokens - len(ids))]
    return ids


def save(w: Workload, path: Path) -> None:
    """The trace in ``gpumesh sim`` JSONL form (``workloads.load_trace`` reads it back)."""
    with open(path, "w", encoding="utf-8") as f:
        for a in w.arrivals:
            f.write(json.dumps({"arrival_s": round(a.arrival_s, 6), "prompt_tokens":
                                a.prompt_tokens, "max_tokens": a.output_tokens,
                                "blocks": list(a.blocks)}) + "\n")
