"""A manual clock for code that takes ``clock: Callable[[], float]`` (registry, dispatcher,
session table ...): it stands still until a test moves ``t``."""

from __future__ import annotations


class ManualClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
