"""The ``least_request`` scorer: this router's in-flight requests per unit of capacity weight.

The curve: 1 / (1 + in_flight / w), hyperbolic: 1 when idle, 0.5 at one request per unit of
weight, towards 0 as requests pile up (nginx ``least_conn`` with server weights).
"""

from __future__ import annotations

from gpumesh.router.scheduling.types import Candidate


def least_request(c: Candidate) -> float:
    """1 / (1 + in_flight / w): this router's in-flight count per unit of capacity weight
    (nginx ``least_conn`` with server weights). 1 when idle, 0.5 at one request per unit."""
    weight = c.capacity_weight if c.capacity_weight > 0 else 1.0
    return 1.0 / (1.0 + c.router_in_flight / weight)
