"""The ``adapter`` scorer and the ``serves_adapter`` filter: send a LoRA request where its
adapter is loaded, and charge the load elsewhere.

The curve, for a request naming adapter a (``RequestInfo.adapter``) and candidate n::

    score(n) = 1                                   a is loaded on n (n's fresh report lists it)
             = 1 / (1 + load_s(n) / wait_scale_s)  otherwise
    load_s(n) = n's reported adapter_load_s (its recent loads' mean) when it measured one,
                else ``default_load_s`` (RouterConfig.adapter_load_s)

The same hyperbola as ``expected_wait``'s ``wait_score`` with the load time as the wait: 0.5
when a load takes wait_scale_s. A request without an adapter scores 1 everywhere (the term
then changes no decision). A node without a fresh report (STALE) is taken not to hold it.

``serves_adapter(a)`` drops the candidates that cannot serve a at all (their registration does
not list it): such a node would answer NOT_FOUND. The router answers NOT_FOUND itself when no
node of the model lists the adapter (``router.api.intake``).
"""

from __future__ import annotations

from collections.abc import Sequence

from gpumesh.router.scheduling.types import Candidate


def adapter_loaded(c: Candidate, adapter: str) -> bool:
    """True when ``c``'s fresh report lists ``adapter`` as loaded."""
    return c.report is not None and adapter in c.report.loaded_adapters


def adapter_score(c: Candidate, adapter: str, default_load_s: float,
                  wait_scale_s: float) -> float:
    """1 when loaded (or no adapter), else 1 / (1 + load_s / wait_scale_s) (module doc)."""
    if not adapter or adapter_loaded(c, adapter):
        return 1.0
    measured = c.report.adapter_load_s if c.report is not None else 0.0
    load_s = measured if measured > 0 else default_load_s
    return 1.0 / (1.0 + max(load_s, 0.0) / wait_scale_s)


class serves_adapter:  # a filter factory, called like a filter (scheduling.filters)
    """Drops candidates whose registration does not list the adapter. Judges each candidate
    alone, so a sampled decision's verdict holds for the fleet."""

    def __init__(self, adapter: str) -> None:
        self.adapter = adapter

    def __call__(self, candidates: Sequence[Candidate]
                 ) -> tuple[list[Candidate], dict[str, str]]:
        a = self.adapter
        kept = [c for c in candidates if a in c.adapters]
        return kept, {c.node_id: f"does not serve adapter {a!r}"
                      for c in candidates if a not in c.adapters}
