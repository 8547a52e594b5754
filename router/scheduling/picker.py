"""Picker: the candidate with the highest weighted score; ties broken by the injected RNG."""

from __future__ import annotations

import random
from collections.abc import Sequence

from gpumesh.router.scheduling.types import CandidateScore

TIE_EPSILON = 1e-9


def pick_max(scored: Sequence[CandidateScore], rng: random.Random) -> tuple[CandidateScore, int]:
    """Returns (winner, number tied for the best total). Among ties the choice is uniform
    (candidates are ordered by node id first, so a seeded RNG gives reproducible picks)."""
    if not scored:
        raise ValueError("pick_max needs at least one candidate")
    best = max(s.total for s in scored)
    tied = sorted((s for s in scored if s.total >= best - TIE_EPSILON), key=lambda s: s.node_id)
    return (tied[0] if len(tied) == 1 else rng.choice(tied)), len(tied)
