"""Coalesced token streams: fewer, larger messages so one router core carries many GPUs.

Contract (issue 8): the first output goes out alone and at once (coalescing adds no TTFT);
later outputs are merged until ``flush_interval_s`` has passed since the previous message was
sent or ``max_tokens`` tokens are pending, whichever is first; the final output (with a finish
reason) is sent at once with whatever is pending. No token waits longer than one flush
interval after it arrived, even if the engine stalls (a timer, not only the next output,
triggers the flush). Engines yield text deltas that never split a multi-byte character, and
joining deltas preserves that; stop strings were already removed by the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from node.engine import EngineOutput


@dataclass(frozen=True)
class CoalescePolicy:
    """flush_interval_s <= 0 or max_tokens <= 1 -> one message per engine output."""

    flush_interval_s: float = 0.02
    max_tokens: int = 64

    @property
    def per_token(self) -> bool:
        return self.flush_interval_s <= 0 or self.max_tokens <= 1


def _merge(parts: list[EngineOutput]) -> EngineOutput:
    if len(parts) == 1:
        return parts[0]
    ids: list[int] = []
    for p in parts:
        ids.extend(p.token_ids)
    return EngineOutput(tuple(ids), "".join(p.text for p in parts), parts[-1].finish)


async def coalesce(outputs: AsyncIterator[EngineOutput], policy: CoalescePolicy,
                   clock: Callable[[], float] = time.monotonic) -> AsyncIterator[EngineOutput]:
    """Re-chunks an engine's per-step outputs. Closing this generator closes ``outputs``."""
    it = aiter(outputs)
    if policy.per_token:
        async for out in it:
            yield out
        return

    pending: list[EngineOutput] = []
    pending_tokens = 0
    next_task: asyncio.Future[EngineOutput] | None = None
    sent_first = False
    last_sent = clock()
    try:
        while True:
            if not pending:
                try:
                    out = await anext(it) if next_task is None else await next_task
                except StopAsyncIteration:
                    return
                next_task = None
            else:
                # Wait for the next output, but no longer than the flush deadline.
                if next_task is None:
                    next_task = asyncio.ensure_future(anext(it))
                timeout = max(0.0, last_sent + policy.flush_interval_s - clock())
                done, _ = await asyncio.wait((next_task,), timeout=timeout)
                if not done:
                    yield _merge(pending)
                    pending, pending_tokens, last_sent = [], 0, clock()
                    continue
                try:
                    out = next_task.result()
                except StopAsyncIteration:
                    yield _merge(pending)
                    return
                finally:
                    next_task = None

            pending.append(out)
            pending_tokens += len(out.token_ids)
            now = clock()
            if (not sent_first or out.finish is not None or pending_tokens >= policy.max_tokens
                    or now - last_sent >= policy.flush_interval_s):
                sent_first = sent_first or pending_tokens > 0
                yield _merge(pending)
                pending, pending_tokens, last_sent = [], 0, clock()
                if out.finish is not None:
                    return
    finally:
        if next_task is not None:
            # Cancelling the pending anext() aborts the request in the engine; wait for it to
            # unwind before closing the generator it runs in.
            next_task.cancel()
            with contextlib.suppress(BaseException):
                await next_task
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()
