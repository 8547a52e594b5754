"""Routing as a pipeline of pure plugins over snapshots: filters -> scorers -> picker.

``select(profile, candidates, request, rng, filters)`` is the entry point; ``build_profile``
turns the configured policy into a profile. See ``scorers`` for the expected-wait formula.
"""

from router.scheduling.profiles import (
                                     NoCandidate,
                                     Profile,
                                     build_profile,
                                     default_filters,
                                     select,
)
from router.scheduling.scorers import WaitModel, expected_wait_s
from router.scheduling.types import (
                                     Candidate,
                                     CandidateScore,
                                     Decision,
                                     LoadSample,
                                     NodeState,
                                     RequestInfo,
)

__all__ = [
                                     "Candidate",
                                     "CandidateScore",
                                     "Decision",
                                     "LoadSample",
                                     "NoCandidate",
                                     "NodeState",
                                     "Profile",
                                     "RequestInfo",
                                     "WaitModel",
                                     "build_profile",
                                     "default_filters",
                                     "expected_wait_s",
                                     "select",
]
