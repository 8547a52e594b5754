"""A bounded waiting line per model that is fair between client keys.

Who calls it: ``AdmissionQueue`` (one ``FairQueue`` per model). Waiters carry the API key
they came with (``router.auth``; "" without keys: one tenant, plain FIFO). Contract:

- Order: round robin over the keys that have waiters, FIFO within a key: a key's burst
  waits behind its own requests, not in front of everyone else's.
- Bound: ``bound`` waiters in all. When the line is full, a request whose key holds fewer
  than its fair share (bound / keys waiting, at least 1) takes the place of the newest
  waiter of the key holding the most, which is refused instead (``push`` returns it); a
  request of a key at or over its share is refused itself (``push`` returns None and the
  caller answers RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, Protocol, TypeVar


class _Keyed(Protocol):
    key: str


W = TypeVar("W", bound=_Keyed)


class FairQueue(Generic[W]):
    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._lines: OrderedDict[str, deque[W]] = OrderedDict()   # rotation order
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def queued(self, key: str) -> int:
        return len(self._lines.get(key, ()))

    def push(self, w: W) -> tuple[bool, W | None]:
        """Adds ``w`` unless the line is full: (admitted, waiter displaced to make room)."""
        if self._n < self.bound:
            self._add(w)
            return True, None
        share = max(1, self.bound // max(1, len(self._lines) + (w.key not in self._lines)))
        if self.queued(w.key) >= share or not self._lines:
            return False, None
        heaviest = max(self._lines, key=lambda k: len(self._lines[k]))
        if len(self._lines[heaviest]) <= self.queued(w.key) + 1:
            return False, None
        displaced = self._lines[heaviest].pop()   # its newest
        self._n -= 1
        if not self._lines[heaviest]:
            del self._lines[heaviest]
        self._add(w)
        return True, displaced

    def _add(self, w: W) -> None:
        line = self._lines.get(w.key)
        if line is None:
            line = self._lines[w.key] = deque()
        line.append(w)
        self._n += 1

    def peek(self) -> W | None:
        """The next waiter to serve (the head of the key whose turn it is)."""
        for line in self._lines.values():
            return line[0]
        return None

    def pop(self) -> W:
        """Removes the waiter ``peek`` returned; that key's turn passes to the next key."""
        key, line = next(iter(self._lines.items()))
        w = line.popleft()
        self._n -= 1
        del self._lines[key]
        if line:
            self._lines[key] = line   # to the back of the rotation
        return w

    def remove(self, w: W) -> bool:
        line = self._lines.get(w.key)
        if line is None or w not in line:
            return False
        line.remove(w)
        self._n -= 1
        if not line:
            del self._lines[w.key]
        return True

    def __contains__(self, w: object) -> bool:
        key = getattr(w, "key", None)
        return key in self._lines and w in self._lines[key]
