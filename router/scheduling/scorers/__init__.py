"""Scorers: each maps a candidate to [0, 1], 1 best; pure functions of a ``Candidate``. One
module per scorer, each documenting its curve: ``expected_wait`` (the default profile's main
term, with its cost model), ``kv_headroom``, ``least_request``."""

from gpumesh.router.scheduling.scorers.expected_wait import (
    WaitModel,
    effective_kv_usage,
    expected_admission_s,
    expected_miss_s,
    expected_service_s,
    expected_wait_s,
    wait_score,
)
from gpumesh.router.scheduling.scorers.kv_headroom import kv_headroom
from gpumesh.router.scheduling.scorers.least_request import least_request

__all__ = [
    "WaitModel",
    "effective_kv_usage",
    "expected_admission_s",
    "expected_miss_s",
    "expected_service_s",
    "expected_wait_s",
    "kv_headroom",
    "least_request",
    "wait_score",
]
