"""Coalesced token streams: fewer, larger messages so one router core carries many GPUs.

Contract: the first output goes out alone and at once (coalescing adds no TTFT); later outputs
are merged until the flush interval (:meth:`CoalescePolicy.interval`) has passed since the
previous message was sent or ``max_tokens`` tokens are pending, whichever is first; the final
output (with a finish reason) is sent at once with whatever is pending. No token waits longer
than one flush interval after it arrived, even if the engine stalls (a timer, not only the
next output, triggers the flush). Engines yield text deltas that never split a multi-byte
character, and joining deltas preserves that; stop strings were already removed by the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gpumesh.node.engines.base import EngineOutput
from gpumesh.node.streaming.budget import CoalescePolicy


def _merge(parts: list[EngineOutput]) -> EngineOutput:
    if len(parts) == 1:
        return parts[0]
    ids: list[int] = []
    for p in parts:
        ids.extend(p.token_ids)
    return EngineOutput(tuple(ids), "".join(p.text for p in parts), parts[-1].finish,
                        parts[-1].kv_transfer_params)


async def coalesce(outputs: AsyncIterator[EngineOutput], policy: CoalescePolicy,
                   clock: Callable[[], float] = time.monotonic,
                   streams: Callable[[], int] = lambda: 1) -> AsyncIterator[EngineOutput]:
    """Re-chunks an engine's per-step outputs. Closing this generator closes ``outputs``.
    ``streams``: how many streams the node has sending now (read when the policy has a
    message budget).

    A pump task drains the engine into a buffer; this generator sends the buffer once per
    flush interval (at once for the first tokens, the final output, the token cap, an error).
    Per engine output that costs one append, not a task and a timed wait: the node's process
    is what limits a GPU node, so per-token work matters.
    """
    it = aiter(outputs)
    if policy.per_token:
        async for out in it:
            yield out
        return

    buf: list[EngineOutput] = []
    wake = asyncio.Event()     # the buffer has something
    urgent = asyncio.Event()   # send it now: first tokens, final output, token cap, end, error
    st = _PumpState()

    async def pump() -> None:
        try:
            async for out in it:
                buf.append(out)
                st.pending_tokens += len(out.token_ids)
                if (out.finish is not None or st.pending_tokens >= policy.max_tokens
                        or (not st.sent_first and st.pending_tokens > 0)):
                    urgent.set()
                wake.set()
                if out.finish is not None:
                    break
        except Exception as e:  # noqa: BLE001 - handed to the consumer, raised there
            st.error = e
        finally:
            st.done = True
            urgent.set()
            wake.set()

    task = asyncio.create_task(pump())
    last_sent = clock()
    try:
        while True:
            if not buf and not st.done:
                wake.clear()
                await wake.wait()
            if buf and st.sent_first and not urgent.is_set():
                remaining = last_sent + policy.interval(streams()) - clock()
                if remaining > 0:
                    # Tokens arriving meanwhile join this message; the first of them has then
                    # waited at most one flush interval.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(remaining):
                            await urgent.wait()
            if buf:
                parts = buf[:]
                buf.clear()
                st.sent_first = st.sent_first or st.pending_tokens > 0
                st.pending_tokens = 0
                if not st.done:
                    urgent.clear()
                last_sent = clock()
                out = _merge(parts)
                yield out
                if out.finish is not None:
                    return
            elif st.done:
                if st.error is not None:
                    raise st.error
                return
    finally:
        if not task.done():
            # Cancelling the pump's pending anext() aborts the request in the engine; wait
            # for it to unwind before closing the generator it runs in.
            task.cancel()
        with contextlib.suppress(BaseException):
            await task
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


@dataclass
class _PumpState:
    pending_tokens: int = 0
    sent_first: bool = False
    done: bool = False
    error: Exception | None = None
