"""One worker thread for the calls into one resource that must not be called concurrently
(a tokenizer), so that the long calls do not stall the asyncio event loop.

Users: the node's prompt encoder (prompt tokenization, one per node) and the router's
tokenizers (``gpumesh.router.tokenizers``: prompt tokenization and hashing for prefix locality,
tokenization and detokenization for stock vLLM gRPC workers; one per tokenizer loaded). The caller decides whether a call is short (the thresholds below, set for HF fast
tokenizers); a short call runs inline on the loop, but only while the thread is
idle, so calls into the resource stay serial whichever way they run.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar, TypeVarTuple

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")

# Prompts shorter than this (characters; for a chat, the roles and contents together) are
# tokenized inline on the event loop, longer ones on the worker thread. Why a threshold: the
# hop to the thread costs about as much loop time as encoding a short prompt (the wake-up and
# the encode's GIL-held Python parts), so short prompts gain nothing there, while a long one
# inline stalls every other stream on the loop. At about this size an HF fast tokenizer's
# inline encode costs the loop as much as a few hops (docs/benchmarks.md, "Do
# long prompts stall other streams?").
INLINE_PROMPT_CHARS = 1000

# Token ids fewer than this are decoded (one-shot, skipping special tokens) inline, more on
# the worker thread: a decode of this many ids stalls the loop about as long as an encode of
# INLINE_PROMPT_CHARS. An incremental decode step (a few ids) is always short.
INLINE_DECODE_IDS = 1500


class WorkerClosed(RuntimeError):
    """``SerialWorker.run`` after ``close()``: the process is stopping."""


class SerialWorker:
    """Runs blocking calls one at a time: on one dedicated thread, or inline when short.

    ``run(fn, *args, inline=...)``: with ``inline=True`` the call runs on the event loop if no
    call is running (a non-blocking lock), else it queues for the thread like a long one. The
    thread takes the same lock, so two calls never overlap. Meant for calls that release the
    GIL while they work (a Rust tokenizer), so the loop serves other tasks meanwhile.

    Cancelling the awaiting task drops a call that has not started; one that has finishes on
    the thread and its result is discarded. ``fn``'s errors reach the caller unchanged and the
    thread keeps serving; ``WorkerClosed`` for a call that needs the thread after ``close()``.
    """

    def __init__(self, thread_name: str = "gpumesh-serial") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._serial = threading.Lock()

    async def run(self, fn: Callable[[*_Ts], _T], *args: *_Ts,
                  inline: bool = False) -> _T:
        if inline and self._serial.acquire(blocking=False):
            try:
                return fn(*args)
            finally:
                self._serial.release()
        try:
            call = asyncio.get_running_loop().run_in_executor(self._pool, self._locked, fn, *args)
        except RuntimeError as exc:  # the pool is shut down
            raise WorkerClosed("worker thread closed") from exc
        return await call

    def _locked(self, fn: Callable[[*_Ts], _T], *args: *_Ts) -> _T:
        with self._serial:
            return fn(*args)

    def close(self) -> None:
        """Refuse new thread calls; the thread ends after the calls already queued.
        Idempotent."""
        self._pool.shutdown(wait=False)
