"""Routing as a pipeline of pure plugins over snapshots: filters -> scorers -> picker.

``select(profile, candidates, request, rng, filters)`` is the entry point (``select_from`` for
a lazily read ``CandidateSource`` with power-of-d sampling on large fleets); ``build_profile``
turns the configured policy into a profile. See ``scorers`` for the expected-wait formula.
"""

from gpumesh.router.scheduling.profiles import (
                                     NoCandidate,
                                     Profile,
                                     build_profile,
                                     default_filters,
                                     select,
                                     select_from,
)
from gpumesh.router.scheduling.scorers import WaitModel, expected_wait_s
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
                                     "Profile",
                                     "RequestInfo",
                                     "WaitModel",
                                     "build_profile",
                                     "default_filters",
                                     "expected_wait_s",
                                     "select",
                                     "select_from",
]
