"""A circuit breaker per holder (sender_id): a sender that keeps failing stops being pulled from.

States per holder:
  closed     pulls go ahead; `failures` consecutive failed pulls (or one `hard` failure: its
             connection was refused, it is gone) open the circuit;
  open       no pulls for `cooldown_s`: requests the broker sends to this holder fall back at once
             (reason `holder_open_circuit`) instead of each waiting out a reuse timeout;
  half-open  after the cool-down one request probes the holder; success closes the circuit,
             failure opens it for another cool-down. Other requests keep falling back meanwhile.
A success at any time resets the count. Memory is bounded: at most `max_holders` holders are
tracked (the oldest closed entries are forgotten first; an entry is only a few numbers).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

State = Literal["closed", "open", "half_open"]


@dataclass
class _Holder:
    failures: int = 0
    opened_at: float | None = None  # monotonic time the circuit opened; None: closed
    probing: bool = False  # half-open: one probe is in flight


class Breaker:
    def __init__(self, failures: int, cooldown_s: float, *, max_holders: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1 or cooldown_s <= 0:
            raise ValueError("failures must be >= 1 and cooldown_s > 0")
        self.failures, self.cooldown_s, self._max, self._clock = failures, cooldown_s, max_holders, clock
        self._holders: OrderedDict[str, _Holder] = OrderedDict()

    def state(self, holder: str) -> State:
        h = self._holders.get(holder)
        if h is None or h.opened_at is None:
            return "closed"
        return "open" if self._clock() - h.opened_at < self.cooldown_s and not h.probing else "half_open"

    def allow(self, holder: str) -> bool:
        """May a request pull from `holder` now? True in the closed state and for the single
        half-open probe after the cool-down (the caller must then report its outcome)."""
        h = self._holders.get(holder)
        if h is None or h.opened_at is None:
            return True
        if h.probing or self._clock() - h.opened_at < self.cooldown_s:
            return False
        h.probing = True
        return True

    def success(self, holder: str) -> None:
        self._holders.pop(holder, None)  # closed with no failures is the default: nothing to keep

    def failure(self, holder: str, *, hard: bool = False) -> bool:
        """Count a failed pull; True when this failure opened (or re-opened) the circuit."""
        h = self._holders.get(holder)
        if h is None:
            h = self._holders[holder] = _Holder()
            self._bound()
        self._holders.move_to_end(holder)
        h.failures += 1
        was_open = h.opened_at is not None and not h.probing
        if h.probing or hard or h.failures >= self.failures:
            h.opened_at, h.probing = self._clock(), False
            return not was_open
        return False

    def release(self, holder: str) -> None:
        """A probe that ended with neither outcome (cancelled, the deadline went elsewhere): let
        the next request probe instead of leaving the circuit half-open forever."""
        h = self._holders.get(holder)
        if h is not None:
            h.probing = False

    def open_holders(self) -> list[str]:
        return [k for k, h in self._holders.items() if h.opened_at is not None]

    def _bound(self) -> None:
        while len(self._holders) > self._max:
            victim = next((k for k, h in self._holders.items() if h.opened_at is None), None)
            self._holders.pop(victim if victim is not None else next(iter(self._holders)))
