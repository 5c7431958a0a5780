"""Token buckets and log throttling: the broker's budgets per sender.

A `Bucket` holds up to `burst` units and refills at `rate` a second; spending may take it below
zero (an event's loop time is known only once it has been handled), and it is ready again once
refilled to the amount asked. A `LogThrottle` says whether a line about a key is due: at most one
per `every_s` per key, carrying how many occurrences it stood for, so a flood costs one log line
an interval instead of one per message.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Hashable


@dataclasses.dataclass(slots=True)
class Bucket:
    rate: float  # units a second
    burst: float  # units held at most
    level: float
    at: float  # clock reading `level` was last brought up to

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> Bucket:
        return cls(rate, burst, burst, now)

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.burst, self.level + (now - self.at) * self.rate)
            self.at = now

    def wait_s(self, now: float, need: float) -> float:
        """Seconds until the bucket holds `need` (0: it does now)."""
        self._refill(now)
        return max(0.0, (need - self.level) / self.rate)

    def take(self, now: float, n: float = 1.0) -> bool:
        """Spend `n` if the bucket holds it."""
        if self.wait_s(now, n) > 0:
            return False
        self.level -= n
        return True

    def spend(self, n: float) -> None:
        """Spend `n` whatever the bucket holds (work already done)."""
        self.level -= n

    def is_full(self, now: float) -> bool:
        self._refill(now)
        return self.level >= self.burst


class LogThrottle:
    """`due(key)`: the count of occurrences a log line about `key` should report now (the one
    just seen and those held back since the last line), or 0 while the last line is recent."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic, max_keys: int = 4096):
        self.every_s, self._clock, self._max_keys = every_s, clock, max_keys
        self._last: dict[Hashable, tuple[float, int]] = {}  # key -> (last line at, held back since)

    def due(self, key: Hashable, n: int = 1) -> int:
        now = self._clock()
        at, held = self._last.get(key, (-math.inf, 0))
        if now - at < self.every_s:
            self._last[key] = (at, held + n)
            return 0
        if key not in self._last and len(self._last) >= self._max_keys:  # keys come from the network: forget old ones
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.every_s}
            if len(self._last) >= self._max_keys:  # all recent: the metric still counts it
                return 0
        self._last[key] = (now, 0)
        return held + n
