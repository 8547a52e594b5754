"""Prefix locality: which node already holds a request's prompt prefix in its KV cache.

``PrefixLocality`` is the router's one entry point for it:

- ``hashes(request, model)``: the prompt's token count and block hashes
  (``gpumesh.kvblocks``), as the engine computes them. Token-id prompts are hashed directly;
  text and chat prompts are tokenized with the model's prompt tokenizer from the router's
  ``RouterTokenizers`` (``router.tokenizers``: ``prefix_tokenizers``, ``sim`` for simulated
  nodes without configuration; loaded when the model first registers), and tokenized and
  hashed on that tokenizer's worker thread for a long prompt so the event loop never waits.
  No tokenizer: no hashes (locality plays no part for that request).
- ``annotate(info)``: the request's ``cached_tokens`` per node from the model's
  ``PrefixIndex``: what the expected-wait scorer subtracts from the prefill each node would
  still do.
- ``prefill_tokens(info, node_id)``: the prompt less what the node holds: what the router
  charges that node for the request (its credit, and the CHARGED_TOKENS it tells the node).
- ``routed(info, node_id)``: the router's record of where it sent which prefix: approximate
  entries for nodes that stream no KV events (every node in ``approximate`` mode), pending
  ones on nodes that do, until their events confirm them (``PrefixIndex``).
- ``apply(node_id, update)``: a node's ``KvCacheUpdate`` (precise mode). Returns the model
  whose updates have a gap (the caller asks that node for a snapshot), else None. An update
  of a newer engine epoch first drops the node's blocks; one of an older epoch is ignored.
- ``engine_epoch(node_id, epoch)``: a heartbeat's ``LoadReport.engine_epoch``: a newer one
  drops the node's blocks at once (an engine restart or prefix-cache reset).

Modes (``prefix_locality``): ``auto`` (precise for nodes that stream events, approximate for
the others), ``precise`` (events only), ``approximate`` (records only, events ignored),
``off``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from types import MappingProxyType

from gpumesh.kvblocks import BLOCK_SIZE, block_hashes, namespace_seed
from gpumesh.router.fleet.prefix_index import PrefixIndex, PrefixIndexes
from gpumesh.router.scheduling.types import RequestInfo
from gpumesh.router.tokenizers import PromptTokenizer, RouterTokenizers, chat_chars
from gpumesh.serial_worker import INLINE_PROMPT_CHARS
from gpumesh.v1 import control_pb2, inference_pb2

MODES = ("auto", "precise", "approximate", "off")


class IndexedTokens(Mapping[str, int]):
    """``RequestInfo.indexed_tokens``: node id -> tokens the index holds for it, read from
    the index when asked (a decision reads its candidates' only, not the whole fleet's)."""

    __slots__ = ("_ix",)

    def __init__(self, ix: PrefixIndex) -> None:
        self._ix = ix

    def __getitem__(self, node_id: str) -> int:
        blocks = self._ix.known_blocks(node_id)
        if blocks is None:
            raise KeyError(node_id)
        return blocks * BLOCK_SIZE

    def get(self, node_id: str, default: int | None = None) -> int | None:  # type: ignore[override]
        blocks = self._ix.known_blocks(node_id)   # the decision's path: no KeyError raised
        return default if blocks is None else blocks * BLOCK_SIZE

    def __iter__(self) -> Iterator[str]:
        return iter(self._ix.nodes())

    def __len__(self) -> int:
        return len(self._ix.nodes())


class PrefixLocality:
    """See the module docstring. ``clock``: monotonic seconds (approximate entries' age);
    ``tokenizers``: the router's (None: token-id prompts only)."""

    def __init__(self, mode: str, indexes: PrefixIndexes, clock: Callable[[], float],
                 tokenizers: RouterTokenizers | None = None,
                 max_prompt_blocks: int = 2048) -> None:
        if mode not in MODES:
            raise ValueError(f"prefix_locality must be one of {MODES}, not {mode!r}")
        self.mode = mode
        self.indexes = indexes
        self.clock = clock
        self.tokenizers = tokenizers
        self.max_prompt_blocks = max_prompt_blocks
        self.gaps = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    # --- requests ----------------------------------------------------------------------

    async def hashes(self, req: inference_pb2.GenerateRequest, model: str
                     ) -> tuple[int, tuple[int, ...]]:
        """(the prompt's exact token count, its block hashes); (0, ()) when locality is off or
        there is no tokenizer for the model."""
        if not self.enabled:
            return 0, ()
        kind = req.WhichOneof("prompt")
        limit = self.max_prompt_blocks
        seed = namespace_seed(req.adapter)   # an adapter's blocks are its own
        if kind == "token_ids":
            ids = req.token_ids.ids
            return len(ids), tuple(block_hashes(ids, BLOCK_SIZE, seed, limit))
        if kind not in ("text", "chat"):
            return 0, ()
        tok = await self.tokenizers.prompt_tokenizer(model) if self.tokenizers else None
        if tok is None:
            return 0, ()
        if kind == "text":
            text = req.text
            return await tok.call(_hash_text, tok, text, seed, limit,
                                  inline=len(text) < INLINE_PROMPT_CHARS)
        messages = [(m.role, m.content) for m in req.chat.messages]
        return await tok.call(_hash_chat, tok, messages, seed, limit,
                              inline=chat_chars(messages) < INLINE_PROMPT_CHARS)

    def annotate(self, info: RequestInfo) -> RequestInfo:
        """``info`` with ``cached_tokens`` filled from the model's index (unchanged when it
        has no hashes or no node holds any of them)."""
        if not info.prefix_hashes or not self.enabled:
            return info
        ix = self.indexes.get(info.model)
        if ix is None:
            return info
        depth = ix.match(info.prefix_hashes, self.clock())
        if not depth:
            return info
        cached = MappingProxyType({n: min(d * BLOCK_SIZE, info.prompt_tokens)
                                   for n, d in depth.items()})
        return replace(info, cached_tokens=cached, indexed_tokens=IndexedTokens(ix))

    def routed(self, info: RequestInfo, node_id: str) -> None:
        """The router sent this prompt to ``node_id``: an approximate record for a node
        without events, a pending one (until its events confirm it) for a node with them;
        ``precise`` mode records nothing for a node without events."""
        if not info.prefix_hashes or self.mode == "off":
            return
        ix = self.indexes.model(info.model)
        if self.mode == "precise" and not ix.is_precise(node_id):
            return
        ix.add(node_id, info.prefix_hashes, self.clock(), precise=False)

    # --- node events -------------------------------------------------------------------

    def apply(self, node_id: str, update: control_pb2.KvCacheUpdate) -> str | None:
        """Mirrors one update into the model's index; returns the model when it shows a gap
        (the node must send a snapshot), else None."""
        if self.mode in ("off", "approximate"):
            return None
        if update.block_size and update.block_size != BLOCK_SIZE:
            return None   # another block size: its hashes cannot match ours
        ix = self.indexes.model(update.model)
        if not ix.observe_epoch(node_id, update.epoch):
            return None   # sent before the engine restarted or reset: no longer true
        if update.snapshot:
            ix.replace(node_id, update.stored, update.seq)
            return None
        if ix.awaiting_snapshot(node_id):
            return None   # asked already
        if not ix.is_precise(node_id) or update.seq != ix.last_seq(node_id) + 1:
            self.gaps += 1
            ix.lost_track(node_id)
            return update.model
        ix.advance(node_id, update.seq)
        if update.cleared:
            ix.clear_node(node_id)
        if update.removed:
            ix.remove(node_id, update.removed)
        if update.stored:
            ix.add(node_id, update.stored)
        return None

    def engine_epoch(self, node_id: str, epoch: int) -> None:
        """A heartbeat's engine epoch (0 = the node reports none)."""
        if epoch and self.enabled:   # approximate records of a reset engine are wrong too
            self.indexes.observe_epoch(node_id, epoch)

    def node_left(self, node_id: str) -> None:
        self.indexes.forget(node_id)


def prefill_tokens(info: RequestInfo, node_id: str) -> int:
    """The prompt tokens ``node_id`` would still prefill for ``info``: its prompt less the
    prefix the node holds (what the router charges the node and tells it it charged)."""
    return max(info.prompt_tokens - info.cached_tokens.get(node_id, 0), 0)


def _hash_text(tok: PromptTokenizer, text: str, seed: int,
               limit: int) -> tuple[int, tuple[int, ...]]:
    ids = tok.encode(text)
    return len(ids), tuple(block_hashes(ids, BLOCK_SIZE, seed, limit))


def _hash_chat(tok: PromptTokenizer, messages: list[tuple[str, str]], seed: int,
               limit: int) -> tuple[int, tuple[int, ...]]:
    ids = tok.render_chat(messages)
    return len(ids), tuple(block_hashes(ids, BLOCK_SIZE, seed, limit))
