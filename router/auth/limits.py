"""Per-key quotas: request rate, token rate (token buckets) and concurrency.

``KeyLimits.admit(key, tokens)`` either returns a ``Grant`` (release it when the request ends)
or raises ``OverQuota`` with the seconds after which the same request would be admitted.
Pure bookkeeping on the event loop; the clock is injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpumesh.router.auth.keys import ApiKey


class OverQuota(Exception):
    def __init__(self, what: str, retry_after_s: float) -> None:
        super().__init__(what)
        self.what = what
        self.retry_after_s = retry_after_s


@dataclass
class _Bucket:
    rate: float
    burst: float
    level: float
    at: float

    def refill(self, now: float) -> None:
        self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` is available (0: now)."""
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate


@dataclass
class _KeyState:
    requests: _Bucket | None
    tokens: _Bucket | None
    in_flight: int = 0
    limits: ApiKey | None = field(default=None)


class Grant:
    __slots__ = ("_state", "released")

    def __init__(self, state: _KeyState | None) -> None:
        self._state = state
        self.released = False

    def release(self) -> None:
        if not self.released and self._state is not None:
            self._state.in_flight -= 1
        self.released = True


NO_GRANT = Grant(None)


class KeyLimits:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._state: dict[str, _KeyState] = {}

    def _state_for(self, key: ApiKey, now: float) -> _KeyState:
        s = self._state.get(key.name)
        if s is None or s.limits != key:   # new key, or its limits changed (file reloaded)
            in_flight = s.in_flight if s is not None else 0
            s = _KeyState(
                _Bucket(key.requests_per_s, key.burst, key.burst, now)
                if key.requests_per_s > 0 else None,
                _Bucket(key.tokens_per_s, max(key.tokens_per_s * 2, 1.0),
                        max(key.tokens_per_s * 2, 1.0), now) if key.tokens_per_s > 0 else None,
                in_flight, key)
            self._state[key.name] = s
        return s

    def admit(self, key: ApiKey, tokens: int) -> Grant:
        now = self.clock()
        s = self._state_for(key, now)
        if key.max_concurrency and s.in_flight >= key.max_concurrency:
            raise OverQuota(f"{s.in_flight} requests in flight (max_concurrency "
                            f"{key.max_concurrency})", 1.0)
        if s.requests is not None:
            s.requests.refill(now)
            wait = s.requests.wait_for(1.0)
            if wait > 0:
                raise OverQuota(f"over {key.requests_per_s:g} requests/s", wait)
        if s.tokens is not None:
            s.tokens.refill(now)
            need = min(float(tokens), s.tokens.burst)   # one request larger than the burst
            wait = s.tokens.wait_for(need)               # waits for a full bucket, not forever
            if wait > 0:
                raise OverQuota(f"over {key.tokens_per_s:g} tokens/s", wait)
            s.tokens.level -= need
        if s.requests is not None:
            s.requests.level -= 1.0
        s.in_flight += 1
        return Grant(s)
