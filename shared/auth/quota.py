"""What each API key may spend: requests per minute, tokens per minute, requests at once.

Rates are token buckets refilled continuously (capacity: one minute's worth, so a key may burst
its whole minute and then goes at its rate). Requests: one per request, taken at admission.
Tokens: a request's `max_new_tokens` is reserved at admission (when the bucket holds fewer it
is refused); once the reply is known the reservation is replaced by what it really used, prompt
and completion. A long prompt can therefore take the bucket below zero; the key's next request
waits until it has refilled. Every refusal says when a retry can succeed (`retry_after_s`).

`Quotas` counts one gateway process; `shared_quota.SharedQuotas` shares a key's rates across
replicas through NATS and keeps a `Quotas` too (its concurrency, and its limits while NATS is
away). The clock is injected, so the tests pin it. State is per key id, bounded by the key file
(`forget` drops the keys a reloaded file no longer has).
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
        # a reloaded key file may change a key's limits: its buckets take the new ones from here on
        st.requests.capacity, st.tokens.capacity = key.requests_per_minute, key.tokens_per_minute
        return st

    @contextlib.contextmanager
    def admit(self, key: ApiKey) -> Iterator[None]:
        """One request of `key` while the block runs: its concurrency and request rate are checked
        and charged (`QuotaExceededError` over either); tokens are `reserve`d once they are known."""
        st, now = self._of(key), self._clock()
        self.check_concurrency(key)
        if st.requests.refill(now) < 1:
            raise requests_refused(key, st.requests.wait_for(1))
        if st.tokens.refill(now) <= 0:  # a previous request's prompt overdrew it
            raise tokens_spent(key, st.tokens.wait_for(1))
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
        check_size(key, tokens)
        if bucket.level < tokens:
            raise tokens_short(key, bucket.level, tokens, bucket.wait_for(tokens))
        bucket.level -= tokens

    def settle(self, key: ApiKey, reserved: int, used: int) -> None:
        """Replace a reservation with what the request used (may overdraw the bucket)."""
        self._of(key).tokens.level += reserved - used

    def inflight(self, key: ApiKey) -> int:
        st = self._state.get(key.id)
        return st.inflight if st is not None else 0

    def check_concurrency(self, key: ApiKey) -> None:
        """`QuotaExceededError` when `key` has as many requests in flight here as it may."""
        n = self.inflight(key)
        if n >= key.max_concurrent:
            raise QuotaExceededError(f"this key already has {n} requests in flight (its limit); "
                                     "retry when one finishes", retry_after_s=1.0)

    def forget(self, keep: set[str]) -> None:
        """Drop the state of key ids not in `keep` (a reloaded key file) that have nothing in flight."""
        self._state = {k: st for k, st in self._state.items() if k in keep or st.inflight}


# The refusals, one wording whichever account refused (this process's or the shared one).
def requests_refused(key: ApiKey, wait_s: float) -> QuotaExceededError:
    return QuotaExceededError(f"this key's limit of {key.requests_per_minute} requests per minute is reached",
                              retry_after_s=_seconds(wait_s))


def tokens_spent(key: ApiKey, wait_s: float) -> QuotaExceededError:
    return QuotaExceededError(f"this key's budget of {key.tokens_per_minute} tokens per minute is spent",
                              retry_after_s=_seconds(wait_s))


def tokens_short(key: ApiKey, level: float, tokens: int, wait_s: float) -> QuotaExceededError:
    return QuotaExceededError(f"this key's budget of {key.tokens_per_minute} tokens per minute holds "
                              f"{max(0, int(level))} now, {tokens} asked", retry_after_s=_seconds(wait_s))


def check_size(key: ApiKey, tokens: int) -> None:
    """Refuse a reservation no full bucket could hold (retrying cannot help before a minute)."""
    if tokens > key.tokens_per_minute:
        raise QuotaExceededError(f"max_tokens {tokens} exceeds this key's budget of {key.tokens_per_minute} "
                                 "tokens per minute", retry_after_s=60.0)


def _seconds(s: float) -> float:
    """A Retry-After value: whole seconds, at least 1."""
    return float(max(1, math.ceil(s)))
