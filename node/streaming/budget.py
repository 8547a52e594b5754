"""``CoalescePolicy``: how long a stream's tokens may wait to share one message, and the node's
budget of stream messages that widens that wait under load.

The flush interval is ``flush_interval_s``, widened when the policy has a message budget
(``messages_per_s``, the node's default policy): with S streams sending (past their first
token, not ended) it is ``max(flush_interval_s, S / messages_per_s)``, at most
``MAX_FLUSH_INTERVAL_S``, re-read at every message. Why: a gRPC message costs the node's
process far more than a token does, and that process is what limits a GPU node
(docs/benchmarks.md, "What does the node's stream-message budget save?"), so a
loaded node sends fewer, larger chunks while an idle one keeps the short interval.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_FLUSH_INTERVAL_S = 0.25   # the widest a message budget makes the interval


@dataclass(frozen=True)
class CoalescePolicy:
    """flush_interval_s <= 0 or max_tokens <= 1 -> one message per engine output.

    ``messages_per_s`` > 0: the node's budget of stream messages per second over all its
    streams; the interval widens to ``streams / messages_per_s`` when that is longer (see the
    module docstring). 0: the interval is fixed (a client that set its own interval gets it).
    """

    flush_interval_s: float = 0.02
    max_tokens: int = 64
    messages_per_s: float = 0.0

    @property
    def per_token(self) -> bool:
        return self.flush_interval_s <= 0 or self.max_tokens <= 1

    def interval(self, streams: int) -> float:
        """The flush interval (s) with ``streams`` streams sending on the node."""
        if self.messages_per_s <= 0:
            return self.flush_interval_s
        return max(self.flush_interval_s,
                   min(MAX_FLUSH_INTERVAL_S, streams / self.messages_per_s))
