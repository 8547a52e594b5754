"""Range checks of sampling parameters shared by both of the node's services."""

from __future__ import annotations

import math
from collections.abc import Iterable

from gpumesh.node.errors import invalid


def check_sampling_ranges(temperature: float, top_p: float, stop: Iterable[str],
                          field_prefix: str = "") -> None:
    """Raises ``RequestError`` (INVALID_ARGUMENT) unless ``temperature`` is finite and >= 0,
    ``top_p`` is in (0, 1] and no stop string is empty. ``field_prefix`` (e.g. "sampling.")
    goes before the field names in the message."""
    if not math.isfinite(temperature) or temperature < 0:
        raise invalid(f"{field_prefix}temperature must be >= 0, got {temperature}")
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise invalid(f"{field_prefix}top_p must be in (0, 1], got {top_p}")
    if any(s == "" for s in stop):
        raise invalid(f"{field_prefix}stop must not contain empty strings")
