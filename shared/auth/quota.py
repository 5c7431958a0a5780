"""What each API key may spend: requests per minute, tokens per minute, requests at once.

Rates are token buckets refilled continuously (capacity: one minute's worth, so a key may burst
its whole minute and then goes at its rate). Requests: one per request, taken at admission.
Tokens: a request's `max_new_tokens` is reserved at admission (when the bucket holds fewer it
is refused); once the reply is known the reservation is replaced by what it really used, prompt
and completion. A long prompt can therefore take the bucket below zero; the key's next request
waits until it has refilled. Every refusal says when a retry can succeed (`retry_after_s`).

Limits are per gateway process (replicas each allow a key its limits). The clock is injected,
so the tests pin it. State is per key id, bounded by the key file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator

from droidmesh.shared.auth.keys import ApiKey
from droidmesh.shared.errors import QuotaExceededError


@dataclasses.dataclass
class Bucket:
    """`level` units, refilled at `capacity` per minute up to `capacity`."""

    capacity: float
    level: float
    at: float  # clock time `level` was computed at

    def refill(self, now: float) -> float:
        # a clock that steps back refills nothing (and takes nothing)
        self.level = min(self.capacity, self.level + max(0.0, now - self.at) * self.capacity / 60.0)
        self.at = max(self.at, now)
        return self.level

    def wait_for(self, amount: float) -> float:
        """Seconds until the bucket holds `amount` (after `refill`)."""
        return max(0.0, (amount - self.level) * 60.0 / self.capacity)


@dataclasses.dataclass
class _KeyState:
    requests: Bucket
    tokens: Bucket
    inflight: int = 0


class Quotas:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._state: dict[str, _KeyState] = {}

    def _of(self, key: ApiKey) -> _KeyState:
        st = self._state.get(key.id)
        if st is None:
            now = self._clock()
            st = self._state[key.id] = _KeyState(Bucket(key.requests_per_minute, key.requests_per_minute, now),
                                                 Bucket(key.tokens_per_minute, key.tokens_per_minute, now))
        return st

    @contextlib.contextmanager
    def admit(self, key: ApiKey) -> Iterator[None]:
        """One request of `key` while the block runs: its concurrency and request rate are checked
        and charged (`QuotaExceededError` over either); tokens are `reserve`d once they are known."""
        st, now = self._of(key), self._clock()
        if st.inflight >= key.max_concurrent:
            raise QuotaExceededError(f"this key already has {st.inflight} requests in flight (its limit); "
                                     "retry when one finishes", retry_after_s=1.0)
        if st.requests.refill(now) < 1:
            raise QuotaExceededError(f"this key's limit of {key.requests_per_minute} requests per minute is reached",
                                     retry_after_s=_seconds(st.requests.wait_for(1)))
        if st.tokens.refill(now) <= 0:  # a previous request's prompt overdrew it
            raise QuotaExceededError(f"this key's budget of {key.tokens_per_minute} tokens per minute is spent",
                                     retry_after_s=_seconds(st.tokens.wait_for(1)))
        st.requests.level -= 1
        st.inflight += 1
        try:
            yield
        finally:
            st.inflight -= 1

    def reserve(self, key: ApiKey, tokens: int) -> None:
        """Take `tokens` (a request's max_new_tokens) from `key`'s budget, or refuse the request."""
        st = self._of(key)
        bucket = st.tokens
        bucket.refill(self._clock())
        if tokens > bucket.capacity:
            raise QuotaExceededError(f"max_tokens {tokens} exceeds this key's budget of {key.tokens_per_minute} "
                                     "tokens per minute", retry_after_s=60.0)
        if bucket.level < tokens:
            raise QuotaExceededError(f"this key's budget of {key.tokens_per_minute} tokens per minute holds "
                                     f"{max(0, int(bucket.level))} now, {tokens} asked",
                                     retry_after_s=_seconds(bucket.wait_for(tokens)))
        bucket.level -= tokens

    def settle(self, key: ApiKey, reserved: int, used: int) -> None:
        """Replace a reservation with what the request used (may overdraw the bucket)."""
        self._of(key).tokens.level += reserved - used

    def inflight(self, key: ApiKey) -> int:
        st = self._state.get(key.id)
        return st.inflight if st is not None else 0


def _seconds(s: float) -> float:
    """A Retry-After value: whole seconds, at least 1."""
    return float(max(1, math.ceil(s)))
