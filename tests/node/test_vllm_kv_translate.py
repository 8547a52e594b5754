"""KvEventTranslator: vLLM's KV events (its own event classes, msgpack round trip) become
gpumesh 16-token block events, chained across engine blocks of 128 tokens."""

from __future__ import annotations

import pytest

from gpumesh.kvblocks import block_hashes

kv = pytest.importorskip("vllm.distributed.kv_events")


class Sink:
    def __init__(self) -> None:
        self.held: set[int] = set()
        self.cleared_n = 0

    def stored(self, hashes: object) -> None:
        self.held.update(hashes)  # type: ignore[arg-type]

    def removed(self, hashes: object) -> None:
        self.held.difference_update(hashes)  # type: ignore[arg-type]

    def cleared(self) -> None:
        self.held.clear()
        self.cleared_n += 1


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int], **kw: object) -> object:
    return kv.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                          block_size=128, lora_id=None, medium="GPU", lora_name=None, **kw)


def roundtrip(seq: int, events: list[object]) -> list[object]:
    import msgspec

    payload = msgspec.msgpack.Encoder().encode(kv.KVEventBatch(ts=0.0, events=events))
    return msgspec.msgpack.Decoder(type=kv.KVEventBatch).decode(payload).events


def test_engine_blocks_become_gpumesh_blocks() -> None:
    from gpumesh.node.engines.vllm.kv_events import KvEventTranslator

    tokens = list(range(1, 385))
    want = block_hashes(tokens)                     # 24 blocks of 16
    sink = Sink()
    t = KvEventTranslator(sink)
    t.batch(0, roundtrip(0, [stored([b"e0", b"e1"], None, tokens[:256])]))
    t.batch(1, roundtrip(1, [stored([b"e2"], b"e1", tokens[256:384])]))
    assert sink.held == set(want)
    t.batch(2, roundtrip(2, [kv.BlockRemoved(block_hashes=[b"e2"], medium="GPU")]))
    assert sink.held == set(want[:16])
    # a block on another tier, or one keyed by an adapter, is not mirrored
    t.batch(3, roundtrip(3, [kv.BlockStored(
        block_hashes=[b"c"], parent_block_hash=None, token_ids=list(range(500, 628)),
        block_size=128, lora_id=None, medium="CPU", lora_name=None)]))
    t.batch(4, roundtrip(4, [kv.BlockStored(
        block_hashes=[b"l"], parent_block_hash=None, token_ids=list(range(700, 828)),
        block_size=128, lora_id=1, medium="GPU", lora_name="ad")]))
    assert sink.held == set(want[:16])
    # a gap in seq clears the mirror; AllBlocksCleared too
    t.batch(9, roundtrip(9, [stored([b"e0"], None, tokens[:128])]))
    assert sink.cleared_n == 1 and sink.held == set(want[:8]) and t.gaps == 1
    t.batch(10, roundtrip(10, [kv.AllBlocksCleared()]))
    assert sink.held == set() and sink.cleared_n == 2
