"""``PromptEncoder``: the node's one way to call an engine's tokenizer from the event loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from gpumesh.node.engines.base import Engine, EngineUnavailable
from gpumesh.serial_worker import INLINE_PROMPT_CHARS, SerialWorker, WorkerClosed

_T = TypeVar("_T")
_A = TypeVar("_A")


class PromptEncoder:
    """Runs an engine's ``tokenize`` / ``render_chat`` off the event loop.

    One per node, shared by its services (``gpumesh.node.app`` wires it; both servicers call
    it per request): one dedicated worker thread (``gpumesh.serial_worker.SerialWorker``),
    because an HF fast tokenizer is not meant for concurrent calls ("RuntimeError: Already
    borrowed") and vLLM keeps its own tokenization serial the same way. The tokenizer releases
    the GIL while it encodes, so the loop keeps serving other streams meanwhile. Prompts under
    ``inline_chars`` run inline (``gpumesh.serial_worker.INLINE_PROMPT_CHARS`` says why), but
    only while the thread is idle: a lock keeps the calls serial.

    Cancelling the awaiting task drops a call that has not started; one that has finishes on
    the thread and its result is discarded. Errors are the engine's, unchanged;
    ``EngineUnavailable`` after ``close()``.
    """

    def __init__(self, engine: Engine, inline_chars: int = INLINE_PROMPT_CHARS) -> None:
        self._engine = engine
        self._inline_chars = inline_chars
        self._worker = SerialWorker("gpumesh-tokenize")

    async def tokenize(self, text: str) -> list[int]:
        return await self._call(len(text), self._engine.tokenize, text)

    async def render_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        chars = sum(len(role) + len(content) for role, content in messages)
        return await self._call(chars, self._engine.render_chat, messages)

    async def _call(self, chars: int, fn: Callable[[_A], _T], arg: _A) -> _T:
        try:
            return await self._worker.run(fn, arg, inline=chars < self._inline_chars)
        except WorkerClosed as exc:  # the node is stopping
            raise EngineUnavailable("node is shutting down") from exc

    def close(self) -> None:
        """Refuse new calls; the thread ends after the calls already queued. Idempotent."""
        self._worker.close()
