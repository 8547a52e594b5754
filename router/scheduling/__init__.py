"""Routing: filters, then one policy's pick (``pipeline.select`` / ``select_from``).

The default policy, ``predicted_latency``, predicts each candidate's time to first token and
completion time in seconds from its engine profile (``predictor``) and picks by the
configured objective; ``least_request``, ``power_of_two`` and ``round_robin`` are plain
baselines. ``build_policy`` makes the one ``RoutingSettings.policy`` names.
"""

from gpumesh.router.scheduling.pipeline import NoCandidate, default_filters, select, select_from
from gpumesh.router.scheduling.policies import Policy, build_policy
from gpumesh.router.scheduling.settings import RoutingSettings
from gpumesh.router.scheduling.types import (
    Candidate,
    CandidateScore,
    CandidateSource,
    Decision,
    ListCandidates,
    NodeState,
    RequestInfo,
)

__all__ = [
    "Candidate",
    "CandidateScore",
    "CandidateSource",
    "Decision",
    "ListCandidates",
    "NoCandidate",
    "NodeState",
    "Policy",
    "RequestInfo",
    "RoutingSettings",
    "build_policy",
    "default_filters",
    "select",
    "select_from",
]
