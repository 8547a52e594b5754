"""One worker thread for the calls into one resource that must not be called concurrently
(a tokenizer), so that the long calls do not stall the asyncio event loop.

Users: ``node.engine.PromptEncoder`` (prompt tokenization, one per node) and
``router.foreign.Tokenizer`` (tokenization and detokenization for a vLLM gRPC worker, one per
worker connection). The caller decides whether a call is short (the thresholds below, measured
for HF fast tokenizers); a short call runs inline on the loop, but only while the thread is
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
# tokenized inline on the event loop, longer ones on the worker thread. Measured on the
# 2-core dev box with the tiny model's HF fast tokenizer (byte-level BPE, ~2.5 chars/token),
# medians: an encode costs ~40 us + ~0.3 us/char on the loop (200 chars 0.08 ms, 2,000 chars
# 0.62 ms, 11,230 chars = 4,494 tokens 3.2 ms). Through the thread, a 200-char prompt takes
# 190 us instead of 77 (the hop: +110 us) and still costs the loop 60 us of its own CPU (the
# wake-up, and the encode's GIL-held Python parts), so a short prompt gains nothing there.
# At 1,000 chars an inline encode stalls the loop ~0.35 ms, a few hops' worth; above that
# the thread wins: 16 concurrent 4,494-token prompts stalled the loop 55 ms inline, ~1 ms
# off it.
INLINE_PROMPT_CHARS = 1000

# Token ids fewer than this are decoded (one-shot, skipping special tokens) inline, more on
# the worker thread. Same box and tokenizer, medians through transformers' ``decode``: ~0.2
# us/id (200 ids 0.04 ms, 2,000 ids 0.41 ms, 8,000 ids 1.6 ms), so 1,500 ids stall the loop
# about as long as a 1,000-char encode (~0.3 ms). An incremental decode step (a few ids) is
# always short.
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
