"""The one prefix-block hash shared by nodes and routers (prefix-cache locality).

A prompt's KV cache is kept in blocks of ``block_size`` tokens (16, vLLM's default). Each FULL
block gets a 64-bit hash chained over its parent's, as vLLM's automatic prefix caching does::

    h_0 = H(seed || tokens[0:16]),  h_i = H(h_{i-1} || tokens[16 i : 16 (i+1)])

so equal hashes mean equal prefixes, and the number of leading hashes a node holds is the
length of the prefix it need not prefill again. H is BLAKE2b with an 8-byte digest over the
parent's 8 bytes and the block's token ids as little-endian uint32; ``seed`` separates
namespaces (e.g. a LoRA adapter, 0 for the base model).

The vLLM engine's own hashes (``BlockStored.block_hashes``) depend on a per-process seed; a
node re-hashes the token ids those events carry with this function, so a router never needs
the engine's hash, only the model's tokenizer and this module. The simulated engine uses it
directly. A trailing partial block is never hashed (vLLM caches full blocks only).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

BLOCK_SIZE = 16
_MASK = (1 << 64) - 1


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of one full block whose parent block hashes to ``parent`` (the seed for the
    first block). Token ids must be in [0, 2**32)."""
    h = blake2b((parent & _MASK).to_bytes(8, "little"), digest_size=8)
    h.update(array("I", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def namespace_seed(adapter: str) -> int:
    """The ``seed`` of a request's chain: 0 for the base model, a hash of the name for a LoRA
    adapter (vLLM keys an adapter's blocks apart from the base model's, so a prefix computed
    under one adapter is no hit for another or for the base model)."""
    if not adapter:
        return 0
    digest = blake2b(b"lora\0" + adapter.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def block_hashes(token_ids: Sequence[int], block_size: int = BLOCK_SIZE, seed: int = 0,
                 limit: int = 0) -> list[int]:
    """The chained hashes of ``token_ids``' full blocks, in order (``limit`` > 0: at most
    that many, the first ones). Costs about a microsecond per block."""
    n = len(token_ids) // block_size
    if limit > 0:
        n = min(n, limit)
    out: list[int] = []
    parent = seed
    ids = array("I", token_ids[:n * block_size])
    raw = ids.tobytes()
    step = block_size * 4
    for i in range(n):
        h = blake2b(parent.to_bytes(8, "little"), digest_size=8)
        h.update(raw[i * step:(i + 1) * step])
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out
