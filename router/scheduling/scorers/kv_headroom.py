"""The ``kv_headroom`` scorer: how much KV cache a node has left.

The curve: 1 - k, linear in the KV usage k (clamped to [0, 1]): 1 on an empty cache, 0 on a
full one. k is the last known report's usage, moved by this router's unreported requests
(``expected_wait.effective_kv_usage``) when a ``WaitModel`` is given.
"""

from __future__ import annotations

from gpumesh.router.scheduling.scorers.expected_wait import WaitModel, effective_kv_usage
from gpumesh.router.scheduling.types import Candidate


def kv_headroom(c: Candidate, m: WaitModel | None = None) -> float:
    """1 - KV usage (linear): the last known report's, moved by this router's unreported
    requests (``effective_kv_usage``) when ``m`` is given; 1 when the node never reported."""
    k = c.kv_cache_usage if m is None else effective_kv_usage(c, m)
    return min(max(1.0 - k, 0.0), 1.0)
